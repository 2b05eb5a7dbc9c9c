"""LeanK key-channel pruning on SmolLM2-135M-Instruct: budget sweep, learned vs magnitude.

For keep ratios 1.0 / 0.5 / 0.3 / 0.2 and both masks (``learned``: LeanK two-stage
training, ``magnitude``: ||q||*||k|| baseline), with the default sink / window
(``edgeprune.leank.DEFAULT_SINK`` / ``DEFAULT_WINDOW``):

* ``k_cache_fraction``: pruned-middle K-cache bytes / dense K-cache bytes, as reported by
  the ONNX runtime from the exported graph's cache shapes (``LeanKSession.kv_cache_bytes``);
  ``k_cache_total_fraction`` / ``kv_total_fraction`` at context 2,048 (sink + window
  included);
* ``ppl`` and ``ppl_increase_pct``: WikiText-2 test, first ``--nwindows`` windows of
  2,048 tokens (no BOS), computed with the exact torch reference of the LeanK cache
  (``edgeprune.leank.apply_reference``; the ONNX graph is tested equal to it); ``ppl_512``
  at 512-token windows (where sink + window leave nothing pruned);
* ``ppl_stress``: the same with sink = window = 0 (every past key pruned);
* ``retrieval_acc``: exact match of the greedy answer for a planted "secret code" fact at
  depths 0..100% of ~2,000 tokens of WikiText-2 text (``--trials``);
* ``decode_tok_s_2048``: ONNX runtime decode speed with 2,048 cached tokens (fp32 and
  int4 weights), LeanK graph vs the same graph unpruned (keep1.0) and vs the dense fused
  GQA export.

No peer tool implements LeanK-style static key-channel pruning for CPU inference, so
``peer``/``theirs`` are null. Learned masks are cached under ``bench/.cache/leank/`` (JSON;
reused unless ``--fresh``, labelled ``cached`` in the output), and so are finished
evaluations (``evals.json``, keyed by mask hash + protocol; labelled ``cached``).
Timing on this shared 2-core machine is noisy (other jobs run at the same time).

Usage::

    .venv/bin/python bench/leank.py --json bench/results/leank.json
    .venv/bin/python bench/leank.py --quick --json /tmp/leank_quick.json

``--quick``: keep 1.0 / 0.3, 2 windows, 4 retrieval trials, no stress, fp32 runtime only,
any cached mask reused. With no cached mask it learns a short one first (stage 1 with 8
steps on one 2,048-token window, named so in its cache file): that, five fp32 exports
(two dense, three LeanK) with their parity checks and 2,048-token decode timings make a
first quick run on 2 cores take 10-20 minutes; later runs reuse masks, evaluations and
exports (a few minutes). A cached result is marked by a ``note`` record.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

import benchlib
from benchlib import C4, WIKI

CACHE = benchlib.CACHE / "leank"


def _log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


class EvalCache:
    """Finished evaluations on disk (JSON), keyed by a string; written atomically."""

    def __init__(self, path: Path, fresh: bool = False):
        self.path = path
        self.data = {} if fresh or not path.exists() else json.loads(path.read_text())
        self.hits: set = set()

    def get(self, key):
        if key in self.data:
            self.hits.add(key)
            return self.data[key]
        return None

    def put(self, key, value):
        if self.path.exists():      # merge: another bench process may have added results
            try:
                self.data = {**json.loads(self.path.read_text()), **self.data}
            except ValueError:
                pass
        self.data[key] = value
        from edgeprune_runtime.files import atomic_write

        atomic_write(self.path, json.dumps(self.data, indent=1))


def mask_hash(mask) -> str:
    if mask is None:
        return "dense"
    d = mask.to_dict()
    return hashlib.sha256(json.dumps([d["keep"], d["scales"]]).encode()).hexdigest()[:12]


def get_masks(model, tok, keeps, methods, args):
    """Learn (or load cached) masks; returns ``{(method, keep): (mask, cached)}``.

    Cache names carry the whole recipe (calibration windows, stage-1 steps, training
    queries, L1, loss weighting, stage-2 steps and scale bound), so a cached mask is only
    reused for the same recipe."""
    from edgeprune.calibration import build_calibration
    from edgeprune.leank import LeanKMask, learn_mask, learn_scales
    CACHE.mkdir(parents=True, exist_ok=True)
    src = None
    if args.calib == "c4":
        src = C4
    calib = build_calibration(tok, src, nsamples=args.nsamples, seqlen=args.calib_seqlen, seed=0)
    name = (f"n{args.nsamples}_s{args.calib_seqlen}_st{args.steps}_q{args.train_queries}"
            f"_l1{args.l1:g}_{args.calib}")
    stage1 = CACHE / f"stage1v2_{name}.npz"
    out = {}
    for method in methods:
        for keep in keeps:
            if keep >= 1.0:
                continue
            path = CACHE / (f"maskv2_learned_{keep:g}_{name}_ft{args.finetune_steps}"
                            f"_ms{args.max_scale:g}.json" if method == "learned" else
                            f"maskv2_magnitude_{keep:g}_n{args.nsamples}_s{args.calib_seqlen}"
                            f"_{args.calib}.json")
            if args.quick and not path.exists() and not args.fresh:
                # --quick: any cached mask of this method and budget (its meta says how)
                found = sorted(CACHE.glob(f"mask*_{method}_{keep:g}_*.json"))
                path = found[0] if found else path
            if path.exists() and not args.fresh:
                out[(method, keep)] = (LeanKMask.load(path), True)
                _log(f"mask {method} {keep:g}: cached {path.name}")
                continue
            t0 = time.time()
            kw = {}
            if method == "learned":
                if stage1.exists() and not args.fresh:
                    z = np.load(stage1, allow_pickle=False)
                    kw["scales"] = z["importance"]
                else:
                    imp, info = learn_scales(model, calib.input_ids, steps=args.steps, l1=args.l1,
                                             train_queries=args.train_queries, progress=True)
                    np.savez(stage1, importance=imp, info=json.dumps(info))
                    kw["scales"] = imp
                    _log(f"stage 1: {info}")
            m = learn_mask(model, calib.input_ids, keep, method=method, alignment=args.alignment,
                           finetune_steps=args.finetune_steps, train_queries=args.train_queries,
                           max_scale=args.max_scale, l1=args.l1, **kw)
            m.meta["calibration"] = calib.info
            m.save(path)
            out[(method, keep)] = (m, False)
            _log(f"mask {method} {keep:g}: learned in {time.time() - t0:.0f}s: {m.summary()}")
    return out


def _onnx_ppl(model, tok, mask, seqlen, nwindows, sink, window, threads):
    """Perplexity through the exported LeanK graph (fp32, onnxruntime): the same rule as
    the torch reference (``tests/unit/test_leank.py`` proves the graph equal to it), ~10x
    faster on CPU at 2,048-token windows."""
    import tempfile

    import edgeprune_exporters as exporters
    import edgeprune_runtime as runtime
    from edgeprune.evaluate import perplexity
    from edgeprune.leank import LeanKMask, kv_geometry
    L, N, KV, D = kv_geometry(model)
    with tempfile.TemporaryDirectory(prefix="leank-ppl-") as td:
        m = mask if mask is not None else LeanKMask.full(L, KV, D)
        exporters.export_onnx(model, tok, Path(td) / "m", precision="fp32", graph="fused",
                              variants=[("leank", {**m.to_dict(), "sink": sink, "window": window})],
                              max_length=seqlen, validate=False)
        sess = runtime.load(Path(td) / "m", threads=threads, max_length=seqlen)
        try:
            fn = lambda ids: torch.from_numpy(sess.logits(ids.numpy()))  # noqa: E731
            return perplexity(fn, tok, WIKI, seqlen=seqlen, nwindows=nwindows, progress=False).ppl
        finally:
            sess.close()


def eval_ppl(model, tok, mask, cache: EvalCache, seqlen, nwindows, sink, window,
             backend: str = "torch", threads: int = 2):
    from edgeprune.leank import long_perplexity
    key = f"ppl|{mask_hash(mask)}|{seqlen}x{nwindows}|s{sink}w{window}"
    hit = cache.get(key)
    if hit is not None:
        return hit, True
    t0 = time.time()
    if backend == "onnx":
        ppl = _onnx_ppl(model, tok, mask, seqlen, nwindows, sink, window, threads)
    else:
        ppl = long_perplexity(model, tok, mask, WIKI, seqlen=seqlen, nwindows=nwindows,
                              sink=sink, window=window).ppl
    val = {"ppl": ppl, "seconds": round(time.time() - t0, 1), "backend": backend}
    cache.put(key, val)
    return val, False


def eval_retrieval(model, tok, mask, cache: EvalCache, trials, sink, window, chat=False):
    from edgeprune.leank import retrieval_eval
    key = f"retr|{mask_hash(mask)}|{trials}|s{sink}w{window}|chat{int(chat)}"
    hit = cache.get(key)
    if hit is not None:
        return hit, True
    r = retrieval_eval(model, tok, mask, WIKI, n_trials=trials, sink=sink, window=window,
                       chat=chat)
    cache.put(key, r)
    return r, False


def dense_decode_speed(sess, context: int, steps: int = 16, warmup: int = 2) -> dict:
    """Decode tokens/s of a dense fused (GQA, shared KV buffer) session with ``context``
    cached tokens: the buffers are filled with random values and the row length set, so
    no 2,048-token prefill is needed (the per-step work does not depend on the values)."""
    rng = np.random.default_rng(0)
    st = sess._prefill([[1]])
    for arr in st["cache"].arrays:
        arr[...] = rng.standard_normal(arr.shape).astype(arr.dtype)
    times = []
    for s in range(warmup + steps):
        st["lens"][:] = context - 1
        t0 = time.perf_counter()
        sess._decode_step(st, np.array([1], np.int64))
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    return {"tok_s": 1.0 / med, "step_ms": med * 1e3}


def plain_decode_speed(sess, context: int, steps: int = 16, warmup: int = 2) -> dict:
    """Decode tokens/s of a dense plain-ops session (concatenated cache, standard ONNX ops)
    with ``context`` cached tokens (random cache values, mask and positions set)."""
    import onnxruntime as ort
    rng = np.random.default_rng(0)
    st = sess._prefill([[1]])
    cache = st["cache"]
    base = []
    for i in range(cache.spec.num_layers):
        pair = []
        for d in (cache.spec.key_dims[i], cache.spec.value_dims[i]):
            a = rng.standard_normal((1, cache.spec.kv_heads[i], context - 1, d)).astype(
                cache.spec.dtype)
            pair.append(ort.OrtValue.ortvalue_from_numpy(a))
        base.append(tuple(pair))
    times = []
    for s in range(warmup + steps):
        cache.values = list(base)
        st["mask"] = np.ones((1, context - 1), np.int64)
        st["pos"] = np.array([[context - 2]], np.int64)
        st["lens"][:] = context - 1
        t0 = time.perf_counter()
        sess._decode_step(st, np.array([1], np.int64))
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    return {"tok_s": 1.0 / med, "step_ms": med * 1e3}


def _export_matches(folder: Path, mask, args) -> bool:
    """Whether a cached LeanK export holds ``mask`` (keep1.0: the full mask) with this
    sink / window (a mask re-learned with another recipe must be re-exported)."""
    try:
        meta = json.loads((folder / "edgeprune.json").read_text())
    except (OSError, ValueError):
        return False
    # the record of the applied variant: "variants": {"leank": ...}, or older exports' "leank"
    lk = (meta.get("variants") or {}).get("leank") or meta.get("leank") or {}
    if (lk.get("sink"), lk.get("window")) != (args.sink, args.window):
        return False
    if mask is None:
        return lk.get("method") == "full"
    d = mask.to_dict()
    return lk.get("keep") == d["keep"] and lk.get("scales") == d["scales"]


def runtime_records(model, tok, masks, order, by_name, args, rec) -> list:
    """Export (fp32 and int4 weights) and measure K/V cache bytes and decode speed."""
    import edgeprune_exporters as exporters
    import edgeprune_runtime as runtime
    from edgeprune.leank import LeanKMask, kv_geometry
    L, N, KV, D = kv_geometry(model)
    out_root = CACHE / "exports"
    ctx = 2048
    variants = [("dense-gqa", None), ("dense-plain", None)] + [(n, by_name[n][2]) for n in order
                                       if n in ("keep1.0", "keep0.3-learned", "keep0.3-magnitude",
                                                "keep0.5-learned", "keep0.2-learned")]
    speeds: dict = {}
    for precision in ("fp32", "int4"):
        for name, mask in variants:
            if precision == "int4" and (args.quick or name not in ("dense-gqa", "keep1.0",
                                                                   "keep0.3-learned")):
                continue
            if name == "dense-plain" and precision != "fp32":
                continue
            folder = out_root / f"{name}-{precision}"
            cached = folder.exists() and not args.fresh and (
                name.startswith("dense") or _export_matches(folder, mask, args))
            if not cached:
                kw = {"graph": "plain" if name == "dense-plain" else "fused"}
                if not name.startswith("dense"):
                    m = mask if mask is not None else LeanKMask.full(L, KV, D)
                    kw = dict(variants=[("leank", {**m.to_dict(), "sink": args.sink,
                                                   "window": args.window})])
                t0 = time.time()
                r = exporters.export_onnx(model, tok, folder, precision=precision,
                                          max_length=ctx + 64, overwrite=True, **kw)
                _log(f"exported {folder.name} in {time.time() - t0:.0f}s: "
                     f"parity {r.parity.get('max_abs_logit_diff')}")
            sess = runtime.load(folder, threads=args.threads, max_length=ctx + 64)
            sp = dense_decode_speed(sess, ctx) if name == "dense-gqa" else \
                plain_decode_speed(sess, ctx) if name == "dense-plain" else \
                sess.decode_speed(ctx, steps=16)
            speeds[(name, precision)] = sp["tok_s"]
            sfx = "" if precision == "fp32" else "_int4"
            rec(name, f"decode_tok_s_{ctx}{sfx}", sp["tok_s"])
            if not name.startswith("dense") and precision == "fp32":
                b = sess.kv_cache_bytes(ctx)
                rec(name, "k_cache_fraction", b["k_middle"] / b["k_middle_dense"], cached)
                rec(name, f"k_cache_middle_bytes_{ctx}", b["k_middle"], cached)
                rec(name, f"k_cache_full_sink_window_bytes_{ctx}", b["k_full"], cached)
                rec(name, f"k_cache_total_fraction_{ctx}", b["k"] / b["k_dense"], cached)
                rec(name, f"kv_cache_total_fraction_{ctx}",
                    (b["k"] + b["v"]) / (b["k_dense"] + b["v_dense"]), cached)
            sess.close()
    for (name, precision), v in speeds.items():
        sfx = "" if precision == "fp32" else "_int4"
        if name != "keep1.0" and ("keep1.0", precision) in speeds:
            rec(name, f"decode_speedup_vs_keep1.0{sfx}", v / speeds[("keep1.0", precision)])
        if not name.startswith("dense") and ("dense-gqa", precision) in speeds:
            rec(name, f"decode_speedup_vs_dense_gqa{sfx}", v / speeds[("dense-gqa", precision)])
        if not name.startswith("dense") and ("dense-plain", precision) in speeds:
            rec(name, f"decode_speedup_vs_dense_plain{sfx}", v / speeds[("dense-plain", precision)])
    return []


def main(argv=None):
    from edgeprune.leank import DEFAULT_ALIGNMENT, DEFAULT_SINK, DEFAULT_WINDOW
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "keep 1.0/0.3 only, 2 windows, 4 retrieval trials, no stress, "
                                 "fp32 runtime only; reuses any cached mask")
    ap.add_argument("--keeps", default="1.0,0.5,0.3,0.2")
    ap.add_argument("--methods", default="learned,magnitude")
    ap.add_argument("--phases", default="masks,ppl,stress,retrieval,runtime")
    ap.add_argument("--nwindows", type=int, default=10)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--stress-nwindows", type=int, default=10)
    ap.add_argument("--order", default=None, help="comma list of kind:case jobs to run, in order")
    ap.add_argument("--sink", type=int, default=DEFAULT_SINK)
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    ap.add_argument("--alignment", type=int, default=DEFAULT_ALIGNMENT)
    ap.add_argument("--nsamples", type=int, default=4)
    ap.add_argument("--calib-seqlen", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--finetune-steps", type=int, default=10)
    ap.add_argument("--train-queries", type=int, default=384)
    ap.add_argument("--l1", type=float, default=0.05)
    ap.add_argument("--max-scale", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fresh", action="store_true", help="ignore cached masks and evaluations")
    ap.add_argument("--cached-only", action="store_true",
                    help="report finished (cached) evaluations only; run nothing new")
    ap.add_argument("--ppl-keeps", default=None, help="keeps to score (default: all)")
    ap.add_argument("--retrieval-keeps", default="1.0,0.3")
    ap.add_argument("--ppl-backend", choices=("torch", "onnx"), default="onnx",
                    help="perplexity through the exported graph (default, fast) or the torch "
                         "reference")
    ap.add_argument("--calib", default="c4",
                    help="calibration text for the masks: 'c4' (C4 validation, shared data) "
                         "or 'default' (the embedded text)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    keeps = [float(k) for k in args.keeps.split(",")]
    methods = args.methods.split(",")
    phases = set(args.phases.split(","))
    if args.quick:
        keeps = [1.0, 0.3]
        args.nwindows, args.trials = 2, 4
        args.retrieval_keeps = "1.0,0.3"
        if args.phases == ap.get_default("phases"):
            phases = {"masks", "ppl", "retrieval", "runtime"}
        if not any(CACHE.glob("stage1v2_*.npz")):
            args.steps, args.nsamples = 8, 1     # no cached stage 1: a short one (labelled)
    ppl_keeps = [float(k) for k in (args.ppl_keeps or ",".join(map(str, keeps))).split(",")]
    retr_keeps = [float(k) for k in args.retrieval_keeps.split(",")]

    from edgeprune.models import load_model
    model, tok = load_model("smollm2-135m")
    cache = EvalCache(CACHE / "evals.json", fresh=args.fresh)
    masks = get_masks(model, tok, keeps, methods, args) if "masks" in phases or True else {}
    records = []

    def rec(case, metric, val, cached=False):
        records.append(benchlib.record(case, metric, val))
        if cached:
            records.append(benchlib.note_record(case, f"{metric}: reused from bench/.cache/leank"))
        _log(f"{case:22s} {metric:28s} {val if not isinstance(val, float) else round(val, 4)}"
             f"{'  (cached)' if cached else ''}")

    def cases():
        for keep in keeps:
            for method in (["dense"] if keep >= 1.0 else methods):
                mask = None if keep >= 1.0 else masks[(method, keep)][0]
                name = f"keep{keep:g}" + ("" if keep >= 1.0 else f"-{method}")
                if keep >= 1.0:
                    name = "keep1.0"
                yield name, keep, method, mask

    # ---- evaluation jobs, most important first (each result is cached when finished)
    by_name = {name: (keep, method, mask) for name, keep, method, mask in cases()}
    jobs = []
    order = ["keep1.0", "keep0.3-learned", "keep0.3-magnitude"] + \
        [n for n in by_name if n not in ("keep1.0", "keep0.3-learned", "keep0.3-magnitude")]
    order = [n for n in order if n in by_name]
    if "ppl" in phases:
        jobs += [("ppl", n) for n in order[:3]]
    if "stress" in phases and "keep0.3-learned" in by_name:
        jobs.append(("stress", "keep0.3-learned"))
        if args.stress_nwindows != args.nwindows:
            jobs.append(("ppl_first", "keep1.0"))
    if "retrieval" in phases:
        jobs += [("retrieval", n) for n in order[:2] if by_name[n][0] in retr_keeps]
    if "stress" in phases and "keep0.3-magnitude" in by_name:
        jobs.append(("stress", "keep0.3-magnitude"))
    if "ppl" in phases:
        jobs += [("ppl", n) for n in order[3:] if by_name[n][0] in ppl_keeps]
    if "retrieval" in phases:
        jobs += [("retrieval", n) for n in order[2:] if by_name[n][0] in retr_keeps]
    if "ppl512" in phases:
        jobs += [("ppl512", n) for n in order]
    if args.order:
        jobs = [tuple(j.split(":")) for j in args.order.split(",")]
    results: dict = {}
    if args.cached_only:     # report what finished; compute nothing new
        fresh = EvalCache(CACHE / "evals.json")
        cache.data = fresh.data
    for kind, name in jobs:
        keep, method, mask = by_name[name]
        if args.cached_only:
            sw = (0, 0) if kind == "stress" else (args.sink, args.window)
            nw = args.stress_nwindows if kind in ("stress", "ppl_first") else args.nwindows
            key = (f"retr|{mask_hash(mask)}|{args.trials}|s{sw[0]}w{sw[1]}|chat0"
                   if kind == "retrieval" else
                   f"ppl|{mask_hash(mask)}|{512 if kind == 'ppl512' else 2048}x"
                   f"{40 if kind == 'ppl512' else nw}|s{sw[0]}w{sw[1]}")
            if key not in cache.data:
                _log(f"skip {kind} {name}: not computed (--cached-only)")
                continue
        if kind == "ppl":
            v, c = eval_ppl(model, tok, mask, cache, 2048, args.nwindows, args.sink, args.window,
                             args.ppl_backend, args.threads)
            results[(name, "ppl")] = (v["ppl"], c)
        elif kind == "ppl_first":
            v, c = eval_ppl(model, tok, mask, cache, 2048, args.stress_nwindows, args.sink,
                            args.window, args.ppl_backend, args.threads)
            results[(name, "ppl_first")] = (v["ppl"], c)
        elif kind == "ppl512":
            v, c = eval_ppl(model, tok, mask, cache, 512, 40, args.sink, args.window,
                            args.ppl_backend, args.threads)
            results[(name, "ppl512")] = (v["ppl"], c)
        elif kind == "stress":
            v, c = eval_ppl(model, tok, mask, cache, 2048, args.stress_nwindows, 0, 0,
                            args.ppl_backend, args.threads)
            results[(name, "stress")] = (v["ppl"], c)
        else:
            r, c = eval_retrieval(model, tok, mask, cache, args.trials, args.sink, args.window)
            results[(name, "retrieval")] = (r["accuracy"], c)
        _log(f"done {kind} {name}: {results[(name, kind)]}")
    dense_ppl = results.get(("keep1.0", "ppl"), (None,))[0]
    for name in order:
        keep, method, mask = by_name[name]
        if mask is not None:
            rec(name, "k_keep_fraction_mask", mask.fraction)
            rec(name, "v_keep_fraction_mask", mask.v_fraction())
        if (name, "ppl") in results:
            v, c = results[(name, "ppl")]
            rec(name, f"ppl_2048x{args.nwindows}", v, c)
            if dense_ppl:
                rec(name, "ppl_increase_pct", 100 * (v / dense_ppl - 1), c)
        if (name, "stress") in results:
            v, c = results[(name, "stress")]
            rec(name, f"ppl_stress_sink0_window0_2048x{args.stress_nwindows}", v, c)
            dstress = results.get(("keep1.0", "ppl_first"), (None,))[0] or \
                (dense_ppl if args.stress_nwindows == args.nwindows else None)
            if dstress:
                rec(name, f"ppl_stress_increase_pct_vs_dense_2048x{args.stress_nwindows}",
                    100 * (v / dstress - 1), c)
        if (name, "ppl512") in results:
            rec(name, "ppl_512x40", *results[(name, "ppl512")])
        if (name, "retrieval") in results:
            rec(name, f"retrieval_acc_{args.trials}trials", *results[(name, "retrieval")])
    if "runtime" in phases:
        records.extend(runtime_records(model, tok, masks, order, by_name, args, rec))
    if args.json:
        benchlib.write_records(args.json, records)
    return records


if __name__ == "__main__":
    main()
