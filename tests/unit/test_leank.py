"""LeanK key-channel pruning: mask selection, torch reference, ONNX export and runtime
(tiny random models)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tiny import rand_ids, byte_tokenizer

from edgeprune.errors import CheckpointError, ConfigError, ExportError, GenerationError
from edgeprune.leank import (LeanKMask, apply_reference, check_leank_args, kv_geometry,
                             learn_mask, long_perplexity, magnitude_scores, select_channels)


def _calib(n=4, s=64, seed=0):
    return torch.from_numpy(rand_ids(s, seed=seed, batch=n))


def _ref_logits(model, mask, ids, sink, window):
    with torch.no_grad(), apply_reference(model, mask, sink=sink, window=window):
        return model(torch.from_numpy(ids)).logits.numpy()


# ---------------------------------------------------------------- selection / arguments

def test_select_channels_budget_alignment_and_ranking():
    rng = np.random.default_rng(0)
    sc = rng.random((3, 2, 16))
    sc[0, 0, :] += 10          # head (0,0) is by far the most important
    keep = select_channels(sc, 0.25, alignment=4, min_per_head=0)
    counts = [[len(h) for h in layer] for layer in keep]
    assert sum(map(sum, counts)) == 24                       # 0.25 * 96
    assert all(c % 4 == 0 for layer in counts for c in layer)
    assert keep[0][0] == list(range(16))                     # its 16 channels all kept
    # the kept channels of every head are its top-scored ones
    for i in range(3):
        for h in range(2):
            n = len(keep[i][h])
            assert set(keep[i][h]) == set(np.argsort(-sc[i, h])[:n].tolist())
    assert select_channels(sc, 1.0, 8) == [[list(range(16))] * 2] * 3
    # default: every head keeps at least one aligned block
    k2 = select_channels(sc, 0.5, alignment=4)
    assert min(len(h) for layer in k2 for h in layer) == 4 and len(k2[0][0]) == 16
    assert sum(len(h) for layer in k2 for h in layer) == 48
    with pytest.raises(ConfigError, match="min_per_head"):
        select_channels(sc, 0.1, alignment=4)


@pytest.mark.parametrize("kw", [dict(k_keep=0.0), dict(k_keep=1.5), dict(k_keep=-0.2),
                                dict(k_keep=float("nan")),
                                dict(alignment=3, head_dim=16), dict(alignment=0),
                                dict(sink=-1), dict(sink=300, window=300, context=512)])
def test_bad_arguments_raise_config_error(kw):
    with pytest.raises(ConfigError) as e:
        check_leank_args(**kw)
    assert e.value.hint


def test_learn_mask_rejects_bad_inputs(tiny_llama):
    with pytest.raises(ConfigError, match="outside"):
        learn_mask(tiny_llama, _calib(), 1.2, method="magnitude")
    with pytest.raises(ConfigError, match="does not divide"):
        learn_mask(tiny_llama, _calib(), 0.5, method="magnitude", alignment=5)
    with pytest.raises(ConfigError, match="unknown"):
        learn_mask(tiny_llama, _calib(), 0.5, method="random")


def test_sink_window_larger_than_context(tiny_llama):
    tok = byte_tokenizer()
    m = LeanKMask.full(*[kv_geometry(tiny_llama)[i] for i in (0, 2, 3)])
    with pytest.raises(ConfigError, match="exceed the context"):
        long_perplexity(tiny_llama, tok, m, "hello world " * 200, seqlen=64, nwindows=1,
                        sink=32, window=40)


# ------------------------------------------------------------------------ reference

def test_reference_full_mask_and_wide_window_equal_dense(tiny_llama):
    L, N, KV, D = kv_geometry(tiny_llama)
    ids = rand_ids(48)
    with torch.no_grad():
        dense = tiny_llama(torch.from_numpy(ids)).logits.numpy()
    mk = learn_mask(tiny_llama, _calib(), 0.25, method="magnitude", alignment=4)
    assert np.abs(_ref_logits(tiny_llama, None, ids, 0, 0) - dense).max() < 1e-5
    assert np.abs(_ref_logits(tiny_llama, LeanKMask.full(L, KV, D), ids, 0, 0) - dense).max() < 1e-5
    # sink + window cover every key: nothing pruned
    assert np.abs(_ref_logits(tiny_llama, mk, ids, 48, 0) - dense).max() < 1e-5
    assert np.abs(_ref_logits(tiny_llama, mk, ids, 0, 48) - dense).max() < 1e-5
    pruned = _ref_logits(tiny_llama, mk, ids, 2, 8)
    # the first sink + window positions see no pruned key; later ones do
    assert np.abs(pruned[0, :10] - dense[0, :10]).max() < 1e-5
    assert np.abs(pruned[0, 12:] - dense[0, 12:]).max() > 1e-2


def test_reference_decode_with_cache_equals_prefill(tiny_qwen2):
    mk = learn_mask(tiny_qwen2, _calib(), 0.5, method="magnitude", alignment=4)
    ids = torch.from_numpy(rand_ids(30, seed=3))
    with torch.no_grad(), apply_reference(tiny_qwen2, mk, sink=2, window=5):
        full = tiny_qwen2(ids).logits
        r = tiny_qwen2(ids[:, :10], use_cache=True)
        outs = [r.logits[:, -1]]
        for t in range(10, 29):
            r = tiny_qwen2(ids[:, t:t + 1], cache=r["cache"], use_cache=True)
            outs.append(r.logits[:, -1])
    assert torch.allclose(torch.stack(outs, 1), full[:, 9:29], atol=1e-5)


def test_magnitude_scores_ignore_dead_key_channels(tiny_llama):
    L, N, KV, D = kv_geometry(tiny_llama)
    with torch.no_grad():   # key channels 0..7 of KV head 1 in layer 0 are always zero
        tiny_llama.model.layers[0].self_attn.k_proj.weight[D + 0:D + 4] = 0
        tiny_llama.model.layers[0].self_attn.k_proj.weight[D + D // 2:D + D // 2 + 4] = 0
    sc = magnitude_scores(tiny_llama, _calib())
    assert sc.shape == (L, KV, D)
    dead = [0, 1, 2, 3, 8, 9, 10, 11]     # rotate-half pairs (c, c + D/2) stay zero
    assert np.allclose(sc[0, 1, dead], 0.0)
    assert (sc[0, 1, [c for c in range(D) if c not in dead]] > 0).all()
    mk = learn_mask(tiny_llama, _calib(), 0.5, method="magnitude", alignment=4)
    assert not set(dead) & set(mk.keep[0][1])


def test_learned_mask_beats_random_masks(tiny_llama):
    """The learned mask's pruned attention stays closer to dense than random masks do."""
    L, N, KV, D = kv_geometry(tiny_llama)
    calib = _calib(4, 64)
    mk = learn_mask(tiny_llama, calib, 0.5, alignment=4, steps=25, finetune_steps=5,
                    train_window=8)
    assert abs(mk.fraction - 0.5) < 1e-9 and mk.method == "learned"
    assert (mk.counts() >= 4).all()                       # default: no dead head
    ids = rand_ids(64, seed=7)
    dense = torch.log_softmax(torch.from_numpy(_ref_logits(tiny_llama, None, ids, 0, 0)), -1)

    def kl(mask):
        lp = torch.log_softmax(torch.from_numpy(_ref_logits(tiny_llama, mask, ids, 2, 8)), -1)
        return float((dense.exp() * (dense - lp)).sum(-1).mean())

    rng = np.random.default_rng(0)
    rand = []
    for _ in range(3):
        keep = select_channels(rng.random((L, KV, D)), 0.5, 4)
        rand.append(kl(LeanKMask(keep, [[[1.0] * len(h) for h in l] for l in keep], D, 0.5, 4,
                                 "random")))
    assert kl(mk) < min(rand)


