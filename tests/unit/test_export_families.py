"""Gemma 3 exports on a tiny random ``Gemma3TextConfig`` model: every graph path against PyTorch.

The tiny model has 3 layers (sliding, full, sliding) with a window of 8 tokens, one KV
head of 16 channels for 4 query heads, QK-norm, (1 + w) norms with random w, tied
embeddings, distinct rotary bases per layer type: every test runs past the window.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime
from edgeprune_exporters import BUILDERS, BuildOptions, DecoderSpec
from edgeprune_runtime.errors import ExportError, UnsupportedArchitectureError
from edgeprune_runtime.kv_cache import ConcatKVCache, KVSpec, RingKVCache

from tiny import byte_tokenizer, rand_ids
from tiny import tiny_gemma3 as tiny_gemma3_model

WINDOW = 8


def gemma3(**kw):
    """The tiny Gemma 3 (module docstring; ``tiny.tiny_gemma3`` at a window of 8);
    ``kw`` overrides the config."""
    return tiny_gemma3_model(**{"sliding_window": WINDOW, "bos_token_id": 1, "eos_token_id": 255, **kw})


@pytest.fixture(scope="module")
def tiny_gemma3():
    return gemma3()


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def _export(model, tok, path, **kw):
    kw.setdefault("max_length", 64)
    kw.setdefault("overwrite", True)
    return exporters.export_onnx(model, tok, path, **kw)


def test_spec_reads_gemma3_config(tiny_gemma3):
    spec = DecoderSpec.from_model(tiny_gemma3)
    assert spec.architecture == "gemma3_text" and spec.sliding_layers == [0, 2]
    assert spec.sliding_window == WINDOW and spec.exact_positions is None
    assert spec.rope_theta == 1e6 and spec.local_rope_theta == 1e4
    assert spec.attn_scale == pytest.approx(24 ** -0.5)
    assert spec.inv_freq[1] == pytest.approx(1e6 ** (-2 / 16))
    assert spec.local_inv_freq[1] == pytest.approx(1e4 ** (-2 / 16))
    b = BUILDERS["gemma3_text"](tiny_gemma3, spec, BuildOptions())
    w = tiny_gemma3.model.layers[1].self_attn.q_norm.weight.detach().numpy()
    np.testing.assert_array_equal(b.norm_weight("model.layers.1.self_attn.q_norm.weight"),
                                  1.0 + w.astype(np.float32))
    emb = tiny_gemma3.model.embed_tokens
    assert b.embed_scale == float(emb.embed_scale) == pytest.approx(64 ** 0.5)


@pytest.mark.parametrize("graph", ["fused", "plain"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int4"])
def test_logits_match_torch_past_the_window(graph, precision, tiny_gemma3, tok, tmp_path):
    """The export's own validation (64 tokens, 8x the window) passes; fp32 within 1e-4,
    prefill then decode steps through the runtime's cache equal PyTorch's logits."""
    res = _export(tiny_gemma3, tok, tmp_path / "m", graph=graph, precision=precision)
    p = res.parity
    assert p["window_tokens"] == 64 and p["onnx_checker"] == "ok"
    meta = json.loads((tmp_path / "m" / "edgeprune.json").read_text())
    sw = meta["kv_layout"]["sliding_window"]
    assert sw["window"] == WINDOW and sw["layers"] == [0, 2]
    assert sw["cache"] == ("ring" if graph == "plain" else "full")
    if precision != "fp32":
        assert p["top1_agreement"] >= 0.9
        return
    assert p["max_abs_logit_diff"] < 1e-4 and p["top1_agreement"] == 1.0
    ids = rand_ids(40, seed=3)
    ref = _torch_logits(tiny_gemma3, ids)
    with runtime.load(tmp_path / "m") as s:
        np.testing.assert_allclose(s.logits(ids), ref, atol=1e-4)
        st = s._prefill([ids[0, :12].tolist()])
        errs = [np.abs(st["logits"][0] - ref[0, 11]).max()]
        for t in range(12, 40):
            errs.append(np.abs(s._decode_step(st, ids[0, t:t + 1])[0] - ref[0, t]).max())
        if graph == "plain":     # local layers keep their window, the global one everything
            lens = [int(k.shape()[2]) for k, _ in st["cache"].values]
            assert isinstance(st["cache"], ConcatKVCache) and lens == [WINDOW, 40, WINDOW]
    assert max(errs) < 1e-4


@pytest.mark.parametrize("graph", ["fused", "plain"])
def test_greedy_and_batch_equal_torch(graph, tiny_gemma3, tok, tmp_path):
    """fp32: 24 greedy tokens after an 11-token prompt (3x past the window) are PyTorch's;
    a batch of two prompts of different lengths gives each row's tokens alone."""
    _export(tiny_gemma3, tok, tmp_path / "m", graph=graph, validate=False)
    prompt = rand_ids(11, seed=5)[0].tolist()
    with torch.no_grad():
        hf = tiny_gemma3.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                                  do_sample=False)[0, 11:].tolist()
    with runtime.load(tmp_path / "m") as s:
        assert s.generate([prompt], max_new_tokens=24).token_ids[0] == hf
        two = s.generate([prompt, prompt[:4]], max_new_tokens=16).token_ids
        assert two[0] == hf[:16]
        assert two[1] == s.generate([prompt[:4]], max_new_tokens=16).token_ids[0]


