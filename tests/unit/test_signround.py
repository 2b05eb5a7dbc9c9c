"""SignRound (edgeprune.methods.signround): RTN at zero steps, the learned grid, the
export parity of its codes, composition with pruning and AWQ, bad settings."""

from __future__ import annotations

import copy

import pytest
import torch

from edgeprune.engine import compress
from edgeprune.errors import ConfigError
from edgeprune.methods.signround import SignRound, SignRoundConfig, signround_grid
from edgeprune.quantize import qparams
from edgeprune.recipe import AWQConfig, Recipe, RTNConfig, SparseGPTConfig

from tiny import assert_int4_export_matches


def _calib(n=8, s=32, seed=1):
    return torch.randint(0, 256, (n, s), generator=torch.Generator().manual_seed(seed))


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n}


@pytest.mark.parametrize("bits,group_size,sym", [(4, 32, False), (4, 32, True), (2, -1, True), (3, 32, False),
                                                 (8, -1, False)])
def test_zero_iterations_equals_rtn_exactly(tiny_llama, bits, group_size, sym):
    ids = _calib()
    rtn_model = copy.deepcopy(tiny_llama)
    ref = compress(rtn_model, RTNConfig(bits=bits, group_size=group_size, sym=sym), ids, progress=False)
    res = compress(tiny_llama, SignRoundConfig(bits=bits, group_size=group_size, sym=sym, iters=0), ids,
                   progress=False)
    assert set(res.quantized) == set(ref.quantized) == set(_linears(tiny_llama))
    for name, q in res.quantized.items():
        r = ref.quantized[name]
        assert torch.equal(q.codes, r.codes) and torch.equal(q.scales, r.scales) and torch.equal(q.zeros, r.zeros)
        assert torch.equal(tiny_llama.get_submodule(name).weight, rtn_model.get_submodule(name).weight)


@pytest.mark.parametrize("sym", [False, True])
def test_unit_clipping_is_the_rtn_grid_bit_for_bit(sym):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g) * torch.rand(300, 1, generator=g)
    w[3] = 0.0                       # an all-zero group gets scale 1
    w[4] = w[4].abs()                # a group without negatives
    for bits in (2, 3, 4, 8):
        s_ref, z_ref = qparams(w, bits, sym)
        wmin = w.amin(1, keepdim=True).clamp(max=0)
        wmax = w.amax(1, keepdim=True).clamp(min=0)
        s, z = signround_grid(wmin, wmax, torch.ones_like(wmin), torch.ones_like(wmax), bits, sym)
        assert torch.equal(s, s_ref) and torch.equal(z, z_ref)


def _block_error(model, dense, ids):
    with torch.no_grad():
        a = model.model(ids).last_hidden_state
        b = dense.model(ids).last_hidden_state
    return float(((a - b) ** 2).mean())


@pytest.mark.parametrize("sym", [False, True])
def test_tuning_lowers_the_output_error_below_rtn(tiny_llama, sym):
    ids = _calib(8, 48)
    dense = copy.deepcopy(tiny_llama)
    rtn = copy.deepcopy(tiny_llama)
    compress(rtn, RTNConfig(bits=3, group_size=32, sym=sym), ids, progress=False)
    sr = copy.deepcopy(tiny_llama)
    res = compress(sr, SignRoundConfig(bits=3, group_size=32, sym=sym, iters=60, batch_size=4), ids,
                   progress=False)
    held_out = _calib(8, 48, seed=7)
    assert _block_error(sr, dense, held_out) < 0.9 * _block_error(rtn, dense, held_out)
    for name, mod in _linears(sr).items():  # the model holds exactly the codes' dequantization
        q = res.quantized[name]
        assert torch.equal(mod.weight.detach(), q.dequantize()) and int(q.codes.max()) <= 7
        per_row = max(torch.unique(mod.weight[r, :32]).numel() for r in range(mod.weight.shape[0]))
        assert per_row <= 8


