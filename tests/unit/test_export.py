"""Exporter unit tests on tiny random llama / qwen2 models (GQA: 4 q heads, 2 kv heads)."""

from __future__ import annotations

import copy
import json
import shutil
from collections import namedtuple

import numpy as np
import onnx
import pytest
import torch

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime
from edgeprune_exporters.int4 import from_quantized, pack_matmulnbits, rtn_int
from edgeprune_runtime.errors import ExportError, UnsupportedArchitectureError

from tiny import rand_ids, byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def _export(model, tok, path, **kw):
    kw.setdefault("max_length", 256)
    kw.setdefault("overwrite", True)
    return exporters.export_onnx(model, tok, path, **kw)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("graph", ["fused", "plain"])
def test_fp32_prefill_and_decode_parity(arch, graph, tok, tmp_path, request):
    """fp32: prefill logits and 24 decode steps through the KV cache match PyTorch."""
    model = request.getfixturevalue(arch)
    res = _export(model, tok, tmp_path / "m", graph=graph)
    assert res.parity["onnx_checker"] == "ok" and res.parity["shape_inference"] == "ok"
    assert res.parity["max_abs_logit_diff"] < 1e-4
    meta = json.loads((tmp_path / "m" / "edgeprune.json").read_text())
    assert meta["architecture"] == model.config.model_type and meta["graph"] == graph
    assert meta["num_kv_heads"] == 2 and meta["num_heads"] == 4
    assert meta["variants"] == {} and "leank" not in meta and "countdown" not in meta
    if graph == "fused":
        # every residual add + RMSNorm is one fused node whose unused mean and
        # inverse-deviation outputs are left unnamed (not computed per step)
        import onnx

        norms = [n for n in onnx.load(str(tmp_path / "m" / "model.onnx")).graph.node
                 if n.op_type == "SkipSimplifiedLayerNormalization"]
        assert len(norms) == 2 * model.config.num_hidden_layers
        assert all(list(n.output)[1:3] == ["", ""] and n.output[0] and n.output[3] for n in norms)
    ids = rand_ids(40, seed=3)
    with runtime.load(tmp_path / "m") as s:
        np.testing.assert_allclose(s.logits(ids), _torch_logits(model, ids), atol=1e-4)
        # decode one token at a time through the cache, feeding the torch model's inputs
        st = s._prefill([ids[0, :16].tolist()])
        ref = _torch_logits(model, ids)
        errs = [np.abs(st["logits"][0] - ref[0, 15]).max()]
        for t in range(16, 40):
            got = s._decode_step(st, ids[0, t:t + 1])
            errs.append(np.abs(got[0] - ref[0, t]).max())
    assert max(errs) < 1e-4


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_chunked_prefill_with_past(arch, tok, tmp_path, request):
    """Fused graph: several new tokens fed while a past exists (chunked prefill)."""
    model = request.getfixturevalue(arch)
    _export(model, tok, tmp_path / "m", validate=False)
    ids = rand_ids(30, seed=4)
    ref = _torch_logits(model, ids)
    with runtime.load(tmp_path / "m") as s:
        cache = runtime.kv_cache.SharedKVCache(s.kv, 1, 64)
        a = s._run_fused(ids[:, :12], np.array([11], np.int32), 12, 12, cache)
        b = s._run_fused(ids[:, 12:30], np.array([29], np.int32), 30, 18, cache)
    np.testing.assert_allclose(a[0], ref[0, :12], atol=1e-4)
    np.testing.assert_allclose(b[0], ref[0, 12:30], atol=1e-4)


def _fake_quant(model, qmap):
    with torch.no_grad():
        for name, q in qmap.items():
            model.get_submodule(name).weight.copy_(q.dequantize())


def _requantize(model, qmap, suffix, bits, sym, group_size=32):
    """Replace the codes of every linear whose name ends with ``suffix`` (best-w4-style
    mixed precision); returns ``qmap``."""
    from edgeprune.quantize import rtn_quantize
    for n, m in model.named_modules():
        if n.endswith(suffix):
            qmap[n] = rtn_quantize(m.weight.detach(), bits, group_size, sym)
    return qmap