def _ring_session(model, **opts):
    spec = DecoderSpec.from_model(model)
    b = BUILDERS[spec.architecture](model, spec, BuildOptions(graph="fused", max_length=64,
                                                              local_kv="ring", **opts))
    return ort.InferenceSession(b.build().SerializeToString()), b


def _ring_pass(sess, cache, ids, past, kept):
    """One pass the way the runtime drives a fused graph (GroupQueryAttention's seqlens_k /
    total_sequence_length; a first prompt when past is all 0), then the ring commit."""
    past = np.asarray(past)
    first = not past.any()
    lens = np.asarray(kept) if first else past + ids.shape[1]
    bd = sess.io_binding()
    bd.bind_cpu_input("input_ids", np.ascontiguousarray(ids))
    bd.bind_cpu_input("seqlens_k", (lens - 1).astype(np.int32))
    bd.bind_cpu_input("total_sequence_length", np.array(ids.shape[1] if first else lens.max(), np.int32))
    bd.bind_cpu_input("num_logits_to_keep", np.array(ids.shape[1], np.int64))
    cache.bind(bd, ids.shape[1])
    bd.bind_output("logits", "cpu")
    sess.run_with_iobinding(bd)
    cache.commit(past, kept)
    return bd.get_outputs()[-1].numpy()


def test_fused_ring_cache_keeps_only_the_window(tiny_gemma3):
    """local_kv="ring": local layers' past is a [B, KV, 8, D] ring (RingKVCache), present
    the new rows; right-padded batch prefill + decode, chunked prefill across the window,
    a prompt-lookup pass whose rejected drafts are not committed: PyTorch's logits."""
    sess, b = _ring_session(tiny_gemma3)
    kv = KVSpec.from_session(sess)
    assert kv.windows == [WINDOW, None, WINDOW]
    assert b.io_metadata()["sliding_window"]["past_length"] == WINDOW
    full = KVSpec(kv.num_layers, kv.kv_heads, kv.key_dims, kv.value_dims, kv.dtype)
    assert sum(kv.bytes(4096).values()) / sum(full.bytes(4096).values()) == pytest.approx(
        (2 * WINDOW + 4096) / (3 * 4096))
    ids = rand_ids(30, seed=3, batch=2)
    ref = _torch_logits(tiny_gemma3, ids)
    cache = RingKVCache(kv, 2, 64)
    lens = np.array([12, 5])
    x = np.zeros((2, 12), np.int64)
    x[0], x[1, :5] = ids[0, :12], ids[1, :5]
    out = _ring_pass(sess, cache, x, [0, 0], lens)
    errs = [np.abs(out[0] - ref[0, :12]).max(), np.abs(out[1, :5] - ref[1, :5]).max()]
    for _ in range(18):
        out = _ring_pass(sess, cache, ids[np.arange(2), lens][:, None], lens, [1, 1])
        errs += [np.abs(out[b, 0] - ref[b, lens[b]]).max() for b in range(2)]
        lens = lens + 1
    assert max(errs) < 1e-4
    cache = RingKVCache(kv, 1, 64)
    got = [_ring_pass(sess, cache, ids[:1, a:e], [a], [e - a])[0] for a, e in ((0, 10), (10, 21), (21, 30))]
    np.testing.assert_allclose(np.concatenate(got), ref[0], atol=1e-4)
    cache = RingKVCache(kv, 1, 64)
    _ring_pass(sess, cache, ids[:1, :14], [0], [14])
    drafts = ids[:1, 14:18].copy()
    drafts[0, 2:] = 7                                   # two wrong drafts, rejected
    np.testing.assert_allclose(_ring_pass(sess, cache, drafts, [14], [2])[0, :2], ref[0, 14:16], atol=1e-4)
    np.testing.assert_allclose(_ring_pass(sess, cache, ids[:1, 16:17], [16], [1])[0, 0], ref[0, 16],
                               atol=1e-4)


