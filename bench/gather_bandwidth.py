"""How fast can a decode step read *scattered* MLP weight rows? The ceiling on COUNTDOWN's speed-up.

COUNTDOWN (Cheon et al., EMNLP 2025) skips, per token, the MLP units whose coefficient
is negligible, so a decode step reads only the kept rows of ``W_gate``/``W_up`` and the
kept columns of ``W_down`` (``exporters/countdown.py`` stores all three as ``[I, H]`` rows
and gathers them). The speed-up that buys depends on how fast the machine reads
*scattered* rows compared with streaming a whole matrix. This script measures both on
SmolLM2-135M's MLP shape (``I = 1536`` rows of ``H = 576`` float32, 30 layers, so the
working set, 106 MB, is far larger than the caches):

* ``dense``: ONNX Runtime ``MatMul`` ``x [1, H] @ W [H, I]`` (the unfiltered export's
  decode MLP matrix);
* ``gather``: ONNX Runtime ``Gather`` of a fraction ``keep`` of the rows (sorted random
  indices, as ``NonZero`` yields them) of ``W [I, H]`` -- what the sparse path pays
  before its small ``Gemm``;
* ``gather+gemm``: the same followed by the ``Gemm`` on the gathered rows;
* ``numpy_take``: ``numpy.take`` of the same rows (a second, independent copy routine).

Case ``keep-0.3`` is D-COUNTDOWN at 70 % act-sparsity. Records (``--json PATH``):
``us_per_layer`` per method and ``ratio_to_dense`` (time of the sparse read over the
dense matrix; 0.3 would be a bandwidth-proportional saving). No peer: ``peer``/``theirs``
null. Finishes in well under a minute (``--quick`` is the same run with fewer repeats).

    .venv/bin/python bench/gather_bandwidth.py --json bench/results/gather_bandwidth.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import benchlib

L, I, H = 30, 1536, 576


def _session(nodes, inits, inputs, outputs, threads):
    import onnxruntime as ort
    from onnx import helper, numpy_helper
    g = helper.make_graph(nodes, "g", inputs, outputs,
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _time(fns: dict, reps: int, rounds: int = 5) -> dict:
    """Median over ``rounds`` interleaved rounds (every method once per round, so a busy
    spell on the shared machine hits all of them) of microseconds per layer."""
    import statistics
    for fn in fns.values():
        for _ in range(3):
            fn()
    got = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            got[k].append((time.perf_counter() - t) / reps / L * 1e6)
    return {k: statistics.median(v) for k, v in got.items()}


def measure(keep: float, threads: int, reps: int, seed: int = 0) -> dict:
    """Microseconds per layer (one ``[I, H]`` float32 matrix) for each read pattern."""
    from onnx import TensorProto, helper
    rng = np.random.RandomState(seed)
    k = max(1, int(round(keep * I)))
    idx = np.sort(rng.choice(I, k, replace=False)).astype(np.int64)
    x = rng.randn(1, H).astype(np.float32)
    vi = helper.make_tensor_value_info
    outs = [vi(f"y{i}", TensorProto.FLOAT, None) for i in range(L)]
    w_t = {f"w{i}": rng.randn(H, I).astype(np.float32) for i in range(L)}
    sd = _session([helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(L)],
                  w_t, [vi("x", TensorProto.FLOAT, [1, H])], outs, threads)
    w = {f"w{i}": rng.randn(I, H).astype(np.float32) for i in range(L)}
    sg = _session([helper.make_node("Gather", [f"w{i}", "idx"], [f"y{i}"], axis=0) for i in range(L)],
                  w, [vi("idx", TensorProto.INT64, [k])], outs, threads)
    nodes = []
    for i in range(L):
        nodes += [helper.make_node("Gather", [f"w{i}", "idx"], [f"g{i}"], axis=0),
                  helper.make_node("Gemm", ["x", f"g{i}"], [f"y{i}"], transB=1)]
    sgg = _session(nodes, w, [vi("idx", TensorProto.INT64, [k]), vi("x", TensorProto.FLOAT, [1, H])],
                   outs, threads)
    mats = list(w.values())
    out = np.empty((k, H), np.float32)
    return _time({"dense": lambda: sd.run(None, {"x": x}),
                  "gather": lambda: sg.run(None, {"idx": idx}),
                  "gather+gemm": lambda: sgg.run(None, {"idx": idx, "x": x}),
                  "numpy_take": lambda: [np.take(m, idx, axis=0, out=out) for m in mats]}, reps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "fewer repeats (under a minute)")
    ap.add_argument("--keep", default="0.1,0.3,0.5", help="fractions of rows read")
    ap.add_argument("--threads", default="1,2")
    a = ap.parse_args(argv)
    reps = 4 if a.quick else 10
    records = []
    print(f"{'case':14s}{'method':>14s}{'us/layer':>10s}{'vs dense':>10s}")
    for t in [int(v) for v in a.threads.split(",")]:
        for keep in [float(v) for v in a.keep.split(",")]:
            r = measure(keep, t, reps)
            case = f"keep-{keep:g}-t{t}"
            for m, us in r.items():
                ratio = us / r["dense"]
                records.append(benchlib.record(case, f"{m}_us_per_layer", us))
                if m != "dense":
                    records.append(benchlib.record(case, f"{m}_ratio_to_dense", ratio))
                print(f"{case:14s}{m:>14s}{us:10.1f}{ratio:10.2f}")
    if a.json:
        benchlib.write_records(a.json, records)
    return records


if __name__ == "__main__":
    main()