def test_training_regime_defaults_to_deployment_sink_window():
    from edgeprune.errors import CalibrationError
    from edgeprune.leank import DEFAULT_SINK, DEFAULT_WINDOW
    from edgeprune.leank.train import _train_regime
    sink, window, pos = _train_regime(2048, None, None, None)
    assert (sink, window) == (DEFAULT_SINK, DEFAULT_WINDOW)
    assert pos[0] == DEFAULT_SINK + DEFAULT_WINDOW and pos[-1] == 2047
    _, _, sub = _train_regime(2048, None, None, 100)       # evenly spaced subset, ends kept
    assert len(sub) == 100 and sub[0] == 512 and sub[-1] == 2047 and bool((sub.diff() > 0).all())
    assert _train_regime(64, None, None, None)[:2] == (2, 16)   # short windows: scaled down
    with pytest.raises(CalibrationError, match="no pruned key"):
        _train_regime(256, 64, 448, None)


def test_training_problem_matches_reference_attention(tiny_llama):
    """The stage-1/2 training forward (selected queries, precomputed dense logits) is the
    inference rule: alpha = 1 gives the dense output; a 0/1 alpha with the mask's channels
    gives the reference LeanK attention output at those queries."""
    from edgeprune.leank.train import _capture, _LayerProblem
    L, N, KV, D = kv_geometry(tiny_llama)
    ids = torch.from_numpy(rand_ids(40, seed=5, batch=2))
    h_in, _, (cos, sin) = _capture(tiny_llama, ids)
    pos = torch.tensor([12, 20, 39])
    attn = tiny_llama.model.layers[0].self_attn      # layer 0: same input under pruning
    prob = _LayerProblem(attn, h_in[0], cos, sin, pos, 2, 6)
    with torch.no_grad():
        assert float((prob.output(torch.ones(KV, D)) - prob.target).abs().max()) < 1e-5
        mk = learn_mask(tiny_llama, _calib(), 0.25, method="magnitude", alignment=4)
        alpha = torch.from_numpy(mk.dense_scales(0))
        got = prob.output(alpha)
        seen = {}
        hk = attn.register_forward_hook(lambda m, a, o: seen.__setitem__("o", o[0]))
        try:
            with apply_reference(tiny_llama, mk, sink=2, window=6):
                tiny_llama(ids)
        finally:
            hk.remove()
    ref = seen["o"][:, pos]
    assert float((got - ref).abs().max()) < 1e-5
    assert float((got - prob.target).abs().max()) > 1e-3       # pruning is active


