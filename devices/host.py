"""Measuring this machine: DRAM copy bandwidth and onnxruntime GEMM throughput.

The host profile's ``"measure"`` figures come from here (:func:`measure_host`); the
roofline projection (:mod:`devices.roofline`) divides by them.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MiB = 1024 * 1024


def measure_bandwidth(threads: int = 1, size_mb: int = 128, repeat: int = 5) -> float:
    """Memory copy bandwidth of this machine, GB/s (1e9 bytes/s), best of ``repeat``.

    Each of ``threads`` threads copies its own slice of a ``size_mb`` MiB float32
    buffer with ``numpy.copyto`` (which releases the GIL); bytes moved count the read
    and the write (2 x size), as STREAM's "Copy" kernel does (McCalpin 1995).
    The buffer is much larger than any cache, so this is DRAM bandwidth.
    """
    threads = max(1, int(threads))
    n = size_mb * MiB // 4
    src = np.ones(n, dtype=np.float32)
    dst = np.empty_like(src)
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)
    slices = [(slice(bounds[i], bounds[i + 1])) for i in range(threads)]

    def _copy(s):
        np.copyto(dst[s], src[s])

    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(_copy, slices))  # warm-up: page faults
        for _ in range(repeat):
            t0 = time.perf_counter()
            list(ex.map(_copy, slices))
            best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def _measure_fp32_gflops(threads: int, n: int = 768, repeat: int = 5) -> float:
    """fp32 GEMM throughput through onnxruntime (MatMul, ``threads`` intra-op threads)."""
    x = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    sess = _ort_matmul_session("MatMul", "float", n, threads)
    return _time_session(sess, {"A": x, "B": x}, 2 * n ** 3, repeat)


def _measure_int8_gops(threads: int, n: int = 768, repeat: int = 5) -> float:
    """int8 GEMM throughput through onnxruntime (MatMulInteger u8 x s8 -> s32)."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 255, (n, n), dtype=np.uint8)
    b = rng.integers(-127, 127, (n, n), dtype=np.int8)
    sess = _ort_matmul_session("MatMulInteger", "int8", n, threads)
    return _time_session(sess, {"A": a, "B": b}, 2 * n ** 3, repeat)


def _ort_matmul_session(op: str, kind: str, n: int, threads: int):
    """An onnxruntime session of one ``[n, n] x [n, n]`` ``op`` (``kind`` float or int8)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    ta = TensorProto.FLOAT if kind == "float" else TensorProto.UINT8
    tb = TensorProto.FLOAT if kind == "float" else TensorProto.INT8
    to = TensorProto.FLOAT if kind == "float" else TensorProto.INT32
    g = helper.make_graph([helper.make_node(op, ["A", "B"], ["Y"])], "mm",
                          [helper.make_tensor_value_info("A", ta, [n, n]), helper.make_tensor_value_info("B", tb, [n, n])],
                          [helper.make_tensor_value_info("Y", to, [n, n])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _time_session(sess, feeds, ops, repeat) -> float:
    """Best-of-``repeat`` throughput of ``sess`` on ``feeds``, 1e9 ``ops`` per second."""
    sess.run(None, feeds)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        best = min(best, time.perf_counter() - t0)
    return ops / best / 1e9


@functools.lru_cache(maxsize=8)
def measure_host(threads: int) -> dict[str, float]:
    """Measure this machine: DRAM copy bandwidth (GB/s) and onnxruntime GEMM peaks.

    Returns ``{"bandwidth_gbs", "peak_fp32_gflops", "peak_int8_gops", "threads", "seconds"}``.
    Cached per thread count for the life of the process. Figures are noisy on a
    shared machine: they are the best of a few repeats.
    """
    t0 = time.perf_counter()
    out: dict[str, float] = {"threads": threads, "bandwidth_gbs": measure_bandwidth(threads)}
    try:
        out["peak_fp32_gflops"] = _measure_fp32_gflops(threads)
        out["peak_int8_gops"] = _measure_int8_gops(threads)
    except ImportError:  # onnx missing: fall back to numpy's BLAS for fp32, no int8 figure
        n = 768
        x = np.ones((n, n), np.float32)
        x @ x
        t1 = time.perf_counter()
        x @ x
        out["peak_fp32_gflops"] = 2 * n ** 3 / (time.perf_counter() - t1) / 1e9
        out["peak_int8_gops"] = out["peak_fp32_gflops"]
    out["seconds"] = time.perf_counter() - t0
    return out


__all__ = ["measure_bandwidth", "measure_host"]
