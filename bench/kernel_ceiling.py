"""How fast onnxruntime's own kernels can go on this CPU, for SmolLM2-135M's shapes.

The decode step of an int4 export is ~150 ``MatMulNBits`` calls, 30
``GroupQueryAttention`` calls and a few small ops. This script measures the two big ones
alone, in graphs of a single node, so the runtime's decode speed can be read against what
the kernels allow (README, "Where the 1-thread decode gap to llama.cpp is"):

* ``MatMulNBits`` at ``accuracy_level=4`` (int8 activations), ``M = 1``, for each shape
  of the model (fused q+k ``576 -> 768``, ``o_proj``, fused gate/up ``576 -> 3072``,
  ``down_proj 1536 -> 576``, the ``576 -> 49152`` head), 4-bit block 64 with and without
  zero points (asymmetric / symmetric grids) and the 8-bit head. *hot*: one node called
  again and again, its weights stay in cache, so the time is the kernel's compute;
  *cold*: 30 copies called in turn (a layer's worth each), weights streamed from DRAM as
  in a decode step (the head is one node either way: its 15-29 MB are about the size of
  the last-level cache). Reported as G weights/s and GB/s of packed weights.
* ``GroupQueryAttention`` (9 query / 3 KV heads of 64, rotary inside, shared KV buffer
  bound with IOBinding) per call at 16, 190 and 290 cached tokens.

* ``--attention``: a decode step's attention at long contexts (issue 25, items 1 and 4), 30
  layers of SmolLM2's heads at each ``--contexts`` length: onnxruntime's
  ``GroupQueryAttention`` over the fp32 shared buffers (what the exports run) against the
  one candidate built from standard operators that reads the cache once per KV group: a
  time-major cache ``[T, kv*D]`` (a prefix of a preallocated buffer, bound zero-copy), the
  scores of all 9 query heads as one ``Gemm`` with a block-diagonal query ``[kv*D, 9]``,
  ``Softmax`` over time, and one ``Gemm`` (``transA``) with the values; and the floor: the
  same K and V bytes read once by numpy (a sum, one thread). Its output is checked against a
  numpy reference before it is timed.
* ``--attention --leank-keep 0.3``: also LeanK's attention as it would run at speed (issue
  25, item 2) at every context longer than ``--leank-full`` (sink + window, 512): no cache
  concatenated, every buffer bound in place; three forms from standard operators, each
  checked against a numpy LeanK reference: time-major with the block-diagonal query,
  head-major (one batched ``MatMul`` per KV group), and head-major with the middle in int8
  (``MatMulInteger``). ``keep`` channels per KV head are drawn at random: the time does not
  depend on which.

Each figure is the best of ``--repeat`` medians; the per-call Python overhead of
``session.run`` (measured on a tiny node) is subtracted from the hot figures. No peer
runs here: records carry ``peer``/``theirs`` null.

Usage::

    python bench/kernel_ceiling.py --quick --json bench/results/kernel_ceiling.json
    python bench/kernel_ceiling.py --attention --threads 1 2 --json bench/results/attention_ceiling.json
    python bench/kernel_ceiling.py --attention --leank-keep 0.3 --contexts 1024 2048 4096 --threads 1 2 \\
        --json bench/results/attention_ceiling_leank.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import benchlib

OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
SHAPES = {"qk": (576, 768), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "head": (576, 49152)}


def _session(nodes, inputs, outputs, inits, threads):
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(helper.make_model(g, opset_imports=OPSETS).SerializeToString(),
                                so, providers=["CPUExecutionProvider"])


def matmulnbits(K: int, N: int, bits: int, zero_points: bool, threads: int, seed: int = 0):
    """A one-node ``MatMulNBits`` session (block 64, random codes); returns
    ``(session, packed weight bytes)``."""
    rng = np.random.default_rng(seed)
    bs = 64
    nb = math.ceil(K / bs)
    B = rng.integers(0, 256, (N, nb, bs * bits // 8), dtype=np.uint8)
    S = (rng.random(N * nb, dtype=np.float32) * 0.01).astype(np.float32)
    inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(S, "S")]
    ins = ["A", "B", "S"]
    nbytes = B.nbytes + S.nbytes
    if zero_points:
        per = 8 // bits
        Z = rng.integers(0, 256, N * math.ceil(nb / per), dtype=np.uint8)
        inits.append(numpy_helper.from_array(Z, "Z"))
        ins.append("Z")
        nbytes += Z.nbytes
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", K=K, N=N,
                            bits=bits, block_size=bs, accuracy_level=4)
    sess = _session([node], [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, K])],
                    [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, N])], inits, threads)
    return sess, nbytes


def _best_median(fn, calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        for _ in range(3):
            fn()
        ts = []
        for _ in range(calls):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        best = min(best, float(np.median(ts)))
    return best


def gqa_session(nlayers: int, max_len: int, threads: int):
    """``nlayers`` independent ``GroupQueryAttention`` nodes (SmolLM2's heads) reading a
    shared packed QKV input."""
    H, KVH, D = 9, 3, 64
    inv = 1.0 / 100000 ** (np.arange(0, D, 2) / D)
    ang = np.arange(max_len)[:, None] * inv[None]
    inits = [numpy_helper.from_array(np.cos(ang).astype(np.float32), "cos"),
             numpy_helper.from_array(np.sin(ang).astype(np.float32), "sin")]
    ins = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, 1, (H + 2 * KVH) * D]),
           helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
           helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outs, nodes = [], []
    for i in range(nlayers):
        ins += [helper.make_tensor_value_info(f"pk{i}", TensorProto.FLOAT, [1, KVH, max_len, D]),
                helper.make_tensor_value_info(f"pv{i}", TensorProto.FLOAT, [1, KVH, max_len, D])]
        nodes.append(helper.make_node(
            "GroupQueryAttention", ["qkv", "", "", f"pk{i}", f"pv{i}", "seqlens_k", "total", "cos", "sin"],
            [f"o{i}", f"ok{i}", f"ov{i}"], domain="com.microsoft", num_heads=H, kv_num_heads=KVH,
            do_rotary=1, rotary_interleaved=0, scale=1.0 / math.sqrt(D)))
        outs += [helper.make_tensor_value_info(f"o{i}", TensorProto.FLOAT, [1, 1, H * D]),
                 helper.make_tensor_value_info(f"ok{i}", TensorProto.FLOAT, [1, KVH, max_len, D]),
                 helper.make_tensor_value_info(f"ov{i}", TensorProto.FLOAT, [1, KVH, max_len, D])]
    return _session(nodes, ins, outs, inits, threads), (H, KVH, D)


def gqa_binding(sess, qkv: np.ndarray, kv: list, outs: list, ctx: int):
    """An IOBinding of :func:`gqa_session` at ``ctx`` cached tokens: every layer's K / V
    buffer (``kv[2i]``, ``kv[2i+1]``) bound as its past and its present (in place), its
    output into ``outs[i]``."""
    bd = sess.io_binding()
    bd.bind_cpu_input("qkv", qkv)
    bd.bind_cpu_input("seqlens_k", np.array([ctx - 1], np.int32))
    bd.bind_cpu_input("total", np.array(ctx, np.int32))
    for i in range(len(outs)):
        k, v = (ort.OrtValue.ortvalue_from_numpy(kv[2 * i]), ort.OrtValue.ortvalue_from_numpy(kv[2 * i + 1]))
        bd.bind_ortvalue_input(f"pk{i}", k)
        bd.bind_ortvalue_input(f"pv{i}", v)
        bd.bind_ortvalue_output(f"ok{i}", k)
        bd.bind_ortvalue_output(f"ov{i}", v)
        bd.bind_ortvalue_output(f"o{i}", ort.OrtValue.ortvalue_from_numpy(outs[i]))
    return bd


def _blockdiag_inits(heads):
    """Initializers of the block-diagonal query and of picking each head's block back."""
    H, KVH, D = heads
    G = H // KVH
    eye = np.zeros((KVH, 1, KVH, 1), np.float32)
    for k in range(KVH):
        eye[k, 0, k, 0] = 1
    return [numpy_helper.from_array((eye / math.sqrt(D)).astype(np.float32), "eye_s"),
            numpy_helper.from_array(eye, "eye"),
            numpy_helper.from_array(np.array([KVH, G, D], np.int64), "s_q"),
            numpy_helper.from_array(np.array([1, D, KVH, G], np.int64), "s_qt"),
            numpy_helper.from_array(np.array([KVH * D, H], np.int64), "s_qm"),
            numpy_helper.from_array(np.array([KVH, G, KVH, D], np.int64), "s_o"),
            numpy_helper.from_array(np.array([1, 1, H * D], np.int64), "s_out"),
            numpy_helper.from_array(np.array([2], np.int64), "axis2")]


def _blockdiag_query(q: str, p: str) -> list:
    """``q [1, 1, H*D]`` -> ``{p}qm [kv*D, H]``: each KV group's queries in its own rows,
    the scale folded in."""
    return [helper.make_node("Reshape", [q, "s_q"], [p + "q"]),
            helper.make_node("Transpose", [p + "q"], [p + "qt"], perm=[2, 0, 1]),
            helper.make_node("Reshape", [p + "qt", "s_qt"], [p + "q4"]),
            helper.make_node("Mul", [p + "q4", "eye_s"], [p + "qb"]),
            helper.make_node("Reshape", [p + "qb", "s_qm"], [p + "qm"])]


def _blockdiag_output(p: str, out: str) -> list:
    """``{p}o [H, kv*D]`` -> each head's own group's block -> ``out [1, 1, H*D]``."""
    return [helper.make_node("Reshape", [p + "o", "s_o"], [p + "o4"]),
            helper.make_node("Mul", [p + "o4", "eye"], [p + "ob"]),
            helper.make_node("ReduceSum", [p + "ob", "axis2"], [p + "og"], keepdims=0),
            helper.make_node("Reshape", [p + "og", "s_out"], [out])]


def blockgemm_session(nlayers: int, threads: int, heads=(9, 3, 64)):
    """``nlayers`` attention blocks over time-major caches ``K{i}, V{i} [T, kv*D]`` from
    standard operators (the ``--attention`` candidate): ``q [1, 1, H*D]`` -> block-diagonal
    ``[kv*D, H]`` (each KV group's queries in its own rows, the scale folded in) -> scores
    ``Gemm(K, q) [T, H]`` -> ``Softmax`` over time -> ``Gemm(P^T, V) [H, kv*D]`` -> each
    head's own group's block -> ``[1, 1, H*D]``, the next block's query."""
    H, KVH, D = heads
    inits = _blockdiag_inits(heads)
    ins = [helper.make_tensor_value_info("q0", TensorProto.FLOAT, [1, 1, H * D])]
    nodes = []
    for i in range(nlayers):
        ins += [helper.make_tensor_value_info(f"K{i}", TensorProto.FLOAT, ["T", KVH * D]),
                helper.make_tensor_value_info(f"V{i}", TensorProto.FLOAT, ["T", KVH * D])]
        p = f"l{i}_"
        nodes += _blockdiag_query(f"q{i}", p)
        nodes += [helper.make_node("Gemm", [f"K{i}", p + "qm"], [p + "s"]),
                  helper.make_node("Softmax", [p + "s"], [p + "p"], axis=0),
                  helper.make_node("Gemm", [p + "p", f"V{i}"], [p + "o"], transA=1)]
        nodes += _blockdiag_output(p, f"q{i + 1}")
    outs = [helper.make_tensor_value_info(f"q{nlayers}", TensorProto.FLOAT, [1, 1, H * D])]
    return _session(nodes, ins, outs, inits, threads)


def _attention_reference(q: np.ndarray, K: np.ndarray, V: np.ndarray, heads=(9, 3, 64)) -> np.ndarray:
    """One block of :func:`blockgemm_session` in numpy: ``q [H*D]``, ``K, V [T, kv*D]``."""
    H, KVH, D = heads
    G = H // KVH
    out = np.empty((H, D), np.float64)
    for h in range(H):
        k = h // G
        s = K[:, k * D:(k + 1) * D].astype(np.float64) @ q[h * D:(h + 1) * D] / math.sqrt(D)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ V[:, k * D:(k + 1) * D]
    return out.reshape(-1)


def leank_session(nlayers: int, threads: int, dk: int, heads=(9, 3, 64)):
    """``nlayers`` LeanK attention blocks as they would run *at speed* (issue 25, item 2):
    in-place time-major buffers bound zero-copy, no concatenation of caches. Per layer:
    the sink + window keys ``Kf{i} [F, kv*D]`` at full width, the middle keys ``Km{i} [Tm,
    kv*dk]`` holding ``dk`` kept channels per KV head (``keep{i} [kv*dk]``: their rows of the
    ``[kv*D]`` key), and all values ``V{i} [F + Tm, kv*D]`` in the same order. Scores: the
    block-diagonal query of :func:`blockgemm_session` against ``Kf``, its kept rows
    (``Gather``) against ``Km``; one ``Softmax`` over both; one ``Gemm`` with ``V``. LeanK (Zhang et
    al., EMNLP 2025) learns which channels to keep; this graph times any ``dk``."""
    H, KVH, D = heads
    inits = _blockdiag_inits(heads)
    ins = [helper.make_tensor_value_info("q0", TensorProto.FLOAT, [1, 1, H * D])]
    nodes = []
    for i in range(nlayers):
        ins += [helper.make_tensor_value_info(f"Kf{i}", TensorProto.FLOAT, ["F", KVH * D]),
                helper.make_tensor_value_info(f"Km{i}", TensorProto.FLOAT, ["Tm", KVH * dk]),
                helper.make_tensor_value_info(f"V{i}", TensorProto.FLOAT, ["T", KVH * D]),
                helper.make_tensor_value_info(f"keep{i}", TensorProto.INT64, [KVH * dk])]
        p = f"l{i}_"
        nodes += _blockdiag_query(f"q{i}", p)
        nodes += [helper.make_node("Gather", [p + "qm", f"keep{i}"], [p + "qk"], axis=0),
                  helper.make_node("Gemm", [f"Kf{i}", p + "qm"], [p + "sf"]),
                  helper.make_node("Gemm", [f"Km{i}", p + "qk"], [p + "sm"]),
                  helper.make_node("Concat", [p + "sf", p + "sm"], [p + "s"], axis=0),
                  helper.make_node("Softmax", [p + "s"], [p + "p"], axis=0),
                  helper.make_node("Gemm", [p + "p", f"V{i}"], [p + "o"], transA=1)]
        nodes += _blockdiag_output(p, f"q{i + 1}")
    outs = [helper.make_tensor_value_info(f"q{nlayers}", TensorProto.FLOAT, [1, 1, H * D])]
    return _session(nodes, ins, outs, inits, threads)


def _heads_graph_io(heads):
    """Initializers and the first inputs (``q0 [1, 1, H*D]``, ``mask [T]``) of the head-major
    LeanK graphs."""
    H, KVH, D = heads
    inits = [numpy_helper.from_array(np.array([KVH, H // KVH, D], np.int64), "s_q"),
             numpy_helper.from_array(np.array([1, 1, H * D], np.int64), "s_out"),
             numpy_helper.from_array(np.array(1.0 / math.sqrt(D), np.float32), "scale")]
    ins = [helper.make_tensor_value_info("q0", TensorProto.FLOAT, [1, 1, H * D]),
           helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["T"])]
    return inits, ins


def _heads_query(i: int, p: str) -> list:
    """Layer ``i``'s scaled query ``{p}q [kv, G, D]``, its kept channels ``{p}qk [kv, G, dk]``
    and the sink + window scores ``{p}sf [kv, G, F]``."""
    return [helper.make_node("Reshape", [f"q{i}", "s_q"], [p + "q0"]),
            helper.make_node("Mul", [p + "q0", "scale"], [p + "q"]),
            helper.make_node("MatMul", [p + "q", f"sel{i}"], [p + "qk"]),
            helper.make_node("MatMul", [p + "q", f"Kf{i}"], [p + "sf"])]


def leank_heads_session(nlayers: int, threads: int, dk: int, heads=(9, 3, 64)):
    """The head-major form of :func:`leank_session`: per layer the sink + window keys
    ``Kf{i} [kv, D, F]`` and the middle keys ``Kt{i} [kv, dk, Tm]`` stored transposed (a new
    key is a column; a buffer grown in chunks, its unused columns masked), values ``V{i}
    [kv, F + Tm, D]``. The query's kept channels come from a one-hot ``sel{i} [kv, D, dk]``;
    each KV group's scores are one batched ``MatMul`` (no block-diagonal query, so no wasted
    multiply-adds); ``mask [F + Tm]`` is added before the ``Softmax``."""
    H, KVH, D = heads
    inits, ins = _heads_graph_io(heads)
    nodes = []
    for i in range(nlayers):
        ins += [helper.make_tensor_value_info(f"Kf{i}", TensorProto.FLOAT, [KVH, D, "F"]),
                helper.make_tensor_value_info(f"Kt{i}", TensorProto.FLOAT, [KVH, dk, "Tm"]),
                helper.make_tensor_value_info(f"V{i}", TensorProto.FLOAT, [KVH, "T", D]),
                helper.make_tensor_value_info(f"sel{i}", TensorProto.FLOAT, [KVH, D, dk])]
        p = f"l{i}_"
        nodes += _heads_query(i, p)
        nodes += [helper.make_node("MatMul", [p + "qk", f"Kt{i}"], [p + "sm"]),
                  helper.make_node("Concat", [p + "sf", p + "sm"], [p + "s0"], axis=2),
                  helper.make_node("Add", [p + "s0", "mask"], [p + "s"]),
                  helper.make_node("Softmax", [p + "s"], [p + "p"], axis=2),
                  helper.make_node("MatMul", [p + "p", f"V{i}"], [p + "o"]),
                  helper.make_node("Reshape", [p + "o", "s_out"], [f"q{i + 1}"])]
    outs = [helper.make_tensor_value_info(f"q{nlayers}", TensorProto.FLOAT, [1, 1, H * D])]
    return _session(nodes, ins, outs, inits, threads)


def leank_heads_inputs(K: np.ndarray, V: np.ndarray, keep: np.ndarray, full: int, i: int = 0,
                       heads=(9, 3, 64)) -> dict:
    """Layer ``i``'s :func:`leank_heads_session` inputs from a time-major cache ``K, V
    [T, kv*D]`` (the ``full`` rows first) and ``keep [kv*dk]``."""
    H, KVH, D = heads
    T = K.shape[0]
    dk = len(keep) // KVH
    kh = K.reshape(T, KVH, D)
    sel = np.zeros((KVH, D, dk), np.float32)
    for k in range(KVH):
        sel[k, keep[k * dk:(k + 1) * dk] - k * D, np.arange(dk)] = 1
    km = np.stack([K[full:, keep[k * dk:(k + 1) * dk]].T for k in range(KVH)])
    return {f"Kf{i}": np.ascontiguousarray(kh[:full].transpose(1, 2, 0)), f"Kt{i}": np.ascontiguousarray(km),
            f"V{i}": np.ascontiguousarray(V.reshape(T, KVH, D).transpose(1, 0, 2)), f"sel{i}": sel}


def leank_int8_session(nlayers: int, threads: int, dk: int, heads=(9, 3, 64)):
    """:func:`leank_heads_session` with the middle in int8 (docs/kv-cache.md, "LeanK at long
    contexts", item 2): ``Kq{i} [kv, dk, Tm]`` and ``Vq{i} [kv, Tm, D]`` symmetric int8 with
    per-channel scales (the key scales folded into ``sel{i}``, the value scales ``vs{i}
    [kv, 1, D]``), read by ``MatMulInteger`` against the query's and the middle
    probabilities' ``DynamicQuantizeLinear`` (uint8, one scale each); the sink + window part
    stays float32 (``Kf{i} [kv, D, F]``, ``Vf{i} [kv, F, D]``). The only form built from
    standard operators that reads int8 bytes without first writing a float copy; its
    uint8 probabilities lose the small ones (the error is reported, the time is the point)."""
    H, KVH, D = heads
    inits, ins = _heads_graph_io(heads)
    nodes = []
    for i in range(nlayers):
        ins += [helper.make_tensor_value_info(f"Kf{i}", TensorProto.FLOAT, [KVH, D, "F"]),
                helper.make_tensor_value_info(f"Vf{i}", TensorProto.FLOAT, [KVH, "F", D]),
                helper.make_tensor_value_info(f"Kq{i}", TensorProto.INT8, [KVH, dk, "Tm"]),
                helper.make_tensor_value_info(f"Vq{i}", TensorProto.INT8, [KVH, "Tm", D]),
                helper.make_tensor_value_info(f"sel{i}", TensorProto.FLOAT, [KVH, D, dk]),
                helper.make_tensor_value_info(f"vs{i}", TensorProto.FLOAT, [KVH, 1, D])]
        p = f"l{i}_"
        nodes += _heads_query(i, p)
        nodes += [helper.make_node("DynamicQuantizeLinear", [p + "qk"], [p + "qu", p + "qs", p + "qz"]),
                  helper.make_node("MatMulInteger", [p + "qu", f"Kq{i}", p + "qz"], [p + "smi"]),
                  helper.make_node("Cast", [p + "smi"], [p + "smf"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", [p + "smf", p + "qs"], [p + "sm"]),
                  helper.make_node("Concat", [p + "sf", p + "sm"], [p + "s0"], axis=2),
                  helper.make_node("Add", [p + "s0", "mask"], [p + "s"]),
                  helper.make_node("Softmax", [p + "s"], [p + "p"], axis=2),
                  helper.make_node("Shape", [f"Kf{i}"], [p + "nf"], start=2, end=3),
                  helper.make_node("Shape", [f"Kq{i}"], [p + "nm"], start=2, end=3),
                  helper.make_node("Concat", [p + "nf", p + "nm"], [p + "split"], axis=0),
                  helper.make_node("Split", [p + "p", p + "split"], [p + "pf", p + "pm"], axis=2),
                  helper.make_node("MatMul", [p + "pf", f"Vf{i}"], [p + "of"]),
                  helper.make_node("DynamicQuantizeLinear", [p + "pm"], [p + "pu", p + "ps", p + "pz"]),
                  helper.make_node("MatMulInteger", [p + "pu", f"Vq{i}", p + "pz"], [p + "omi"]),
                  helper.make_node("Cast", [p + "omi"], [p + "omf"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", [p + "omf", p + "ps"], [p + "om1"]),
                  helper.make_node("Mul", [p + "om1", f"vs{i}"], [p + "om"]),
                  helper.make_node("Add", [p + "of", p + "om"], [p + "o"]),
                  helper.make_node("Reshape", [p + "o", "s_out"], [f"q{i + 1}"])]
    outs = [helper.make_tensor_value_info(f"q{nlayers}", TensorProto.FLOAT, [1, 1, H * D])]
    return _session(nodes, ins, outs, inits, threads)


def leank_int8_inputs(K: np.ndarray, V: np.ndarray, keep: np.ndarray, full: int, i: int = 0,
                      heads=(9, 3, 64)) -> dict:
    """Layer ``i``'s :func:`leank_int8_session` inputs from a time-major cache ``K, V
    [T, kv*D]`` (the ``full`` rows first): the middle quantized symmetric int8 per channel
    (per kept key channel, per value channel of each KV head)."""
    H, KVH, D = heads
    f = leank_heads_inputs(K, V, keep, full, i, heads)
    km, vh = f.pop(f"Kt{i}"), f.pop(f"V{i}")               # [kv, dk, Tm], [kv, T, D]
    ks = np.maximum(np.abs(km).max(axis=2, keepdims=True), 1e-8) / 127     # [kv, dk, 1]
    vm = vh[:, full:]
    vs = np.maximum(np.abs(vm).max(axis=1, keepdims=True), 1e-8) / 127     # [kv, 1, D]
    f[f"sel{i}"] = f[f"sel{i}"] * ks.transpose(0, 2, 1)                    # scales folded into q
    f[f"Kq{i}"] = np.clip(np.rint(km / ks), -127, 127).astype(np.int8)
    f[f"Vq{i}"] = np.clip(np.rint(vm / vs), -127, 127).astype(np.int8)
    f[f"Vf{i}"] = np.ascontiguousarray(vh[:, :full])
    f[f"vs{i}"] = vs.astype(np.float32)
    return f


def _leank_reference(q: np.ndarray, K: np.ndarray, V: np.ndarray, keep: np.ndarray, full: int,
                     heads=(9, 3, 64)) -> np.ndarray:
    """LeanK's attention in numpy over an unpruned cache ``K, V [T, kv*D]`` (tokens in the
    buffer's order: the ``full`` sink + window rows first): the first ``full`` keys score with
    all channels, the rest with the ``keep [kv*dk]`` rows only."""
    H, KVH, D = heads
    G = H // KVH
    kept = np.zeros(KVH * D, bool)
    kept[keep] = True
    out = np.empty((H, D), np.float64)
    for h in range(H):
        k = h // G
        sl = slice(k * D, (k + 1) * D)
        qh = q[h * D:(h + 1) * D].astype(np.float64)
        s_f = K[:full, sl].astype(np.float64) @ qh
        s_m = K[full:, sl].astype(np.float64) @ (qh * kept[sl])
        s = np.concatenate([s_f, s_m]) / math.sqrt(D)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ V[:, sl]
    return out.reshape(-1)


def leank_keep(dk: int, heads=(9, 3, 64), seed: int = 3) -> np.ndarray:
    """``dk`` channel rows of each KV head's key, ascending (``[kv*dk]`` into ``[kv*D]``)."""
    H, KVH, D = heads
    rng = np.random.default_rng(seed)
    return np.concatenate([k * D + np.sort(rng.choice(D, dk, replace=False)) for k in range(KVH)]).astype(np.int64)


def attention_ceiling(contexts, threads: int, calls: int, repeat: int, rec, nlayers: int = 30,
                      leank_dk: int | None = None, leank_full: int = 512) -> None:
    """The ``--attention`` figures for one thread count (module docstring); with
    ``leank_dk``, also the three LeanK forms (:func:`leank_session`,
    :func:`leank_heads_session`, :func:`leank_int8_session`; ``dk`` kept key channels per KV
    head, ``leank_full`` sink + window tokens) at every context longer than ``leank_full``."""
    rng = np.random.default_rng(2)
    L = max(contexts) + 1
    gqa, (H, KVH, D) = gqa_session(nlayers, L, threads)
    kv = [rng.standard_normal((1, KVH, L, D)).astype(np.float32) for _ in range(2 * nlayers)]
    qkv = rng.standard_normal((1, 1, (H + 2 * KVH) * D)).astype(np.float32)
    outs = [np.zeros((1, 1, H * D), np.float32) for _ in range(nlayers)]
    blk = blockgemm_session(nlayers, threads)
    one = blockgemm_session(1, threads)       # one block, checked against numpy at each length
    tm = [rng.standard_normal((L, KVH * D)).astype(np.float32) for _ in range(2 * nlayers)]
    q0 = (rng.standard_normal((1, 1, H * D)) * 0.5).astype(np.float32)
    if leank_dk:
        lk = leank_session(nlayers, threads, leank_dk)
        lk_one = leank_session(1, threads, leank_dk)
        lkh = leank_heads_session(nlayers, threads, leank_dk)
        lkh_one = leank_heads_session(1, threads, leank_dk)
        lk8 = leank_int8_session(nlayers, threads, leank_dk)
        lk8_one = leank_int8_session(1, threads, leank_dk)
        keep = leank_keep(leank_dk)
        kmid = [np.ascontiguousarray(tm[2 * i][leank_full:, keep]) for i in range(nlayers)]
    print(f"{'attention, ' + str(nlayers) + ' layers':<26}{'KV MiB':>8}{'GQA ms':>9}{'1-GEMM ms':>11}"
          f"{'read floor ms':>15}{'GQA GB/s':>10}" + (f"{'LeanK ms':>10}{'head-major':>12}{'int8 mid':>10}{'LeanK MiB':>11}{'int8 MiB':>10}" if leank_dk else ""))
    for ctx in contexts:
        bd = gqa_binding(gqa, qkv, kv, outs, ctx)
        n = max(5, calls // 10)
        t_gqa = _best_median(lambda: gqa.run_with_iobinding(bd), n, repeat)
        bb = blk.io_binding()
        bb.bind_cpu_input("q0", q0)
        for i in range(nlayers):      # zero-copy prefixes of the preallocated buffers
            bb.bind_ortvalue_input(f"K{i}", ort.OrtValue.ortvalue_from_numpy(tm[2 * i][:ctx]))
            bb.bind_ortvalue_input(f"V{i}", ort.OrtValue.ortvalue_from_numpy(tm[2 * i + 1][:ctx]))
        bb.bind_output(f"q{nlayers}", "cpu")
        blk.run_with_iobinding(bb)
        got = one.run(None, {"q0": q0, "K0": tm[0][:ctx], "V0": tm[1][:ctx]})[0].reshape(-1)
        err = float(np.abs(got - _attention_reference(q0.reshape(-1), tm[0][:ctx], tm[1][:ctx])).max())
        if err > 1e-4:
            raise RuntimeError(f"the one-GEMM attention differs from the reference by {err:.2e} at {ctx} tokens")
        t_blk = _best_median(lambda: blk.run_with_iobinding(bb), n, repeat)
        views = [a[:ctx] for a in tm]
        t_read = _best_median(lambda: [float(v.sum()) for v in views], n, repeat)
        nbytes = 2 * nlayers * ctx * KVH * D * 4
        case = f"attention_ctx{ctx}/t{threads}"
        rec(case, "kv_mib", nbytes / 2 ** 20)
        rec(case, "gqa_ms", t_gqa * 1e3)
        rec(case, "one_gemm_ms", t_blk * 1e3)
        rec(case, "kv_read_floor_ms", t_read * 1e3)
        rec(case, "gqa_gb_s", nbytes / t_gqa / 1e9)
        rec(case, "one_gemm_max_abs_err", err)
        line = (f"{'ctx ' + str(ctx):<26}{nbytes / 2 ** 20:>8.1f}{t_gqa * 1e3:>9.2f}{t_blk * 1e3:>11.2f}"
                f"{t_read * 1e3:>15.2f}{nbytes / t_gqa / 1e9:>10.1f}")
        if leank_dk and ctx > leank_full:
            t_lk, lk_bytes, lk_err = _leank_time(lk, lk_one, q0, tm, kmid, keep, ctx, leank_full, n, repeat)
            rec(case, "leank_ms", t_lk * 1e3)
            rec(case, "leank_kv_mib", lk_bytes / 2 ** 20)
            rec(case, "leank_vs_gqa", t_gqa / t_lk)
            rec(case, "leank_max_abs_err", lk_err)
            t_hm, hm_err = _leank_heads_time(lkh, lkh_one, q0, tm, keep, ctx, leank_full, n, repeat)
            rec(case, "leank_head_major_ms", t_hm * 1e3)
            rec(case, "leank_head_major_vs_gqa", t_gqa / t_hm)
            rec(case, "leank_head_major_max_abs_err", hm_err)
            t_i8, i8_err = _leank_heads_time(lk8, lk8_one, q0, tm, keep, ctx, leank_full, n, repeat,
                                             inputs=leank_int8_inputs, tol=5e-3)
            i8_bytes = nlayers * (2 * 4 * leank_full * KVH * D + (ctx - leank_full) * (len(keep) + KVH * D))
            rec(case, "leank_int8_ms", t_i8 * 1e3)
            rec(case, "leank_int8_vs_gqa", t_gqa / t_i8)
            rec(case, "leank_int8_kv_mib", i8_bytes / 2 ** 20)
            rec(case, "leank_int8_max_abs_err", i8_err)
            line += (f"{t_lk * 1e3:>10.2f}{t_hm * 1e3:>12.2f}{t_i8 * 1e3:>10.2f}{lk_bytes / 2 ** 20:>11.1f}"
                     f"{i8_bytes / 2 ** 20:>10.1f}")
        print(line)


def _leank_heads_time(lkh, lkh_one, q0, tm, keep, ctx: int, full: int, n: int, repeat: int,
                      inputs=None, tol: float = 1e-4):
    """``(seconds, max |error| of one block vs numpy)`` of :func:`leank_heads_session` (or,
    with ``inputs=leank_int8_inputs``, :func:`leank_int8_session`) at ``ctx`` tokens
    (buffers exactly ``ctx`` long: a chunk-grown buffer's best case)."""
    nlayers = len(tm) // 2
    common = {"q0": q0, "mask": np.zeros(ctx, np.float32)}
    layers = [(inputs or leank_heads_inputs)(tm[2 * i][:ctx], tm[2 * i + 1][:ctx], keep, full, i)
              for i in range(nlayers)]
    bd = lkh.io_binding()
    for k, v in common.items():
        bd.bind_cpu_input(k, v)
    for feed in layers:
        for k, v in feed.items():
            bd.bind_cpu_input(k, v)
    bd.bind_output(f"q{nlayers}", "cpu")
    lkh.run_with_iobinding(bd)
    got = lkh_one.run(None, {**common, **layers[0]})[0].reshape(-1)
    err = _leank_check(got, q0, tm, keep, ctx, full, tol, "head-major LeanK")
    return _best_median(lambda: lkh.run_with_iobinding(bd), n, repeat), err


def _leank_check(got: np.ndarray, q0, tm, keep, ctx: int, full: int, tol: float, what: str) -> float:
    """Max |error| of one block's output ``got`` against :func:`_leank_reference` on layer
    0's cache; raises ``RuntimeError`` above ``tol`` (a candidate is timed only if right)."""
    err = float(np.abs(got - _leank_reference(q0.reshape(-1), tm[0][:ctx], tm[1][:ctx], keep, full)).max())
    if err > tol:
        raise RuntimeError(f"the {what} attention differs from the reference by {err:.2e} at {ctx} tokens")
    return err


def _leank_time(lk, lk_one, q0, tm, kmid, keep, ctx: int, full: int, n: int, repeat: int):
    """``(seconds, K + V bytes read, max |error| of one block vs numpy)`` of
    :func:`leank_session` at ``ctx`` tokens, every buffer a zero-copy prefix."""
    nlayers = len(kmid)
    bind = lambda a: ort.OrtValue.ortvalue_from_numpy(a)  # noqa: E731
    bd = lk.io_binding()
    bd.bind_cpu_input("q0", q0)
    for i in range(nlayers):
        bd.bind_ortvalue_input(f"Kf{i}", bind(tm[2 * i][:full]))
        bd.bind_ortvalue_input(f"Km{i}", bind(kmid[i][:ctx - full]))
        bd.bind_ortvalue_input(f"V{i}", bind(tm[2 * i + 1][:ctx]))
        bd.bind_cpu_input(f"keep{i}", keep)
    bd.bind_output(f"q{nlayers}", "cpu")
    lk.run_with_iobinding(bd)
    got = lk_one.run(None, {"q0": q0, "Kf0": tm[0][:full], "Km0": kmid[0][:ctx - full],
                            "V0": tm[1][:ctx], "keep0": keep})[0].reshape(-1)
    err = _leank_check(got, q0, tm, keep, ctx, full, 1e-4, "LeanK")
    t = _best_median(lambda: lk.run_with_iobinding(bd), n, repeat)
    width = tm[0].shape[1]
    nbytes = nlayers * 4 * (full * width + (ctx - full) * len(keep) + ctx * width)
    return t, nbytes, err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(ap, "fewer calls per figure (~1 min)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--repeat", type=int, default=None, help="medians per figure (default 5, quick 2)")
    ap.add_argument("--attention", action="store_true",
                    help="only the long-context attention figures (module docstring)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096],
                    help="cached tokens for --attention")
    ap.add_argument("--leank-keep", type=float, default=None,
                    help="with --attention: also LeanK at speed keeping this share of key channels")
    ap.add_argument("--leank-full", type=int, default=512, help="LeanK's sink + window tokens")
    a = ap.parse_args(argv)
    repeat = a.repeat or (2 if a.quick else 5)
    calls = 30 if a.quick else 100
    records = []

    def rec(case, metric, value):
        records.append(benchlib.record(case, metric, value))

    rng = np.random.default_rng(1)
    print(f"onnxruntime {ort.__version__}; best of {repeat} medians of {calls} calls")
    if a.attention:
        for t in a.threads:
            print(f"\n{t} thread(s)")
            attention_ceiling(a.contexts, t, calls, repeat, rec,
                              leank_dk=round(a.leank_keep * 64) if a.leank_keep else None,
                              leank_full=a.leank_full)
        if a.json:
            benchlib.write_records(a.json, records)
        return 0
    for t in a.threads:
        tiny, _ = matmulnbits(64, 16, 4, True, t)
        x64 = rng.standard_normal((1, 64)).astype(np.float32)
        overhead = _best_median(lambda: tiny.run(None, {"A": x64}), 5 * calls, repeat)
        rec(f"session_run_call/t{t}", "call_overhead_us", overhead * 1e6)
        print(f"\n{t} thread(s): session.run overhead {overhead * 1e6:.1f} us per call (subtracted from hot)")
        print(f"{'MatMulNBits M=1':<34}{'hot us':>9}{'G w/s':>8}{'GB/s':>7}{'cold us':>10}{'GB/s':>7}")
        for name, (K, N) in SHAPES.items():
            variants = [(4, True), (4, False)] + ([(8, True)] if name == "head" else [])
            for bits, zp in variants:
                sess, nbytes = matmulnbits(K, N, bits, zp, t)
                x = rng.standard_normal((1, K)).astype(np.float32)
                hot = max(_best_median(lambda: sess.run(None, {"A": x}), calls if N < 10000 else 10,
                                       repeat) - overhead, 1e-9)
                ncold = 1 if N >= 10000 else 30
                copies = [sess] if ncold == 1 else [matmulnbits(K, N, bits, zp, t, seed=s)[0]
                                                    for s in range(ncold)]

                def cold_pass():
                    for c in copies:
                        c.run(None, {"A": x})
                cold = max((_best_median(cold_pass, max(3, calls // 10), repeat) / ncold) - overhead, 1e-9)
                case = f"{name}_{K}x{N}_int{bits}_{'asym' if zp else 'sym'}/t{t}"
                rec(case, "hot_us", hot * 1e6)
                rec(case, "hot_gweights_s", K * N / hot / 1e9)
                rec(case, "cold_us", cold * 1e6)
                rec(case, "cold_gb_s", nbytes / cold / 1e9)
                print(f"{case:<34}{hot * 1e6:>9.1f}{K * N / hot / 1e9:>8.1f}{nbytes / hot / 1e9:>7.1f}"
                      f"{cold * 1e6:>10.1f}{nbytes / cold / 1e9:>7.1f}")
        n, L = 30, 320
        sess, (H, KVH, D) = gqa_session(n, L, t)
        kv = [rng.standard_normal((1, KVH, L, D)).astype(np.float32) for _ in range(2 * n)]
        qkv = rng.standard_normal((1, 1, (H + 2 * KVH) * D)).astype(np.float32)
        outs = [np.zeros((1, 1, H * D), np.float32) for _ in range(n)]
        print(f"{'GroupQueryAttention (9 q / 3 kv heads)':<40}{'us per call':>12}")
        for ctx in (16, 190, 290):
            bd = gqa_binding(sess, qkv, kv, outs, ctx)
            per = _best_median(lambda: sess.run_with_iobinding(bd), max(5, calls // 5), repeat) / n
            rec(f"gqa_ctx{ctx}/t{t}", "per_call_us", per * 1e6)
            print(f"{'ctx ' + str(ctx):<40}{per * 1e6:>12.1f}")
    if a.json:
        benchlib.write_records(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