def test_mask_json_roundtrip_and_errors(tmp_path, tiny_llama):
    mk = learn_mask(tiny_llama, _calib(), 0.5, method="magnitude", alignment=4)
    p = mk.save(tmp_path / "m.json")
    back = LeanKMask.load(p)
    assert back.keep == mk.keep and back.scales == mk.scales and back.fraction == 0.5
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CheckpointError):
        LeanKMask.load(tmp_path / "bad.json")
    (tmp_path / "foreign.json").write_text(json.dumps({"keep": []}))
    with pytest.raises(CheckpointError, match="not an edgeprune LeanK mask"):
        LeanKMask.load(tmp_path / "foreign.json")
    other = LeanKMask.full(3, 2, 16)
    with pytest.raises(ConfigError, match="layers"):
        with apply_reference(tiny_llama, other):
            pass


# --------------------------------------------------------------- export + runtime

def _export(model, tmp_path, name, mask=None, sink=None, window=None, **kw):
    """Export ``model``, with the LeanK variant when ``mask`` is given (``sink`` / ``window``:
    the mask's export regime, else its own)."""
    import dataclasses

    import edgeprune_exporters as exporters
    if mask is not None:
        kw["variants"] = [dataclasses.replace(mask, sink=sink if sink is not None else mask.sink,
                                              window=window if window is not None else mask.window)]
    return exporters.export_onnx(model, byte_tokenizer(), tmp_path / name, max_length=128, **kw)