def test_learned_offsets_and_clipping_stay_in_bounds(tiny_llama):
    meth = SignRound(SignRoundConfig(bits=4, group_size=32, iters=30, lr=0.2, batch_size=2))
    block = tiny_llama.model.layers[0]
    from edgeprune.blocks import capture_block_inputs
    from edgeprune.methods.base import InputStats, LayerTask
    batches = capture_block_inputs(tiny_llama, tiny_llama.model.layers, _calib(), None, 4, torch.device("cpu"))
    tasks = [LayerTask(name=f"model.layers.0.{n}", module=m, weight=m.weight.detach().float().clone(), mask=None,
                       stats=InputStats.empty(m.in_features, False))
             for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
    seen = []
    orig = SignRound._tune

    def spy(self, block, layers, *a):
        best, losses = orig(self, block, layers, *a)
        seen.extend(best)
        return best, losses

    SignRound._tune = spy
    try:
        with torch.no_grad():
            meth.compress_block(block, tasks, inputs=batches)
    finally:
        SignRound._tune = orig
    assert seen and meth.last_losses[0][1] <= meth.last_losses[0][0]
    for v, a, b in seen:
        assert float(v.abs().max()) <= 0.5 and float(a.min()) >= 0 and float(b.max()) <= 1


@pytest.mark.parametrize("grid", [{}, {"sym": True, "full_range": True}], ids=["asym", "full-range"])
def test_packed_int4_export_matches_the_fake_quant_model(tiny_llama, tmp_path, grid):
    """Also with the full-range grid's negative scales, which must survive packing."""
    res = compress(tiny_llama, SignRoundConfig(bits=4, group_size=32, iters=20, batch_size=4, **grid), _calib(),
                   progress=False)
    if grid:
        assert any(float(q.scales.min()) < 0 for q in res.quantized.values())
    assert_int4_export_matches(tiny_llama, res.quantized, tmp_path / "m")


def test_full_range_grid_puts_the_largest_magnitude_on_code_zero():
    """AutoRound's ``int_sym`` / Q4_0 grid: a step of max|w| / 8, the scale's sign chosen so
    the largest magnitude is code 0 and dequantizes to itself (fp16 scale rounding aside)."""
    from edgeprune.methods.signround import _Layer
    from edgeprune.methods.base import LayerTask

    w = torch.tensor([[0.1, -0.8, 0.3, 0.04], [0.6, -0.2, 0.0, 0.1]])
    t = LayerTask(name="l", module=torch.nn.Linear(4, 2, bias=False), weight=w, mask=None, stats=None)
    q = _Layer(t, "l.weight", 4, 4, True, False, full_range=True).quantized(0.0, 1.0, 1.0)
    assert q.scales[:, 0].tolist() == pytest.approx([0.1, -0.075], rel=1e-3)
    assert q.codes.tolist() == [[9, 0, 11, 8], [0, 11, 8, 7]] and q.zeros.flatten().tolist() == [8, 8]
    torch.testing.assert_close(q.dequantize()[:, :2], torch.tensor([[0.1, -0.8], [0.6, -0.225]]), rtol=1e-3,
                               atol=1e-4)
    half = _Layer(t, "l.weight", 4, 4, True, False).quantized(0.0, 1.0, 1.0)
    err = lambda qw: float((qw.dequantize() - w).abs().max())   # noqa: E731
    assert err(q) < err(half)
    with pytest.raises(ConfigError, match="full_range applies to the symmetric grid only"):
        SignRoundConfig.from_options(full_range=True, sym=False)


def test_after_sparsegpt_24_a_pruned_weight_stays_zero(tiny_llama):
    res = compress(tiny_llama, [SparseGPTConfig(prune_n=2, prune_m=4),
                                SignRoundConfig(bits=4, group_size=32, iters=10, batch_size=4)], _calib(),
                   progress=False)
    for name, mod in _linears(tiny_llama).items():
        w, q, keep = mod.weight.detach(), res.quantized[name], res.masks[name]
        assert torch.equal(w == 0, ~keep | (w == 0)) and not bool((w[~keep] != 0).any())
        nz = (keep.reshape(w.shape[0], -1, 4)).sum(-1)
        assert int(nz.max()) <= 2
        zeros = q.zeros.long().repeat_interleave(32, 1)
        assert torch.equal(q.codes.long()[~keep], zeros[~keep])  # the zero point: exactly 0
        assert torch.equal(w, q.dequantize())


def test_after_awq_scales(tiny_qwen2):
    res = compress(tiny_qwen2, [AWQConfig(group_size=32), SignRoundConfig(group_size=32, iters=5, batch_size=4)],
                   _calib(), progress=False)
    assert set(res.quantized) == set(_linears(tiny_qwen2))
    assert all(q.meta["method"] == "signround" for q in res.quantized.values())
    assert all(bool(torch.isfinite(m.weight).all()) for m in _linears(tiny_qwen2).values())


def test_schedules():
    assert SignRoundConfig().resolved() == (50, 5e-3, 5e-3, 4)
    assert SignRoundConfig(schedule="thorough").resolved() == (200, 1 / 200, 1 / 200, 8)
    assert SignRoundConfig(iters=100).resolved() == (100, 0.01, 0.01, 4)
    assert SignRoundConfig(iters=100, lr=0.02, minmax_lr=0.01, batch_size=2).resolved() == (100, 0.02, 0.01, 2)
    r = Recipe.from_dict({"stages": [{"method": "signround", "schedule": "thorough", "group_size": 32}]})
    assert r.stages[0].resolved()[0] == 200


@pytest.mark.parametrize("opts,match", [
    ({"iters": -1}, "iters=-1 must be >= 0"),
    ({"lr": 0.0}, "lr=0.0 must be a positive number"),
    ({"lr": -0.1}, "lr=-0.1 must be a positive number"),
    ({"minmax_lr": 0}, "minmax_lr=0 must be a positive number"),
    ({"batch_size": 0}, "batch_size=0 must be >= 1"),
    ({"schedule": "slow"}, "schedule='slow' is unknown"),
    ({"bits": 5}, "bits=5 is not supported"),
    ({"iters": "50"}, "must be an integer"),
    ({"sampler": "stratified"}, "sampler='stratified' is unknown"),
])
def test_bad_settings_are_refused(opts, match):
    with pytest.raises(ConfigError, match=match):
        SignRoundConfig.from_options(**opts)
    with pytest.raises(ConfigError, match=match):
        Recipe.from_dict({"stages": [{"method": "signround", **opts}]}).validate()


def test_cyclic_sampler_uses_every_window_equally_often():
    from edgeprune.methods.signround import _WindowSampler
    s = _WindowSampler([8, 8, 8, 8], 4, "cyclic", torch.Generator().manual_seed(3))
    seen = [(bi, r) for _ in range(24) for bi, rows in [s.next()] for r in rows]
    counts = {}
    for k in seen:
        counts[k] = counts.get(k, 0) + 1
    assert len(counts) == 32 and set(counts.values()) == {3}      # 24 steps x 4 = 3 uses of each of 32
    r = _WindowSampler([8, 8, 8, 8], 4, "random", torch.Generator().manual_seed(3))
    picks = [r.next() for _ in range(24)]
    assert all(len(rows) == 4 == len(set(rows)) for _, rows in picks)
    # a batch smaller than batch_size gives all its rows; a remainder below batch_size is reshuffled away
    t = _WindowSampler([6, 2], 4, "cyclic", torch.Generator().manual_seed(0))
    got = [t.next() for _ in range(4)]
    assert sorted(len(rows) for _, rows in got) == [2, 2, 4, 4]
    assert all(len(set(rows)) == len(rows) for _, rows in got)


def _fista_cfg():
    from edgeprune.recipe import FISTAConfig
    return FISTAConfig(sparsity=0.5)


@pytest.mark.parametrize("make", [lambda: SignRoundConfig(bits=4, group_size=32, iters=2), _fista_cfg])
def test_block_input_methods_run_no_statistics_pass(tiny_llama, monkeypatch, make):
    from edgeprune import blocks
    from edgeprune.methods.registry import get_method
    calls = []
    orig = blocks.StatsCollector.run

    def spy(self, block, batches, **k):
        calls.append(len(batches))
        return orig(self, block, batches, **k)

    monkeypatch.setattr(blocks.StatsCollector, "run", spy)
    compress(copy.deepcopy(tiny_llama), make(), _calib(), progress=False, measure_errors=False)
    assert calls == []
    # the layer errors need the first error_tokens' statistics only: one batch of 4 x 32
    # windows here, and they are the errors a full statistics pass gives
    res = compress(copy.deepcopy(tiny_llama), make(), _calib(), progress=False, measure_errors=True,
                   batch_size=4, error_tokens=100)
    assert calls and set(calls) == {1}
    calls.clear()
    monkeypatch.setattr(type(get_method(make())), "needs_stats", True)
    full = compress(copy.deepcopy(tiny_llama), make(), _calib(), progress=False, measure_errors=True,
                    batch_size=4, error_tokens=100)
    assert set(calls) == {2}
    assert res.layer_errors and res.layer_errors.keys() == full.layer_errors.keys()
    for n, e in res.layer_errors.items():
        assert e == pytest.approx(full.layer_errors[n], rel=1e-6), n


@pytest.mark.parametrize("sym,full_range", [(False, False), (True, False), (True, True)])
def test_fused_fake_quant_matches_the_written_out_ste_formula(sym, full_range):
    """Values bit for bit; gradients (V, alpha, beta) against the written-out formula in
    float64, at least as close as the written-out formula in float32 is."""
    from edgeprune.methods.signround import _FakeQuant, _round_ste
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 32, generator=g, dtype=torch.float64) * torch.rand(96, 1, generator=g, dtype=torch.float64)
    w[0, :4] = torch.tensor([3.0, -3.0, 2.5, -2.5], dtype=torch.float64)   # clamped codes in group 0
    upstream = torch.randn(96, 32, generator=g, dtype=torch.float64)

    def grads(fused, dtype):
        ww = w.to(dtype)
        wmin, wmax = ww.amin(1, keepdim=True).clamp(max=0), ww.amax(1, keepdim=True).clamp(min=0)
        v = ((torch.rand(96, 32, generator=torch.Generator().manual_seed(1)) - 0.5)).to(dtype).requires_grad_()
        a = (0.5 + 0.5 * torch.rand(96, 1, generator=torch.Generator().manual_seed(2))).to(dtype).requires_grad_()
        b = (0.5 + 0.5 * torch.rand(96, 1, generator=torch.Generator().manual_seed(3))).to(dtype).requires_grad_()
        s, z = signround_grid(wmin, wmax, a, b, 4, sym, ste=True, full_range=full_range)
        out = _FakeQuant.apply(ww, v, s, z, 15) if fused else (torch.clamp(_round_ste(ww / s + v) + z, 0, 15) - z) * s
        return (out, *torch.autograd.grad((out * upstream.to(dtype)).sum(), [v, a, b]))

    exact, written, ours = grads(False, torch.float64), grads(False, torch.float32), grads(True, torch.float32)
    assert torch.equal(ours[0], written[0])                       # the same fake-quant values
    assert torch.equal(ours[1], written[1])                       # d/dV = s inside, exactly
    assert int((ours[1] == 0).sum()) > 0                          # some codes were clamped
    for e, wr, o in zip(exact[2:], written[2:], ours[2:]):
        assert float(e.abs().sum()) > 0
        err_ours, err_written = float((o.double() - e).abs().max()), float((wr.double() - e).abs().max())
        assert err_ours <= max(err_written, 1e-6), (err_ours, err_written)


