"""2:4 exports: exact pattern kept and recorded, compact form smaller and exact, 2:4+int4."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime
from edgeprune_exporters.sparse24 import compress_24, expand_24
from edgeprune_runtime.errors import ExportError

from tiny import rand_ids, byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _prune_24(model, fp16_values=False):
    with torch.no_grad():
        for n, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and n != "lm_head":
                w = m.weight
                if fp16_values:
                    w.copy_(w.half().float())
                g = w.view(w.shape[0], -1, 4)
                idx = g.abs().argsort(-1)[..., :2]
                g.scatter_(-1, idx, 0.0)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


def test_compress_roundtrip():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 24)).astype(np.float16).astype(np.float32)
    g = w.reshape(5, 6, 4)
    np.put_along_axis(g, np.argsort(np.abs(g), -1)[..., :2], 0, -1)
    g[0, 0] = 0                   # a group with no non-zero
    g[1, 1] = [0, 0, 0, 3.0]      # a group with one non-zero
    w = g.reshape(5, 24)
    v, p = compress_24(w)
    assert v.dtype == np.float16 and v.shape == (5, 12) and p.shape == (5, 3)
    np.testing.assert_array_equal(expand_24(v, p, 24), w)


def test_sparse24_dense_export_records_pattern(tiny_llama, tok, tmp_path):
    model = _prune_24(tiny_llama)
    res = exporters.export_onnx(model, tok, tmp_path / "m", sparse_24=True, max_length=128)
    sp = res.metadata["sparsity"]
    assert sp["pattern"] == "2:4" and sp["layers"] == 14 and sp["sparsity"] == pytest.approx(0.5)
    assert res.metadata["sparse_24_speedup_claimed"] is False
    assert res.parity["max_abs_logit_diff"] < 1e-4
    ids = rand_ids(32, seed=2)
    with runtime.load(tmp_path / "m") as s:
        np.testing.assert_allclose(s.logits(ids), _logits(model, ids), atol=1e-4)


def test_sparse24_rejects_dense_model(tiny_llama, tok, tmp_path):
    with pytest.raises(ExportError, match="not 2:4 sparse"):
        exporters.export_onnx(tiny_llama, tok, tmp_path / "m", sparse_24=True)
    assert not (tmp_path / "m").exists()


def test_compact24_smaller_and_exact(tok, tmp_path):
    from transformers import LlamaConfig
    from tiny import tiny_model
    # wide enough that linears dominate the file
    model = _prune_24(tiny_model(LlamaConfig, hidden_size=128, intermediate_size=384,
                            num_attention_heads=4, num_key_value_heads=2), fp16_values=True)
    dense16 = exporters.export_onnx(model, tok, tmp_path / "d16", precision="fp16",
                                    max_length=128, validate=False)
    comp = exporters.export_onnx(model, tok, tmp_path / "c", variants=["compact24"], lm_head="fp",
                                 max_length=128)
    assert comp.metadata["variants"]["compact24"]["layers"] == 2 * 4   # q/k/v fused, o, gate/up, down
    assert comp.metadata["sparsity"]["pattern"] == "2:4"
    assert comp.model_bytes < 0.85 * dense16.model_bytes   # emb/head (not 2:4) stay fp32 here
    import onnx
    def sizes(path, keys):
        m = onnx.load(str(path / "model.onnx"))
        return sum(len(t.raw_data) for t in m.graph.initializer if any(k in t.name for k in keys))
    compact = sizes(tmp_path / "c", ["values_24", "positions_24"])
    dense = sizes(tmp_path / "d16", ["proj.weight"])
    assert compact / dense == pytest.approx(1.125 / 2, rel=0.01)   # <= 0.6x of fp16 dense
    assert comp.parity["max_abs_logit_diff"] < 1e-4   # values were fp16-exact
    ids = rand_ids(24, seed=3)
    with runtime.load(tmp_path / "c") as s:
        np.testing.assert_allclose(s.logits(ids), _logits(model, ids), atol=1e-4)


def test_sparse24_plus_int4(tiny_qwen2, tok, tmp_path):
    """2:4 + int4: zeros are exact codes (code == zero point), the pattern survives."""
    from edgeprune.quantize import rtn_quantize
    model = _prune_24(tiny_qwen2)
    qmap = {n: rtn_quantize(m.weight.detach(), 4, 32, False) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    with torch.no_grad():
        for n, q in qmap.items():
            model.get_submodule(n).weight.copy_(q.dequantize())
    res = exporters.export_onnx(model, tok, tmp_path / "m", precision="int4", quantized=qmap,
                                sparse_24=True, accuracy_level=0, lm_head="fp", max_length=128)
    assert res.metadata["sparsity"]["pattern"] == "2:4"
    assert res.metadata["quantization"]["bits"] == 4
    assert res.parity["max_abs_logit_diff"] < 1e-4
    meta = json.loads((tmp_path / "m" / "edgeprune.json").read_text())
    assert meta["sparsity"]["prune_n"] == 2 and meta["sparsity"]["prune_m"] == 4


def test_tensorrt_sparsity_flag(monkeypatch):
    from edgeprune_runtime import session
    monkeypatch.setattr(session.ort, "get_available_providers",
                        lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                 "CPUExecutionProvider"])
    provs = session._providers("tensorrt", True)
    assert provs[0] == ("TensorrtExecutionProvider", {"trt_sparsity_enable": True})
    assert session._providers("tensorrt", False)[0][1]["trt_sparsity_enable"] is False
    monkeypatch.setattr(session.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(runtime.RuntimeLoadError, match="TensorRT"):
        session._providers("tensorrt", True)


def test_compact24_validation_uses_fp16_values(tiny_qwen2, tok, tmp_path):
    """Values not exactly representable in fp16: the export's parity reference is the
    torch model with the fp16-rounded values, so it stays exact; vs the fp32 model the
    difference is the (small) fp16 rounding."""
    model = _prune_24(tiny_qwen2)
    comp = exporters.export_onnx(model, tok, tmp_path / "c", variants=["compact24"], lm_head="fp",
                                 max_length=128)
    assert comp.parity["max_abs_logit_diff"] < 1e-4
    ids = rand_ids(24, seed=4)
    with runtime.load(tmp_path / "c") as s:
        diff = np.abs(s.logits(ids) - _logits(model, ids)).max()
    assert 1e-6 < diff < 2e-2