@pytest.mark.parametrize("graph", ["plain", "fused"])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_export_equals_reference_prefill_chunked_decode(arch, graph, tmp_path, request):
    import edgeprune_runtime as runtime
    from edgeprune_runtime.leank import LeanKSession
    model = request.getfixturevalue(arch)
    mk = learn_mask(model, _calib(), 0.5, method="magnitude", alignment=4)
    ids = rand_ids(50, seed=1)
    sink, window = 3, 9
    ref = _ref_logits(model, mk, ids, sink, window)
    r = _export(model, tmp_path, "lk", graph=graph, mask=mk, sink=sink, window=window)
    assert r.parity["max_abs_logit_diff"] < 1e-4          # within sink + window = dense
    rec = r.metadata["variants"]["leank"]
    assert rec["sink"] == sink and rec["keep"] == mk.keep
    s = runtime.load(r.folder)
    assert isinstance(s, LeanKSession)
    assert np.abs(s.logits(ids) - ref).max() < 1e-4
    assert np.abs(s.logits(ids, chunk=7) - ref).max() < 1e-4
    st = s._prefill([ids[0, :6].tolist()])
    outs = [st["logits"]]
    for t in range(6, 49):
        outs.append(s._decode_step(st, ids[0, t:t + 1]))
    assert np.abs(np.stack(outs, 1) - ref[:, 5:49]).max() < 1e-4


def test_dead_heads_and_dead_layer_drop_middle_v(tiny_llama, tmp_path):
    import edgeprune_runtime as runtime
    D = 16
    mk = LeanKMask(keep=[[[], []], [[0, 1, 2, 3], list(range(8))]],
                   scales=[[[], []], [[0.5] * 4, [1.0] * 8]], head_dim=D, k_keep=0.2,
                   alignment=4, method="manual")
    ids = rand_ids(40, seed=2)
    ref = _ref_logits(tiny_llama, mk, ids, 2, 6)
    s = runtime.load(_export(tiny_llama, tmp_path, "dead", graph="plain", mask=mk,
                             sink=2, window=6).folder)
    assert s.key_widths == [0, 12] and s.alive_heads == [0, 2]
    assert np.abs(s.logits(ids, chunk=11) - ref).max() < 1e-4
    b = s.kv_cache_bytes(40)
    assert b["middle_tokens"] == 32 and b["full_tokens"] == 8
    assert b["k_middle"] == 12 * 32 * 4 and b["v_middle"] == 2 * D * 32 * 4
    assert b["k_middle_fraction"] == 12 / 64 and b["v_middle_fraction"] == 0.5


def test_keep_one_export_equals_plain_export(tiny_llama, tmp_path):
    import edgeprune_runtime as runtime
    L, N, KV, D = kv_geometry(tiny_llama)
    ids = rand_ids(60, seed=4)
    a = runtime.load(_export(tiny_llama, tmp_path, "full", graph="plain",
                             mask=LeanKMask.full(L, KV, D), sink=2,
                             window=4).folder).logits(ids, chunk=16)
    b = runtime.load(_export(tiny_llama, tmp_path, "plain", graph="plain").folder).logits(ids)
    assert np.abs(a - b).max() < 1e-5


def test_int4_composes(tiny_llama, tmp_path):
    """int4 weights (MatMulNBits) + LeanK keep 1.0 == the dense fused int4 export."""
    import edgeprune_runtime as runtime
    L, N, KV, D = kv_geometry(tiny_llama)
    ids = rand_ids(40, seed=5)
    lk = _export(tiny_llama, tmp_path, "lk4", precision="int4", graph="fused",
                 mask=LeanKMask.full(L, KV, D), sink=2, window=4)
    ref = _export(tiny_llama, tmp_path, "d4", precision="int4", graph="fused")
    ops = {n.op_type for n in __import__("onnx").load(str(lk.folder / "model.onnx")).graph.node}
    assert "MatMulNBits" in ops and "GroupQueryAttention" not in ops
    a = runtime.load(lk.folder).logits(ids)
    b = runtime.load(ref.folder).logits(ids)
    assert np.abs(a - b).max() < 2e-3 and (a.argmax(-1) == b.argmax(-1)).mean() > 0.97


