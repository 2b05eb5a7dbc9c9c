"""Two-stage ``lm_head`` on SmolLM2-135M: an int4 pass over the vocabulary, then the K best
candidates rescored with the 8-bit rows. Measured and *rejected* as a default (README,
"Where the 1-thread decode gap to llama.cpp is"); this script reproduces both sides.
It also scores a *split* head (the ``hot`` rows with the most calibration probability
mass kept 8-bit, the rest int4), rejected likewise.

* **speed**: one-node-chain ONNX graphs of the head alone, random codes, SmolLM2's shape
  (``576 -> 49,152``): the shipped 8-bit ``MatMulNBits`` (block 64, asymmetric) vs
  int4 ``MatMulNBits`` (block 64, with / without zero points) + ``TopK`` + ``Gather`` of the
  candidates' 8-bit rows + ``MatMul`` + ``ScatterElements``; median ms per call.
* **quality**: final hidden states of the compressed model on WikiText-2 test windows
  (no BOS, 512 tokens), logits from the 8-bit table (the exporter's RTN block 64) vs the
  two-stage logits (int4 table by RTN g64 asym, or GPTQ g64 asym calibrated on C4
  validation hidden states): perplexity, KL(8-bit || two-stage) in nats/token, greedy
  (argmax) agreement and the 8-bit probability mass left outside the K candidates.
  Split head (with the GPTQ table only): rows ranked by their mean softmax probability on
  the C4 calibration hidden states, the ``hot`` best kept 8-bit; same metrics, ``tail_mass``
  then being the test mass on the int4 rows.

No peer runs a two-stage head: records carry ``peer``/``theirs`` null.

Usage::

    .venv/bin/python bench/head_two_stage.py --json bench/results/head_two_stage.json
    .venv/bin/python bench/head_two_stage.py --quick      # 4 windows, K=64 only (~2 min)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

import benchlib

V, H = 49152, 576


def _head_session(two_stage: bool, K: int, zero_points: bool, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto as TP, helper, numpy_helper
    from kernel_ceiling import OPSETS

    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def init(name, arr):
        inits.append(numpy_helper.from_array(arr, name))
        return name

    nb8 = H // 64
    B8 = rng.integers(0, 256, (V, nb8, 64), dtype=np.uint8)
    S8 = (rng.random(V * nb8, dtype=np.float32) * 0.01).astype(np.float32)
    Z8 = rng.integers(0, 256, V * nb8, dtype=np.uint8)
    if not two_stage:
        nodes.append(helper.make_node("MatMulNBits", ["h", init("B8", B8), init("S8", S8), init("Z8", Z8)],
                                      ["logits"], domain="com.microsoft", K=H, N=V, bits=8,
                                      block_size=64, accuracy_level=4))
    else:
        B4 = rng.integers(0, 256, (V, nb8, 32), dtype=np.uint8)
        ins = ["h", init("B4", B4), init("S4", (rng.random(V * nb8, dtype=np.float32) * 0.01))]
        if zero_points:
            ins.append(init("Z4", rng.integers(0, 256, V * math.ceil(nb8 / 2), dtype=np.uint8)))
        nodes += [
            helper.make_node("MatMulNBits", ins, ["l4"], domain="com.microsoft", K=H, N=V, bits=4,
                             block_size=64, accuracy_level=4),
            helper.make_node("TopK", ["l4", init("k", np.array([K], np.int64))], ["tv", "ti"], axis=-1),
            helper.make_node("Gather", [init("B8", B8), "ti"], ["rows"]),
            helper.make_node("Gather", [init("S8", S8.reshape(V, nb8, 1)), "ti"], ["rs"]),
            helper.make_node("Gather", [init("Z8f", Z8.reshape(V, nb8, 1).astype(np.float32)), "ti"], ["rz"]),
            helper.make_node("Cast", ["rows"], ["rf"], to=TP.FLOAT),
            helper.make_node("Sub", ["rf", "rz"], ["rc"]),
            helper.make_node("Mul", ["rc", "rs"], ["rd"]),
            helper.make_node("Reshape", ["rd", init("s1", np.array([1, 1, K, H], np.int64))], ["rw"]),
            helper.make_node("Unsqueeze", ["h", init("ax", np.array([-1], np.int64))], ["hc"]),
            helper.make_node("MatMul", ["rw", "hc"], ["ex"]),
            helper.make_node("Reshape", ["ex", init("s2", np.array([1, 1, K], np.int64))], ["ex2"]),
            helper.make_node("ScatterElements", ["l4", "ti", "ex2"], ["logits"], axis=-1)]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("h", TP.FLOAT, [1, 1, H])],
                          [helper.make_tensor_value_info("logits", TP.FLOAT, [1, 1, V])], inits)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    return ort.InferenceSession(helper.make_model(g, opset_imports=OPSETS).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def speed(threads: int, Ks, repeat: int) -> list[tuple[str, float]]:
    from kernel_ceiling import _best_median
    h = np.random.default_rng(1).standard_normal((1, 1, H)).astype(np.float32)
    out = []
    cases = [("q8", False, 0, True)] + [(f"int4{'' if zp else '-sym'}+top{K}", True, K, zp)
                                        for K in Ks for zp in (True, False)]
    for name, two, K, zp in cases:
        s = _head_session(two, K or 64, zp, threads)
        out.append((name, _best_median(lambda: s.run(None, {"h": h}), 30, repeat) * 1e3))
    return out


def _dequant(iw) -> np.ndarray:
    c = iw.codes.astype(np.float32).reshape(iw.N, -1, iw.block_size)
    w = (c - iw.zeros.astype(np.float32)[..., None]) * iw.scales[..., None]
    return w.reshape(iw.N, -1)[:, :iw.K]


def _log_softmax(L):
    m = L.max(1, keepdims=True)
    return L - m - np.log(np.exp(L - m).sum(1, keepdims=True))


def quality(checkpoint: str, nwin: int, Ks, gptq: bool) -> list[tuple[str, str, float]]:
    import torch
    from edgeprune.calibration import build_calibration
    from edgeprune.methods.gptq import gptq_quantize
    from edgeprune.models import load_model
    from edgeprune_exporters.int4 import rtn_int

    model, tok = load_model(checkpoint)[:2]
    ids = tok(benchlib.WIKI.read_text(), add_special_tokens=False)["input_ids"]
    wins = [ids[i * 512:(i + 1) * 512] for i in range(nwin)]

    def hidden(batch):
        with torch.no_grad():
            return [model.model(torch.tensor(w)[None]).last_hidden_state[0].float() for w in batch]

    hs = hidden(wins)
    h = np.concatenate([x[:-1].numpy() for x in hs])
    tgt = np.concatenate([np.array(w[1:]) for w in wins])
    W = model.model.embed_tokens.weight.detach().float()
    L8 = h @ _dequant(rtn_int(W.numpy(), 8, 64)).T
    P8 = _log_softmax(L8)
    n8 = -P8[np.arange(len(h)), tgt]
    p8 = np.exp(P8)
    rows = [("q8", "ppl", float(np.exp(n8.mean())))]
    tables = {"rtn": _dequant(rtn_int(W.numpy(), 4, 64))}
    if gptq:
        cal = build_calibration(tok, str(benchlib.C4), nsamples=16, seqlen=512).input_ids
        X = torch.cat(hidden(cal.tolist()))
        q, _ = gptq_quantize(W, X.T @ X / len(X), bits=4, group_size=64, act_order=True, static_groups=True)
        tables["gptq"] = q.dequantize().float().numpy()
    r = np.arange(len(h))[:, None]
    rows += _split_rows(h, tgt, L8, P8, p8, tables, X if gptq else None, W)
    for name, W4 in tables.items():
        L4 = h @ W4.T
        rows.append((f"int4-{name}-alone", "ppl", float(np.exp((-_log_softmax(L4)[np.arange(len(h)), tgt]).mean()))))
        for K in Ks:
            top = np.argpartition(-L4, K, axis=1)[:, :K]
            L = L4.copy()
            L[r, top] = L8[r, top]
            P = _log_softmax(L)
            case = f"two-stage-{name}-top{K}"
            rows += [(case, "ppl", float(np.exp((-P[np.arange(len(h)), tgt]).mean()))),
                     (case, "kl_nats", float((p8 * (P8 - P)).sum(1).mean())),
                     (case, "argmax_agreement", float((L.argmax(1) == L8.argmax(1)).mean())),
                     (case, "tail_mass", float((1 - p8[r, top].sum(1)).mean()))]
    return rows


def _split_rows(h, tgt, L8, P8, p8, tables, X, W, hots=(4096, 16384)):
    """Split-head cases: the ``hot`` rows with the most calibration mass from the 8-bit
    table, the others from the int4 table (``X``: calibration hidden states ``[n, H]``)."""
    if X is None:
        return []
    from edgeprune_exporters.int4 import rtn_int
    W8 = _dequant(rtn_int(W.numpy(), 8, 64))
    mass = np.exp(_log_softmax(X.numpy() @ W8.T)).mean(0)     # [V] mean probability
    order, out = np.argsort(-mass), []
    for name, W4 in tables.items():
        L4 = h @ W4.T
        for hot in hots:
            L = L4.copy()
            L[:, order[:hot]] = L8[:, order[:hot]]
            P = _log_softmax(L)
            case = f"split-{name}-hot{hot}"
            out += [(case, "ppl", float(np.exp((-P[np.arange(len(h)), tgt]).mean()))),
                    (case, "kl_nats", float((p8 * (P8 - P)).sum(1).mean())),
                    (case, "argmax_agreement", float((L.argmax(1) == L8.argmax(1)).mean())),
                    (case, "tail_mass", float(1 - p8[:, order[:hot]].sum(1).mean()))]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(ap, "4 windows, K=64, no GPTQ table (~2 min)")
    ap.add_argument("--checkpoint", default=str(benchlib.ROOT / "runs" / "demo" / "checkpoint"),
                    help="compressed checkpoint whose hidden states feed the head (default: the "
                         "one `make demo` writes; falls back to the dense model)")
    ap.add_argument("--windows", type=int, default=None, help="WikiText-2 windows (10; quick 4)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args(argv)
    Ks = [64] if a.quick else [32, 64, 128]
    ck = a.checkpoint if Path(a.checkpoint).is_dir() else "smollm2-135m"
    t0 = time.perf_counter()
    records = []
    print(f"{'case':<28}{'metric':<18}{'value':>10}")
    for t in a.threads:
        for name, ms in speed(t, Ks, 2 if a.quick else 3):
            records.append(benchlib.record(f"head-{name}/t{t}", "ms_per_call", ms))
            print(f"{'head-' + name + '/t' + str(t):<28}{'ms_per_call':<18}{ms:>10.3f}")
    for case, metric, v in quality(ck, a.windows or (4 if a.quick else 10), Ks, not a.quick):
        records.append(benchlib.record(case, metric, v))
        print(f"{case:<28}{metric:<18}{v:>10.4f}")
    print(f"hidden states from {ck}; {time.perf_counter() - t0:.0f} s")
    if a.json:
        benchlib.write_records(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