def _block0_outputs(model):
    """``(batches, float32 outputs, bfloat16-autocast outputs)`` of ``model``'s block 0 on
    its calibration inputs (float32 tensors)."""
    from edgeprune.blocks import capture_block_inputs
    from edgeprune.methods.signround import _block_output
    block = model.model.layers[0]
    batches = capture_block_inputs(model, model.model.layers, _calib(), None, 4, torch.device("cpu"))
    with torch.no_grad():
        ref32 = [_block_output(block(b[0], **b[1])).float() for b in batches]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            refbf = [_block_output(block(b[0], **b[1])).float() for b in batches]
    return batches, ref32, refbf


@pytest.mark.parametrize("amp_targets", [True, False])
def test_amp_targets_choose_the_targets_precision(tiny_llama, amp_targets):
    """The targets are the block's output under bfloat16 autocast, or in float32 with
    ``amp_targets=False`` (bit for bit the plain float32 block), whatever ``amp`` does to the steps."""
    meth = SignRound(SignRoundConfig(bits=4, group_size=32, amp=True, amp_targets=amp_targets))
    batches, ref32, refbf = _block0_outputs(tiny_llama)
    with torch.no_grad():
        got = meth._targets(tiny_llama.model.layers[0], batches, 0)
    want, other = (refbf, ref32) if amp_targets else (ref32, refbf)
    for g, w, o in zip(got, want, other):
        assert torch.equal(g, w)
        assert not torch.equal(g, o)