def test_k_cache_bytes_match_mask_fraction(tiny_qwen2, tmp_path):
    import edgeprune_runtime as runtime
    mk = learn_mask(tiny_qwen2, _calib(), 0.25, method="magnitude", alignment=4)
    s = runtime.load(_export(tiny_qwen2, tmp_path, "b", mask=mk, sink=4,
                             window=12).folder)
    b = s.kv_cache_bytes(100)
    assert b["k_middle"] / b["k_middle_dense"] == pytest.approx(0.25, abs=1e-12)
    assert b["k"] == b["k_middle"] + b["k_full"] and b["full_tokens"] == 16
    assert b["k"] < b["k_dense"] and b["v"] == b["v_dense"]     # no dead heads here


def test_runtime_generate_and_errors(tiny_llama, tmp_path):
    import edgeprune_exporters as exporters
    import edgeprune_runtime as runtime
    mk = learn_mask(tiny_llama, _calib(), 0.5, method="magnitude", alignment=4)
    s = runtime.load(_export(tiny_llama, tmp_path, "g", mask=mk, sink=2,
                             window=4).folder)
    ids = rand_ids(20, seed=6)[0].tolist()
    out = s.generate(ids, max_new_tokens=8)
    ref = []
    with torch.no_grad(), apply_reference(tiny_llama, mk, sink=2, window=4):
        cur = list(ids)
        for _ in range(8):
            t = int(tiny_llama(torch.tensor([cur])).logits[0, -1].argmax())
            ref.append(t)
            cur.append(t)
    assert out.token_ids[0][:len(ref)] == ref[:len(out.token_ids[0])]
    with pytest.raises(GenerationError, match="equal length"):
        s.generate([ids[:5], ids[:7]], max_new_tokens=2)
    # under an open stream of this thread: an error, not a deadlock (logits() and
    # decode_speed() used to wait for the stream's lock forever)
    it = s.stream(ids, max_new_tokens=4)
    next(it)
    for call in (lambda: s.logits(np.array([ids])), lambda: s.decode_speed(context=16, steps=1)):
        with pytest.raises(GenerationError, match="still open"):
            call()
    it.close()
    assert s.logits(np.array([ids])).shape == (1, len(ids), tiny_llama.config.vocab_size)
    # close() stops a LeanK stream at its next decode step (it went on to the end)
    it = s.stream(ids, max_new_tokens=6)
    next(it)
    s.close()
    with pytest.raises(GenerationError, match="closed"):
        list(it)
    assert s.sess is None
    bad = LeanKMask.full(3, 2, 16)
    with pytest.raises(ExportError, match="does not match"):
        exporters.export_onnx(tiny_llama, byte_tokenizer(), tmp_path / "bad", variants=[bad])


def test_export_defaults_to_the_masks_training_regime_and_refuses_no_pruning(tiny_llama, tmp_path):
    """Without --leank-sink/--leank-window the export keeps the regime the mask was
    trained for (it took the deployment 64 / 448, which on a 128-token context pruned
    nothing, silently); a sink + window covering the whole context is an error."""
    L, KV, D = (kv_geometry(tiny_llama)[i] for i in (0, 2, 3))
    m = LeanKMask.full(L, KV, D)
    m.meta = {"train_sink": 4, "train_window": 8}
    r = _export(tiny_llama, tmp_path, "regime", mask=m)
    assert (r.metadata["variants"]["leank"]["sink"], r.metadata["variants"]["leank"]["window"]) == (4, 8)
    with pytest.raises(ExportError, match=r"sink \+ window = 64 \+ 448 tokens cover the whole "
                                          r"context \(max_length=128\): no key would be pruned"):
        _export(tiny_llama, tmp_path, "none", mask=LeanKMask.full(L, KV, D))
    with pytest.raises(ExportError, match="sink \\+ window = 100 \\+ 28"):
        _export(tiny_llama, tmp_path, "edge", mask=m, sink=100, window=28)
    assert not (tmp_path / "none").exists() and not (tmp_path / "edge").exists()