def _rtn_map(model, bits=4, group_size=32, pad_groups=False, sym=False):
    from edgeprune.quantize import rtn_quantize
    return {n: rtn_quantize(m.weight.detach(), bits, group_size, sym, pad_groups=pad_groups)
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"}


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("graph", ["fused", "plain"])
def test_int4_checkpoint_codes_parity(arch, graph, tok, tmp_path, request):
    """int4 from the quantizer's own codes == the fake-quantized torch model
    (accuracy_level 0: fp32 compute, so only float rounding differs), and with
    accuracy_level 4 (int8 activations) top-1 agreement stays high."""
    model = request.getfixturevalue(arch)
    qmap = _rtn_map(model)
    _fake_quant(model, qmap)
    ids = rand_ids(48, seed=5)
    ref = _torch_logits(model, ids)
    res = _export(model, tok, tmp_path / "a0", precision="int4", quantized=qmap, graph=graph,
                  accuracy_level=0, lm_head="fp")
    assert res.metadata["quantization"]["layers"] == 14
    with runtime.load(tmp_path / "a0") as s:
        np.testing.assert_allclose(s.logits(ids), ref, atol=1e-4)
    _export(model, tok, tmp_path / "a4", precision="int4", quantized=qmap, graph=graph,
            accuracy_level=4, lm_head="fp")
    with runtime.load(tmp_path / "a4") as s:
        got = s.logits(ids)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    assert np.abs(got - ref).max() < 0.2


def test_int4_scales_stored_in_float16_when_lossless(tiny_llama, tok, tmp_path):
    """A fused int4 export stores each ``MatMulNBits``' scales as a float16 initializer
    behind a ``Cast`` (the quantizer's scales are float16 values), onnxruntime folds the
    ``Cast`` away, and the logits equal those of the same scales stored in float32; a
    layer whose scales float16 cannot hold keeps float32 scales."""
    import onnx
    import onnxruntime as ort

    model = tiny_llama
    qmap = _rtn_map(model)
    name = next(n for n in qmap if n.endswith("layers.0.self_attn.o_proj"))
    ids = rand_ids(32, seed=2)
    _export(model, tok, tmp_path / "h", precision="int4", quantized=qmap, accuracy_level=0, lm_head="fp")
    proto = onnx.load(str(tmp_path / "h" / "model.onnx"))
    inits = {t.name: t for t in proto.graph.initializer}
    casts = {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "Cast"}
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 8                      # per layer: qkv, o, gate+up, down
    for n in nbits:
        assert inits[casts[n.input[2]]].data_type == onnx.TensorProto.FLOAT16, n.name
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(tmp_path / "h" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False)
    feeds = {o for n in opt.graph.node if n.op_type == "MatMulNBits" for o in n.input[2:3]}
    assert not [n for n in opt.graph.node if n.op_type == "Cast" and n.output[0] in feeds]
    # one layer's scales nudged off the float16 grid: that layer alone stays float32
    qmap2 = dict(qmap)
    qw = qmap[name]
    qmap2[name] = type(qw)(codes=qw.codes, scales=qw.scales * (1 + 2 ** -20), zeros=qw.zeros, bits=qw.bits,
                           group_size=qw.group_size, sym=qw.sym)
    _export(model, tok, tmp_path / "f", precision="int4", quantized=qmap2, accuracy_level=0, lm_head="fp")
    proto = onnx.load(str(tmp_path / "f" / "model.onnx"))
    fp32 = [n.name for n in proto.graph.node if n.op_type == "MatMulNBits"
            and n.input[2] in {t.name for t in proto.graph.initializer}]
    assert fp32 == ["layers.0.attn.o_proj/MatMulNBits"], fp32
    with runtime.load(tmp_path / "h") as a, runtime.load(tmp_path / "f") as b:
        np.testing.assert_allclose(a.logits(ids), b.logits(ids), atol=1e-4)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_symmetric_codes_export_without_zero_points(arch, tok, tmp_path, request):
    """Symmetric grids (every zero point 2**(bits-1), MatMulNBits' default) are written
    without the zero_points input, 4-bit and 8-bit alike, and still equal the
    fake-quantized model exactly; an asymmetric layer keeps its zero points."""
    model = request.getfixturevalue(arch)
    qmap = _requantize(model, _rtn_map(model, sym=True), "v_proj", 8, sym=True)
    _requantize(model, qmap, "layers.0.mlp.down_proj", 4, sym=False)
    _fake_quant(model, qmap)
    ids = rand_ids(40, seed=13)
    _export(model, tok, tmp_path / "m", precision="int4", quantized=qmap, accuracy_level=0,
            lm_head="fp")
    with runtime.load(tmp_path / "m") as s:
        np.testing.assert_allclose(s.logits(ids), _torch_logits(model, ids), atol=1e-4)
    nodes = {n.name.split("/")[0]: len(n.input)
             for n in onnx.load(str(tmp_path / "m" / "model.onnx")).graph.node
             if n.op_type == "MatMulNBits"}
    assert nodes["layers.0.mlp.down_proj"] == 4                   # asym: zero points kept
    assert nodes["layers.0.attn.qkv_proj_v_proj"] == 3            # 8-bit sym
    assert all(v == 3 for k, v in nodes.items() if k != "layers.0.mlp.down_proj")


def test_per_layer_accuracy_level(tiny_llama, tok, tmp_path):
    """accuracy_levels={"down_proj": 0}: only the down_proj MatMulNBits compute in fp32,
    recorded in the metadata; that layer's output then matches the fake-quantized torch
    model more closely than with int8 activations everywhere; a bad override is refused."""
    model = tiny_llama
    qmap = _rtn_map(model)
    _fake_quant(model, qmap)
    ids = rand_ids(48, seed=9)
    ref = _torch_logits(model, ids)
    res = _export(model, tok, tmp_path / "mix", precision="int4", quantized=qmap, lm_head="fp",
                  accuracy_level=4, accuracy_levels={"down_proj": 0})
    assert res.metadata["quantization"]["accuracy_levels"] == {"down_proj": 0}
    nodes = [n for n in onnx.load(str(tmp_path / "mix" / "model.onnx")).graph.node
             if n.op_type == "MatMulNBits"]
    lv = {n.name.split("/")[0]: {a.name: a.i for a in n.attribute}["accuracy_level"]
          for n in nodes}
    assert {k: v for k, v in lv.items() if k.endswith("down_proj")} and \
        all(v == (0 if k.endswith("down_proj") else 4) for k, v in lv.items())
    with runtime.load(tmp_path / "mix") as s:
        mixed = np.abs(s.logits(ids) - ref).max()
    _export(model, tok, tmp_path / "a4", precision="int4", quantized=qmap, lm_head="fp",
            accuracy_level=4)
    with runtime.load(tmp_path / "a4") as s:
        all4 = np.abs(s.logits(ids) - ref).max()
    assert mixed < all4
    with pytest.raises(ExportError, match="accuracy level override"):
        _export(model, tok, tmp_path / "bad", precision="int4", accuracy_levels={"down_proj": 7})
    assert not (tmp_path / "bad").exists()


def _node_levels(folder) -> dict:
    return {n.name.split("/")[0]: {a.name: a.i for a in n.attribute}["accuracy_level"]
            for n in onnx.load(str(folder / "model.onnx")).graph.node if n.op_type == "MatMulNBits"}


@pytest.mark.parametrize("overrides, expect", [
    # a projection's override splits it out of its fused node; its neighbours keep level 4
    ({"v_proj": 0}, {"layers.0.attn.qkv_proj_q_proj_k_proj": 4, "layers.0.attn.qkv_proj_v_proj": 0,
                     "layers.0.mlp.gate_up_proj": 4}),
    ({"up_proj": 0}, {"layers.0.attn.qkv_proj": 4, "layers.0.mlp.gate_up_proj_gate_proj": 4,
                      "layers.0.mlp.gate_up_proj_up_proj": 0}),
    # the fused node's own name still applies to all its parts, which stay fused
    ({"qkv_proj": 0}, {"layers.0.attn.qkv_proj": 0, "layers.0.attn.o_proj": 4}),
    ({"layers.1.mlp.down_proj": 0}, {"layers.0.mlp.down_proj": 4, "layers.1.mlp.down_proj": 0}),
])
def test_accuracy_level_override_names_one_projection(tiny_llama, tok, tmp_path, overrides, expect):
    """accuracy_levels keys match projection names on a name-segment boundary: "v_proj"
    used to match the fused "qkv_proj" node by its last characters (and "up_proj" the
    fused "gate_up_proj"), moving q and k (gate) to the overridden level too."""
    model = tiny_llama
    qmap = _rtn_map(model)
    _fake_quant(model, qmap)
    _export(model, tok, tmp_path / "m", precision="int4", quantized=qmap, accuracy_level=4,
            accuracy_levels=overrides, lm_head="fp", validate=False)
    lv = _node_levels(tmp_path / "m")
    assert {k: lv.get(k) for k in expect} == expect
    ids = rand_ids(24, seed=3)
    with runtime.load(tmp_path / "m") as s:     # split nodes compute the same function
        got = s.logits(ids)
    np.testing.assert_allclose(got, _torch_logits(model, ids), atol=0.25)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_mixed_bits_qkv_fuses_the_runs_it_can(arch, tok, tmp_path, request):
    """best-w4-style codes (8-bit v_proj, 4-bit q/k): q and k share one MatMulNBits, v gets
    its own, and the export still equals the fake-quantized model (qwen2: with biases)."""
    model = request.getfixturevalue(arch)
    qmap = _requantize(model, _rtn_map(model), "v_proj", 8, sym=False)
    _fake_quant(model, qmap)
    ids = rand_ids(40, seed=11)
    _export(model, tok, tmp_path / "m", precision="int4", quantized=qmap, accuracy_level=0,
            lm_head="fp")
    with runtime.load(tmp_path / "m") as s:
        np.testing.assert_allclose(s.logits(ids), _torch_logits(model, ids), atol=1e-4)
    names = [n.name.split("/")[0] for n in onnx.load(str(tmp_path / "m" / "model.onnx")).graph.node
             if n.op_type == "MatMulNBits" and n.name.startswith("layers.0.attn")]
    assert names == ["layers.0.attn.qkv_proj_q_proj_k_proj", "layers.0.attn.qkv_proj_v_proj",
                     "layers.0.attn.o_proj"]


def test_int4_padded_block_layer(tiny_llama, tok, tmp_path):
    """group_size 64 on down_proj (in = 160, not a multiple of 64): K padded, still exact."""
    model = tiny_llama
    qmap = _rtn_map(model, group_size=64, pad_groups=True)
    assert qmap["model.layers.0.mlp.down_proj"].n_groups == 3       # 64 + 64 + 32
    _fake_quant(model, qmap)
    _export(model, tok, tmp_path / "m", precision="int4", quantized=qmap, accuracy_level=0,
            lm_head="fp", validate=False)
    ids = rand_ids(32, seed=6)
    with runtime.load(tmp_path / "m") as s:
        np.testing.assert_allclose(s.logits(ids), _torch_logits(model, ids), atol=1e-4)
    m = onnx.load(str(tmp_path / "m" / "model.onnx"))
    down = [n for n in m.graph.node if n.op_type == "MatMulNBits" and "down_proj" in n.name][0]
    attrs = {a.name: a.i for a in down.attribute}
    assert attrs["K"] == 160 and attrs["block_size"] == 64


def test_act_order_g_idx_parity(tiny_llama, tok, tmp_path):
    """GPTQ act_order: groups formed over a column permutation (non-default g_idx)
    export with the right channel order."""
    from edgeprune.quantize import QuantizedWeight, rtn_quantize
    model = tiny_llama
    rng = np.random.default_rng(0)
    qmap = {}
    for n, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or n == "lm_head":
            continue
        w = m.weight.detach()
        perm = torch.from_numpy(rng.permutation(w.shape[1]))
        q = rtn_quantize(w[:, perm], 4, 32, False)
        inv = torch.argsort(perm)
        g_idx = (torch.arange(w.shape[1]) // 32)[inv].to(torch.int32)
        qmap[n] = QuantizedWeight(codes=q.codes[:, inv], scales=q.scales, zeros=q.zeros,
                                  bits=4, group_size=32, sym=False, g_idx=g_idx)
        assert not qmap[n].has_default_order()
    _fake_quant(model, qmap)
    _export(model, tok, tmp_path / "m", precision="int4", quantized=qmap, accuracy_level=0,
            lm_head="fp", validate=False)
    ids = rand_ids(32, seed=7)
    with runtime.load(tmp_path / "m") as s:
        np.testing.assert_allclose(s.logits(ids), _torch_logits(model, ids), atol=1e-4)
    # dropping g_idx (wrong channel order) must break parity: the test can fail
    bad = {k: QuantizedWeight(v.codes, v.scales, v.zeros, 4, 32, False) for k, v in qmap.items()}
    _export(model, tok, tmp_path / "bad", precision="int4", quantized=bad, accuracy_level=0,
            lm_head="fp", validate=False)
    with runtime.load(tmp_path / "bad") as s:
        assert np.abs(s.logits(ids) - _torch_logits(model, ids)).max() > 1e-2


def test_matmulnbits_packing_roundtrip():
    """Packed nibbles/zero points decode back to the codes; padding dequantizes to 0."""
    rng = np.random.default_rng(0)
    w = rtn_int(rng.standard_normal((6, 80)).astype(np.float32), 4, 32)
    B, sc, zp = pack_matmulnbits(w)
    assert B.shape == (6, 3, 16) and sc.shape == (18,) and zp.shape == (6 * 2,)
    lo, hi = B & 15, B >> 4
    codes = np.stack([lo, hi], -1).reshape(6, 96)
    np.testing.assert_array_equal(codes[:, :80], w.codes)
    z = np.stack([zp & 15, zp >> 4], -1).reshape(6, 4)[:, :3]
    np.testing.assert_array_equal(z, w.zeros)
    np.testing.assert_array_equal(codes[:, 80:], np.repeat(w.zeros[:, 2:3], 16, 1))


def test_per_row_group_repeats_scales():
    """group_size = in_features (per row) is represented exactly with 32-wide blocks."""
    Q = namedtuple("Q", "codes scales zeros bits group_size sym g_idx")
    codes = np.random.default_rng(0).integers(0, 16, (4, 96)).astype(np.uint8)
    q = Q(codes, np.arange(1, 5, dtype=np.float32)[:, None], np.full((4, 1), 8, np.uint8),
          4, 96, True, None)
    w = from_quantized(q)
    assert w.block_size == 32 and w.scales.shape == (4, 3)
    np.testing.assert_allclose(w.dequantize(), (codes.astype(np.float32) - 8) *
                               np.arange(1, 5)[:, None])


def test_int4_lm_head_modes_and_tied_sharing(tok, tmp_path):
    """Tied embeddings + q8 head share ONE table (gathered for the embedding);
    int4 head only on request and recorded."""
    from transformers import LlamaConfig
    from tiny import tiny_model
    model = tiny_model(LlamaConfig, tie_word_embeddings=True)
    r8 = _export(model, tok, tmp_path / "q8", precision="int4", accuracy_level=0)
    assert r8.metadata["lm_head"] == "q8" and r8.metadata["quantization"]["lm_head"] == "int8 block 64"
    m = onnx.load(str(tmp_path / "q8" / "model.onnx"))
    names = [i.name for i in m.graph.initializer]
    assert "model.embed_tokens.weight" not in names and "lm_head.qweight" in names
    assert r8.parity["max_abs_logit_diff"] < 1e-3
    r4 = _export(model, tok, tmp_path / "i4", precision="int4", lm_head="int4", accuracy_level=0)
    assert r4.metadata["quantization"]["lm_head"] == "int4 block 32"
    assert r4.parity["max_abs_logit_diff"] < 1e-3
    cost = r4.parity["lm_head_int4_ppl_cost"]
    assert cost["window_ppl_int4_head"] > 1 and "int4 lm_head costs" in r4.summary()
    assert cost["cost_pct"] == pytest.approx(
        100 * (cost["window_ppl_int4_head"] / cost["window_ppl_int8_head"] - 1))
    assert "lm_head_int4_ppl_cost" not in r8.parity
    def table_bytes(folder):            # the head's tensors (the whole file is page-padded)
        m = onnx.load(str(folder / "model.onnx"))
        return sum(onnx.numpy_helper.to_array(t).nbytes for t in m.graph.initializer
                   if t.name.startswith(("lm_head.", "embed_tokens.")))
    assert table_bytes(tmp_path / "i4") < 0.75 * table_bytes(tmp_path / "q8")
    # a symmetric 4-bit head from the quantizer: no zero points stored, by the head or by
    # the embedding gather that shares its table, and still exact at accuracy level 0
    from edgeprune.quantize import rtn_quantize
    qh = rtn_quantize(model.lm_head.weight.detach(), 4, 32, True)
    rs = _export(model, tok, tmp_path / "s4", precision="int4", lm_head="int4",
                 quantized={"lm_head": qh}, accuracy_level=0)
    ms = onnx.load(str(tmp_path / "s4" / "model.onnx"))
    assert "lm_head.qzeros" not in [i.name for i in ms.graph.initializer]
    assert rs.parity["max_abs_logit_diff"] < 1e-3
    rf = _export(model, tok, tmp_path / "fp", precision="fp32")
    assert rf.parity["max_abs_logit_diff"] < 1e-4


@pytest.mark.parametrize("lm_head", ["q8", "int4"])
def test_tied_head_scales_read_in_place(lm_head, tok, tmp_path):
    """The scales of a tied quantized table (8-bit or int4 head shared with the embedding)
    are one float32 ``[vocab, n_blocks]`` initializer, and its zero points one uint8
    ``[vocab, bytes per row]``, that the head's ``MatMulNBits`` and the embedding's
    ``Gather`` both read as stored: no ``Cast`` or ``Reshape`` in front
    that onnxruntime would fold into a resident copy of the whole table of scales (its
    MatMulNBits keeps a scales input after pre-packing it), and none in the optimized
    graph; the export still computes what the quantizer measured."""
    import onnxruntime as ort
    from transformers import LlamaConfig
    from tiny import tiny_model
    model = tiny_model(LlamaConfig, tie_word_embeddings=True)
    res = _export(model, tok, tmp_path / "m", precision="int4", lm_head=lm_head, accuracy_level=0)
    assert res.parity["max_abs_logit_diff"] < 1e-3
    m = onnx.load(str(tmp_path / "m" / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in m.graph.initializer}
    head = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and n.name.startswith("lm_head"))
    at = {a.name: onnx.helper.get_attribute_value(a) for a in head.attribute}
    V, nb = int(at["N"]), -(-int(at["K"]) // int(at["block_size"]))
    sc = inits[head.input[2]]
    assert sc.data_type == onnx.TensorProto.FLOAT and list(sc.dims) == [V, nb]
    gathers = [n for n in m.graph.node if n.op_type == "Gather" and n.input[0] == head.input[2]]
    assert len(gathers) == 1
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(tmp_path / "m" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False)
    copies = [t.name for t in opt.graph.initializer
              if int(np.prod(t.dims)) == V * nb and t.name != head.input[2]
              and t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)]
    assert copies == [], copies
    # the zero points too: the head's own (packed for int4) [vocab, bytes per row], gathered
    # as stored; no other table of them in the file
    zp = inits[head.input[3]]
    assert list(zp.dims) == [V, -(-nb * int(at["bits"]) // 8)]
    assert [n for n in m.graph.node if n.op_type == "Gather" and n.input[0] == head.input[3]]
    assert "embed_tokens.zeros" not in inits


def test_fp16_export_runs(tiny_llama, tok, tmp_path):
    res = _export(tiny_llama, tok, tmp_path / "m", precision="fp16")
    assert res.parity["top1_agreement"] >= 0.95
    assert res.metadata["kv_layout"]["dtype"] == "float16"


def test_folder_contents_and_metadata(tiny_llama, tok, tmp_path):
    res = _export(tiny_llama, tok, tmp_path / "m", precision="int4",
                  provenance={"method": "rtn", "recipe": "w4g32"})
    files = set(res.files)
    assert {"model.onnx", "tokenizer.json", "tokenizer_config.json", "genai_config.json",
            "edgeprune.json"} <= files
    cfg = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] and cfg["eos_token"] == "</s>"
    meta = res.metadata
    kv = meta["kv_layout"]
    assert kv["past_key"]["shape"] == ["batch_size", 2, "max_length", "key_head_dim"]
    assert kv["past_key"]["key_head_dim"] == [16, 16]
    assert meta["quantization"]["bits"] == 4 and meta["provenance"]["method"] == "rtn"
    assert meta["sparse_24_speedup_claimed"] is False
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m.tmp")]
    assert "parity on 64 tokens" in res.summary()


def test_external_data(tiny_llama, tok, tmp_path):
    res = _export(tiny_llama, tok, tmp_path / "m", external_data=True)
    assert "model.onnx.data" in res.files and res.files["model.onnx"] < 100_000
    assert res.parity["max_abs_logit_diff"] < 1e-4


def test_bad_inputs_leave_nothing(tiny_llama, tok, tmp_path, monkeypatch):
    # output inside the input folder
    src = tmp_path / "ckpt"
    src.mkdir()
    tiny_llama.config._name_or_path = str(src)
    with pytest.raises(ExportError, match="inside the input model folder"):
        exporters.export_onnx(tiny_llama, tok, src / "onnx")
    tiny_llama.config._name_or_path = ""
    # existing folder without overwrite
    (tmp_path / "exists").mkdir()
    with pytest.raises(ExportError, match="already exists"):
        exporters.export_onnx(tiny_llama, tok, tmp_path / "exists")
    # insufficient disk
    import edgeprune_exporters.folder as folder
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(folder.shutil, "disk_usage", lambda p: Usage(10, 10, 1000))
    with pytest.raises(ExportError, match="not enough disk space"):
        exporters.export_onnx(tiny_llama, tok, tmp_path / "nodisk")
    monkeypatch.undo()
    assert not (tmp_path / "nodisk").exists()
    # missing tensors / unsupported layer type
    broken = copy.deepcopy(tiny_llama)
    broken.model.layers[1].mlp.up_proj = torch.nn.Identity()
    with pytest.raises((ExportError, UnsupportedArchitectureError), match="up_proj"):
        exporters.export_onnx(broken, tok, tmp_path / "broken")
    # failure during the write (validation) -> temp folder removed
    import edgeprune_exporters.validate as validate
    monkeypatch.setattr(validate, "check_graph", lambda p: (_ for _ in ()).throw(
        ExportError("boom", "none")))
    with pytest.raises(ExportError, match="boom"):
        exporters.export_onnx(tiny_llama, tok, tmp_path / "failed")
    # ... and so are the parent folders the export created for it (they were left)
    with pytest.raises(ExportError, match="boom"):
        exporters.export_onnx(tiny_llama, tok, tmp_path / "a" / "b" / "failed")
    monkeypatch.undo()
    # no tokenizer: refused before any work (it failed at the end, or wrote a folder the
    # runtime refuses)
    with pytest.raises(ExportError, match="a tokenizer is required, got NoneType"):
        exporters.export_onnx(tiny_llama, None, tmp_path / "c" / "notok", validate=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "exists"]


def test_unsupported_architecture(tok, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        exporters.export_onnx(m, tok, tmp_path / "g")
    assert not (tmp_path / "g").exists()


def test_configs_the_graph_cannot_follow_are_refused(tok, tmp_path):
    """Configs whose attention or MLP the graph would silently get wrong (each used to
    export "successfully": GELU 0.45 off, qwen2 sliding window and dynamic / longrope
    rope off past the window / original context)."""
    from transformers import LlamaConfig, Qwen2Config
    from tiny import tiny_model
    with pytest.raises(UnsupportedArchitectureError, match="hidden_act 'gelu'"):
        _export(tiny_model(LlamaConfig, hidden_act="gelu"), tok, tmp_path / "a")
    sw = tiny_model(Qwen2Config, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(UnsupportedArchitectureError, match=r"max_length=64: sliding-window attention "
                                                            r"\(sliding_window=8\).*--max-length 8"):
        _export(sw, tok, tmp_path / "b", max_length=64)
    assert _export(sw, tok, tmp_path / "b", max_length=8).parity["max_abs_logit_diff"] < 1e-4
    dyn = tiny_model(LlamaConfig, max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(UnsupportedArchitectureError, match="rope_type 'dynamic' changes its frequencies past 32"):
        _export(dyn, tok, tmp_path / "c", max_length=128)
    lr = tiny_model(LlamaConfig, max_position_embeddings=128, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
        "original_max_position_embeddings": 32})
    with pytest.warns(UserWarning, match="max_length set to 32.*longrope"):
        r = exporters.export_onnx(lr, tok, tmp_path / "d")
    assert r.metadata["max_length"] == 32
    assert not any((tmp_path / x).exists() for x in "ac")


def test_failed_validation_writes_nothing(tok, tmp_path):
    """Logits that do not match the model fail the export (validation used to record the
    figures and succeed): here the model computes GELU while its config claims SiLU."""
    from transformers import LlamaConfig
    from tiny import tiny_model
    from edgeprune_exporters.validate import check_parity
    m = tiny_model(LlamaConfig, hidden_act="gelu")
    m.config.hidden_act = "silu"
    with pytest.raises(ExportError, match=r"validation failed: .* by up to 0\.4\d* \(allowed 0\.00\d* "
                                          r"for an fp32 graph; top-1 agreement 70\.3% .*--no-validate"):
        _export(m, tok, tmp_path / "fp32")
    assert list(tmp_path.iterdir()) == []
    assert _export(m, tok, tmp_path / "kept", validate=False).parity == {}
    # approximate graphs (int8 activations, fp16): only gross errors fail. SmolLM2 int4's
    # own record passes; random logits fail
    smol = dict(window_tokens=64, max_abs_logit_diff=1.75, mean_abs_logit_diff=0.227,
                top1_agreement=0.906, reference_abs_max=25.0, reference_spread=2.0)
    check_parity(smol, approximate=True)
    with pytest.raises(ExportError, match="top-1 agreement 1.0%"):
        check_parity(dict(smol, top1_agreement=0.01), approximate=True)
    with pytest.raises(ExportError, match=r"mean \|logit difference\| 1\.5 \(allowed 1\)"):
        check_parity(dict(smol, mean_abs_logit_diff=1.5), approximate=True)
    with pytest.raises(ExportError, match="for an fp32 graph"):
        check_parity(smol, approximate=False)


@pytest.mark.parametrize("lm_head", ["q8", "int4"])
def test_tied_quantized_head_plain_equals_fused(tok, tmp_path, lm_head):
    """A tied model with a quantized head: the plain graph embeds from the same quantized
    table as the fused one (it read the float table: 0.46 off with an int4 head), and a
    plain graph's head runs at the requested accuracy level (onnxruntime's own default
    for its DequantizeLinear + MatMul fusion is int8 activations: 1.5e-2 off)."""
    from transformers import LlamaConfig
    from tiny import tiny_model
    model = tiny_model(LlamaConfig, tie_word_embeddings=True)
    ids = rand_ids(40, seed=3)
    out = {}
    for graph in ("fused", "plain"):
        r = _export(model, tok, tmp_path / graph, precision="fp32", lm_head=lm_head, graph=graph,
                    accuracy_level=0)
        assert r.parity["max_abs_logit_diff"] < 1e-4
        with runtime.load(tmp_path / graph) as s:
            out[graph] = s.logits(ids)
    assert json.loads((tmp_path / "plain" / "edgeprune.json").read_text())["qdq_accuracy_level"] == 0
    np.testing.assert_allclose(out["plain"], out["fused"], atol=1e-4)


def test_overwrite_never_deletes_the_users_files(tiny_llama, tok, tmp_path):
    """An export folder the user added a file to is refused even with overwrite (its
    edgeprune.json was enough to delete everything in it)."""
    _export(tiny_llama, tok, tmp_path / "e", validate=False)
    (tmp_path / "e" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"holds files that are not an edgeprune export \(notes.txt\)"):
        _export(tiny_llama, tok, tmp_path / "e", validate=False)
    assert (tmp_path / "e" / "notes.txt").read_text() == "mine"


def test_overwrite_replaces(tiny_llama, tok, tmp_path):
    _export(tiny_llama, tok, tmp_path / "m", validate=False)
    _export(tiny_llama, tok, tmp_path / "m", validate=False, max_length=64)
    assert json.loads((tmp_path / "m" / "edgeprune.json").read_text())["max_length"] == 64
    assert not [p for p in tmp_path.iterdir() if p.name != "m"]       # no temp / old folder left
