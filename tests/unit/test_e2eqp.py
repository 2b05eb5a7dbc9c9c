"""E2E-QP (edgeprune.methods.e2eqp): the scales trained end to end with the codes frozen;
exact no-op at zero epochs, lower KL to the dense model, export parity, the stage rules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from edgeprune.engine import check_recipe, compress
from edgeprune.errors import ConfigError
from edgeprune.methods.e2eqp import E2EQPConfig
from edgeprune.recipe import GPTQConfig, RTNConfig, SparseGPTConfig, WandaConfig

from tiny import assert_int4_export_matches


def _calib(n=8, s=32, seed=1):
    return torch.randint(0, 256, (n, s), generator=torch.Generator().manual_seed(seed))


def _kl(dense, model, ids) -> float:
    with torch.no_grad():
        lt = F.log_softmax(dense(ids).logits.float(), -1)
        ls = F.log_softmax(model(ids).logits.float(), -1)
    return float((lt.exp() * (lt - ls)).sum(-1).mean())


def test_zero_epochs_leave_every_scale_and_weight_bit_for_bit(tiny_llama):
    ids = _calib()
    ref_model = copy.deepcopy(tiny_llama)
    ref = compress(ref_model, RTNConfig(bits=4, group_size=32), ids, progress=False)
    res = compress(tiny_llama, [RTNConfig(bits=4, group_size=32), E2EQPConfig(epochs=0)], ids, progress=False)
    assert set(res.quantized) == set(ref.quantized)
    for n, q in res.quantized.items():
        assert torch.equal(q.scales, ref.quantized[n].scales) and torch.equal(q.codes, ref.quantized[n].codes)
    for a, b in zip(tiny_llama.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    assert res.tuning["2:e2e-qp"]["steps"] == 0


@pytest.mark.parametrize("amp", [False, True])
def test_training_lowers_the_kl_to_the_dense_model_and_keeps_codes(tiny_llama, amp):
    ids, held = _calib(), _calib(seed=7)
    dense = copy.deepcopy(tiny_llama)
    ref_model = copy.deepcopy(tiny_llama)
    ref = compress(ref_model, RTNConfig(bits=3, group_size=32), ids, progress=False)
    res = compress(tiny_llama, [RTNConfig(bits=3, group_size=32),
                                E2EQPConfig(epochs=6, lr=3e-3, batch_size=2, amp=amp)], ids, progress=False)
    info = res.tuning["2:e2e-qp"]
    assert info["steps"] == 24 and info["kl_last_epoch"] < info["kl_first_epoch"]
    before, after = _kl(dense, ref_model, ids), _kl(dense, tiny_llama, ids)
    assert after < 0.9 * before
    assert _kl(dense, tiny_llama, held) < _kl(dense, ref_model, held)       # not only the windows seen
    mods = dict(tiny_llama.named_modules())
    for n, q in res.quantized.items():
        r = ref.quantized[n]
        assert torch.equal(q.codes, r.codes) and torch.equal(q.zeros, r.zeros)
        assert torch.equal(q.scales, q.scales.half().float())                 # what the export stores
        assert torch.equal(mods[n].weight, q.dequantize())
    assert 0 < info["scale_change_mean"] <= info["scale_change_max"] <= 0.5


def test_packed_int4_export_matches_the_tuned_model(tiny_llama, tmp_path):
    res = compress(tiny_llama, [GPTQConfig(bits=4, group_size=32), E2EQPConfig(epochs=2, lr=3e-3)], _calib(),
                   progress=False)
    assert res.tuning["2:e2e-qp"]["scale_change_max"] > 0
    assert_int4_export_matches(tiny_llama, res.quantized, tmp_path / "m")


def test_pruned_weights_stay_zero_and_only_quantized_layers_move(tiny_llama):
    """2:4 then int4 on the MLPs only, then E2E-QP over everything: the attention layers
    (pruned, not quantized) are left alone and the 2:4 pattern survives."""
    ids = _calib()
    res = compress(tiny_llama, [WandaConfig(prune_n=2, prune_m=4),
                                RTNConfig(bits=4, group_size=32, targets=["re:mlp\\."]),
                                E2EQPConfig(epochs=2, lr=3e-3)], ids, progress=False)
    mods = dict(tiny_llama.named_modules())
    assert set(res.quantized) == {n for n in res.masks if ".mlp." in n}
    for n, keep in res.masks.items():
        w = mods[n].weight
        assert torch.equal(w[~keep], torch.zeros_like(w[~keep]))
        assert int((w.reshape(w.shape[0], -1, 4) != 0).sum(-1).max()) <= 2


def test_a_non_finite_loss_leaves_the_scales_as_they_were(tiny_llama, monkeypatch):
    import edgeprune.methods.e2eqp as e2e

    ids = _calib()
    ref_model = copy.deepcopy(tiny_llama)
    ref = compress(ref_model, RTNConfig(bits=4, group_size=32), ids, progress=False)
    monkeypatch.setattr(e2e, "_kl", lambda t, s, v: (s.float().sum() * float("nan")))
    res = compress(tiny_llama, [RTNConfig(bits=4, group_size=32), E2EQPConfig(epochs=1)], ids, progress=False)
    assert any("loss not finite at step 1" in f for f in res.fallbacks)
    for n, q in res.quantized.items():
        assert torch.equal(q.scales, ref.quantized[n].scales)
    for a, b in zip(tiny_llama.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stages,match", [
    ([E2EQPConfig()], "selects no layer that an earlier stage quantizes"),
    ([SparseGPTConfig(), E2EQPConfig()], "selects no layer that an earlier stage quantizes"),
    ([RTNConfig(bits=4, group_size=32, targets=["re:mlp\\."]), E2EQPConfig(),
      GPTQConfig(bits=4, group_size=32, targets=["q_proj"])],
     "move e2e-qp to the end of the recipe"),
])
def test_stage_rules_are_checked_before_any_work(tiny_llama, stages, match):
    with pytest.raises(ConfigError) as e:
        check_recipe(tiny_llama, stages)
    assert match in str(e.value)


@pytest.mark.parametrize("opts,match", [({"epochs": -1}, "epochs=-1 must be >= 0"),
                                        ({"lr": 0.0}, "lr=0.0 must be a positive number"),
                                        ({"lr": float("inf")}, "must be a positive number"),
                                        ({"batch_size": 0}, "batch_size=0 must be >= 1")])
def test_bad_settings_are_refused(opts, match):
    with pytest.raises(ConfigError, match=match):
        E2EQPConfig.from_options(**opts)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_chunked_head_gives_the_whole_logits_loss_and_gradient(tiny_llama, family):
    """The KL over chunks of positions (the head run chunk by chunk, one backward pass from
    the final hidden states) equals the KL of the whole ``[b, seqlen, vocab]`` logits, and
    so do the gradients; Gemma's final soft cap included."""
    import edgeprune.methods.e2eqp as e2e
    from tiny import tiny_gemma3

    model = tiny_llama if family == "llama" else tiny_gemma3()
    if family == "gemma3":
        model.config.final_logit_softcapping = 5.0
    teacher = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ids, m = _calib(n=2, s=24), torch.ones(2, 24, dtype=torch.long)
    m[1, :5] = 0                                          # left padding is not scored
    train = [p for n, p in model.named_parameters() if "mlp" in n or "norm" in n]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in train:
        p.requires_grad_(True)
    amp = torch.autocast("cpu", enabled=False)
    split = e2e._split_head(model, teacher, ids[:1, :8])
    assert split is not None
    split = (*split[:4], 7)                               # 48 positions in 7 chunks
    whole = e2e._loss_backward(model, teacher, ids, m, amp, None)
    g_whole = [p.grad.clone() for p in train]
    for p in train:
        p.grad = None
    chunked = e2e._loss_backward(model, teacher, ids, m, amp, split)
    assert whole > 0 and chunked == pytest.approx(whole, rel=1e-5)
    for a, p in zip(g_whole, train):
        torch.testing.assert_close(p.grad, a, rtol=1e-4, atol=1e-7)