def test_softcaps_and_layer_mixes(tok, tmp_path, monkeypatch):
    """The final-logit soft-cap; an attention soft-cap (Gemma 2 style: transformers'
    Gemma 3 ignores ``attn_logit_softcapping``, so both sides get it here, the model
    through its attention function, the graph through the spec); every layer global, or
    every layer local; linear rope scaling on the global layers (Gemma 3 1B+): fused and
    plain logits match PyTorch."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
    from transformers.models.gemma3 import modeling_gemma3
    from edgeprune_exporters.families import Gemma3Builder

    def capped(module, *a, **kw):
        return modeling_gemma3.eager_attention_forward(module, *a, **{**kw, "softcap": 2.0})

    class CappedGemma3(Gemma3Builder):
        @classmethod
        def read_spec(cls, model, spec):
            spec = super().read_spec(model, spec)
            spec.attn_softcap = 2.0
            return spec

    AttentionInterface.register("edgeprune_softcap_test", capped)
    ALL_MASK_ATTENTION_FUNCTIONS.register("edgeprune_softcap_test", eager_mask)
    for kw, attn in ((dict(final_logit_softcapping=3.0), "eager"),
                     (dict(final_logit_softcapping=3.0), "edgeprune_softcap_test"),
                     (dict(layer_types=["full_attention"] * 3), "eager"),
                     (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default",
                                                                  "rope_theta": 1e4}}), "eager"),
                     (dict(layer_types=["sliding_attention"] * 3), "eager")):
        m = gemma3(**kw)
        m.config._attn_implementation = attn
        monkeypatch.setitem(BUILDERS, "gemma3_text",
                            CappedGemma3 if attn != "eager" else Gemma3Builder)
        ids = rand_ids(24, seed=1)
        ref = _torch_logits(m, ids)
        for graph in ("fused", "plain"):
            _export(m, tok, tmp_path / graph, graph=graph, validate=False)
            with runtime.load(tmp_path / graph) as s:
                np.testing.assert_allclose(s.logits(ids), ref, atol=1e-4, err_msg=f"{kw} {attn} {graph}")


def test_refusals(tiny_gemma3, tok, tmp_path):
    """Variants whose graphs do not know Gemma's blocks, and configs the graph cannot
    follow, are refused before any work."""
    with pytest.raises(ExportError, match="'countdown' cannot be applied to a Gemma 3 export.*compact24"):
        _export(tiny_gemma3, tok, tmp_path / "a", variants=[("countdown", {"mode": "d"})])
    m = gemma3(hidden_activation="gelu")
    with pytest.raises(UnsupportedArchitectureError, match="hidden_activation 'gelu'"):
        _export(m, tok, tmp_path / "b")
    with pytest.raises(ExportError, match="local_kv='window' is unknown"):
        spec = DecoderSpec.from_model(tiny_gemma3)
        BUILDERS["gemma3_text"](tiny_gemma3, spec, BuildOptions(local_kv="window"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_head_record(tiny_gemma3, tiny_qwen2, tok, tmp_path):
    """edgeprune.json's ``head``: the head's storage and bytes, and whether the embedding
    shares its table (tied, fused), holds a dequantized copy (tied, plain) or its own
    (qwen2 int4 exports: a 4-bit table, gathered; the export's validation checks it)."""
    cases = [(tiny_gemma3, "int4", "fused", "int8 block 64 asym", "shared"),
             (tiny_gemma3, "int4", "plain", "int8 block 64 asym", "dequantized copy"),
             (tiny_gemma3, "fp32", "fused", "float32", "shared"),
             (tiny_qwen2, "int4", "fused", "int8 block 64 asym", "int4 block 32 asym"),
             (tiny_qwen2, "int4", "plain", "int8 block 64 asym", "int4 block 32 asym"),
             (tiny_qwen2, "fp16", "fused", "float16", "float")]
    for model, precision, graph, storage, embedding in cases:
        res = _export(model, tok, tmp_path / "h", precision=precision, graph=graph, validate=False)
        head = res.metadata["head"]
        V, H = model.config.vocab_size, model.config.hidden_size
        assert (head["storage"], head["embedding"]) == (storage, embedding)
        assert head["mode"] == ("q8" if precision == "int4" else "fp") and head["policy"]
        item = 2 if precision == "fp16" else 4
        assert head["head_bytes"] == (V * H * item if precision != "int4" else V * (H + 4 + 1))
        assert head["embedding_bytes"] == {"shared": 0, "int4 block 32 asym": V * 2 * (16 + 4 + 1)}.get(
            embedding, V * H * item)


def test_export_keywords_embedding_and_local_kv(tiny_gemma3, tiny_qwen2, tok, tmp_path):
    """export_onnx(embedding=..., local_kv=...): an untied 8-bit table on request (exact
    against the model with that table, the export's validation), the fused ring recorded
    with its static window; unknown values refused."""
    res = _export(tiny_qwen2, tok, tmp_path / "q", precision="int4", embedding="q8")
    assert res.metadata["head"]["embedding"] == "int8 block 64 asym"
    res = _export(tiny_gemma3, tok, tmp_path / "g", local_kv="ring", validate=False)
    sw = res.metadata["kv_layout"]["sliding_window"]
    assert (sw["cache"], sw["past_length"]) == ("ring", WINDOW) and "ring slot" in sw["present"]
    with pytest.raises(ExportError, match="embedding='int2' is unknown"):
        _export(tiny_qwen2, tok, tmp_path / "x", embedding="int2")
