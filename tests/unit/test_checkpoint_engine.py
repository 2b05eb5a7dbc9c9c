"""Checkpoints of real CompressionResults from edgeprune.engine.compress (tiny models)."""

from __future__ import annotations

import json

import pytest
import torch

from edgeprune.checkpoint import load_checkpoint, save_checkpoint

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))


def _calib(n=4, s=32):
    return torch.randint(0, 256, (n, s), generator=torch.Generator().manual_seed(0))


def _logits(m):
    with torch.no_grad():
        return m(IDS).logits


def _recipes():
    from edgeprune.recipe import (AWQConfig, GPTQConfig, Recipe, SparseGPTConfig, WandaConfig)
    return {
        "gptq_actorder_dynamic": GPTQConfig(bits=4, group_size=16, sym=False, act_order=True),
        "awq_then_gptq_mixed": Recipe([AWQConfig(bits=4, group_size=16),
                                       GPTQConfig(bits=8, group_size=16, targets=["v_proj"]),
                                       GPTQConfig(bits=4, group_size=16, sym=True,
                                                  ignore=["lm_head", "v_proj"])]),
        "sparsegpt24_int4": SparseGPTConfig(prune_n=2, prune_m=4, bits=4, group_size=16),
        "wanda50": WandaConfig(sparsity=0.5),
    }


@pytest.mark.parametrize("case,fmt", [("gptq_actorder_dynamic", "compressed-tensors"),
                                      ("awq_then_gptq_mixed", "compressed-tensors"),
                                      ("sparsegpt24_int4", "dense"),
                                      ("wanda50", "compressed-tensors")])
def test_engine_result_roundtrip(tiny_llama, tmp_path, case, fmt):
    from edgeprune.engine import compress
    res = compress(tiny_llama, _recipes()[case], _calib(), progress=False, measure_errors=False)
    ref = _logits(tiny_llama)
    out = save_checkpoint(tiny_llama, None, res, tmp_path / case, format=fmt,
                          provenance={"calibration": {"source": "random", "nsamples": 4, "seqlen": 32,
                                                      "seed": 0}})
    model, _, info = load_checkpoint(out)
    assert torch.equal(_logits(model), ref)
    assert set(info.quantized) == set(res.quantized)
    for n, qw in res.quantized.items():
        got = info.quantized[n]
        assert torch.equal(got.codes, qw.codes) and torch.equal(got.zeros, qw.zeros), n
        assert torch.equal(got.scales, qw.scales.float()), n
        assert got.has_default_order() == qw.has_default_order()
    assert set(info.masks) == set(res.masks)
    for n, m in res.masks.items():
        assert torch.equal(info.masks[n], m.bool()), n
        assert info.sparsity_pattern[n] == res.sparsity_pattern[n]
    rec = json.loads((out / "edgeprune_checkpoint.json").read_text())
    assert rec["recipe"] == json.loads(json.dumps(res.recipe))
    assert rec["calibration"]["nsamples"] == 4
