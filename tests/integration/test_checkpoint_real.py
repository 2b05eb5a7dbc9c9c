"""edgeprune.checkpoint on the real SmolLM2-135M: exact save/reload, plain transformers load."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytestmark = pytest.mark.integration


def _rtn_all(model, sym: bool, bits_of=lambda n: 4):
    from types import SimpleNamespace

    from edgeprune.quantize import rtn_quantize
    res = SimpleNamespace(quantized={}, masks={}, sparsity_pattern={},
                          recipe={"method": "rtn", "group_size": 64, "sym": sym})
    for n, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in n:
            qw = rtn_quantize(mod.weight.data, bits_of(n), 64, sym=sym)
            mod.weight.data = qw.dequantize()
            res.quantized[n] = qw
    return res


@pytest.fixture(scope="module")
def ids(smollm2):
    _, tok = smollm2
    text = "The quick brown fox jumps over the lazy dog. " * 8
    return tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :64]


def _logits(m, ids):
    with torch.no_grad():
        return m(ids, use_cache=False).logits


def test_real_model_compressed_tensors_roundtrip(smollm2, ids, tmp_path):
    from edgeprune.checkpoint import load_checkpoint, save_checkpoint
    from edgeprune.models import load_model
    base, tok = smollm2
    m = copy.deepcopy(base)
    # mixed precision: 8-bit v_proj, 4-bit elsewhere, symmetric g64 (plain transformers loads it)
    res = _rtn_all(m, sym=True, bits_of=lambda n: 8 if n.endswith("v_proj") else 4)
    ref = _logits(m, ids)
    out = save_checkpoint(m, tok, res, tmp_path / "smol-w4", provenance={
        "source": "smollm2-135m", "calibration": {"source": "none (RTN)", "seed": 0}, "seed": 0})
    size = sum(p.stat().st_size for p in out.iterdir())
    assert size < 0.45 * 538e6  # packed int4 (+ fp32 embedding): far below the fp32 folder
    rec = json.loads((out / "edgeprune_checkpoint.json").read_text())
    assert rec["tied_embeddings"] == "tied" and len(rec["quantized_layers"]) == 30 * 7

    m2, tok2, info = load_checkpoint(out)
    assert torch.equal(_logits(m2, ids), ref)
    assert m2.lm_head.weight.data_ptr() == m2.model.embed_tokens.weight.data_ptr()
    assert torch.equal(m2.model.embed_tokens.weight, base.model.embed_tokens.weight)
    for n, qw in res.quantized.items():
        assert torch.equal(info.quantized[n].codes, qw.codes), n
    assert tok2("hello world")["input_ids"] == tok("hello world")["input_ids"]

    # the lead's load_model dispatches edgeprune checkpoints to load_checkpoint
    m3, _ = load_model(str(out))
    assert torch.equal(_logits(m3, ids), ref)

    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert torch.equal(_logits(hf, ids), ref)


def test_real_model_dense_asym_roundtrip(smollm2, ids, tmp_path):
    from edgeprune.checkpoint import load_checkpoint, save_checkpoint
    base, tok = smollm2
    m = copy.deepcopy(base)
    res = _rtn_all(m, sym=False)
    ref = _logits(m, ids)
    # (the dense format is covered on tiny models in tests/unit/test_checkpoint.py)
    for fmt, layout in (("compressed-tensors", "pack-quantized"),):
        out = save_checkpoint(m, tok, res, tmp_path / fmt, format=fmt, asym_layout=layout,
                              provenance={"source": "smollm2-135m"})
        m2, _, info = load_checkpoint(out)
        assert torch.equal(_logits(m2, ids), ref), fmt
        n = "model.layers.29.mlp.down_proj"
        assert torch.equal(info.quantized[n].zeros, res.quantized[n].zeros)
        assert torch.equal(info.quantized[n].codes, res.quantized[n].codes)