@pytest.mark.parametrize("amp_targets", [True, False])
def test_quantized_stream_goes_in_the_targets_precision(tiny_llama, monkeypatch, amp_targets):
    """The engine carries the quantized stream into the next block under the same autocast
    as SignRound's targets (bfloat16 with ``amp_targets``, else float32), bit for bit."""
    from edgeprune.engine import _stream_autocast
    seen = {}
    orig = SignRound.compress_block

    def spy(self, block, tasks, inputs=None):
        seen[tasks[0].name.split(".")[2]] = [b[0].clone() for b in inputs]
        return orig(self, block, tasks, inputs=inputs)

    monkeypatch.setattr(SignRound, "compress_block", spy)
    cfg = SignRoundConfig(bits=4, group_size=32, iters=1, amp_targets=amp_targets)
    assert SignRound(cfg).stream_autocast == (torch.bfloat16 if amp_targets else None)
    compress(tiny_llama, cfg, _calib(), progress=False, batch_size=4)
    _, ref32, refbf = _block0_outputs(tiny_llama)
    want, other = (refbf, ref32) if amp_targets else (ref32, refbf)
    for g, w, o in zip(seen["1"], want, other):
        assert g.dtype == torch.float32 and torch.equal(g, w) and not torch.equal(g, o)
    # a stage that wants the model's precision (GPTQ) keeps the whole stream there
    from edgeprune.methods.registry import get_method
    from edgeprune.recipe import GPTQConfig
    assert _stream_autocast([get_method(cfg), get_method(GPTQConfig(bits=4, group_size=32))]) is None
    assert _stream_autocast([get_method(RTNConfig(bits=8)), get_method(cfg)]) == SignRound(cfg).stream_autocast
