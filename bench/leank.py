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
    .venv/bin/python bench/leank.py --quick --json /tmp/leank_quick.json   # < 10 min
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

SHARED = Path(os.environ.get("EDGEPRUNE_SHARED", ROOT.parent / "shared"))
WIKI = SHARED / "data" / "wikitext2" / "wiki.test.raw"
CACHE = ROOT / "bench" / ".cache" / "leank"


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
        self.data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def mask_hash(mask) -> str:
    if mask is None:
        return "dense"
    d = mask.to_dict()
    return hashlib.sha256(json.dumps([d["keep"], d["scales"]]).encode()).hexdigest()[:12]


def get_masks(model, tok, keeps, methods, args):
    """Learn (or load cached) masks; returns ``{(method, keep): (mask, cached)}``."""
    from edgeprune.calibration import build_calibration
    from edgeprune.leank import LeanKMask, learn_mask, learn_scales
    CACHE.mkdir(parents=True, exist_ok=True)
    calib = build_calibration(tok, nsamples=args.nsamples, seqlen=args.calib_seqlen, seed=0)
    out = {}
    stage1 = CACHE / f"stage1_n{args.nsamples}_s{args.calib_seqlen}_st{args.steps}.npz"
    for method in methods:
        for keep in keeps:
            if keep >= 1.0:
                continue
            path = CACHE / f"mask_{method}_{keep:g}_n{args.nsamples}_st{args.steps}.json"
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
                    imp, info = learn_scales(model, calib.input_ids, steps=args.steps,
                                             progress=True)
                    np.savez(stage1, importance=imp, info=json.dumps(info))
                    kw["scales"] = imp
                    _log(f"stage 1: {info}")
            m = learn_mask(model, calib.input_ids, keep, method=method, alignment=args.alignment,
                           **kw)
            m.meta["calibration"] = calib.info
            m.save(path)
            out[(method, keep)] = (m, False)
            _log(f"mask {method} {keep:g}: learned in {time.time() - t0:.0f}s: {m.summary()}")
    return out


def eval_ppl(model, tok, mask, cache: EvalCache, seqlen, nwindows, sink, window):
    from edgeprune.leank import long_perplexity
    key = f"ppl|{mask_hash(mask)}|{seqlen}x{nwindows}|s{sink}w{window}"
    hit = cache.get(key)
    if hit is not None:
        return hit, True
    t0 = time.time()
    r = long_perplexity(model, tok, mask, WIKI, seqlen=seqlen, nwindows=nwindows, sink=sink,
                        window=window)
    val = {"ppl": r.ppl, "seconds": round(time.time() - t0, 1)}
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


def main(argv=None):
    from edgeprune.leank import DEFAULT_ALIGNMENT, DEFAULT_SINK, DEFAULT_WINDOW
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true",
                    help="keep 1.0/0.3 only, 2 windows, 4 retrieval trials (< 10 min)")
    ap.add_argument("--keeps", default="1.0,0.5,0.3,0.2")
    ap.add_argument("--methods", default="learned,magnitude")
    ap.add_argument("--phases", default="masks,ppl,stress,retrieval,runtime")
    ap.add_argument("--nwindows", type=int, default=10)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--sink", type=int, default=DEFAULT_SINK)
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    ap.add_argument("--alignment", type=int, default=DEFAULT_ALIGNMENT)
    ap.add_argument("--nsamples", type=int, default=4)
    ap.add_argument("--calib-seqlen", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fresh", action="store_true", help="ignore cached masks and evaluations")
    ap.add_argument("--ppl-keeps", default=None, help="keeps to score (default: all)")
    ap.add_argument("--retrieval-keeps", default="1.0,0.3")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    keeps = [float(k) for k in args.keeps.split(",")]
    methods = args.methods.split(",")
    phases = set(args.phases.split(","))
    if args.quick:
        keeps = [1.0, 0.3]
        args.nwindows, args.trials = 2, 4
        args.retrieval_keeps = "1.0,0.3"
    ppl_keeps = [float(k) for k in (args.ppl_keeps or ",".join(map(str, keeps))).split(",")]
    retr_keeps = [float(k) for k in args.retrieval_keeps.split(",")]

    from edgeprune.models import load_model
    model, tok = load_model("smollm2-135m")
    cache = EvalCache(CACHE / "evals.json", fresh=args.fresh)
    masks = get_masks(model, tok, keeps, methods, args) if "masks" in phases or True else {}
    records = []

    def rec(case, metric, val, cached=False):
        records.append({"case": case, "metric": metric, "ours": val, "peer": None,
                        "theirs": None, **({"note": "cached"} if cached else {})})
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

    dense_ppl = None
    if "ppl" in phases:
        for name, keep, method, mask in cases():
            if keep not in ppl_keeps:
                continue
            v, c = eval_ppl(model, tok, mask, cache, 2048, args.nwindows, args.sink, args.window)
            if keep >= 1.0:
                dense_ppl = v["ppl"]
            rec(name, f"ppl_2048x{args.nwindows}", v["ppl"], c)
            if dense_ppl:
                rec(name, "ppl_increase_pct", 100 * (v["ppl"] / dense_ppl - 1), c)
            if mask is not None:
                rec(name, "k_keep_fraction_mask", mask.fraction)
                rec(name, "v_keep_fraction_mask", mask.v_fraction())
    if "stress" in phases:
        for name, keep, method, mask in cases():
            if mask is None or keep != 0.3:
                continue
            v, c = eval_ppl(model, tok, mask, cache, 2048, args.nwindows, 0, 0)
            rec(name, f"ppl_stress_sink0_window0_2048x{args.nwindows}", v["ppl"], c)
            if dense_ppl:
                rec(name, "ppl_stress_increase_pct", 100 * (v["ppl"] / dense_ppl - 1), c)
    if "retrieval" in phases:
        for name, keep, method, mask in cases():
            if keep not in retr_keeps or (method == "magnitude" and not args.quick and False):
                continue
            r, c = eval_retrieval(model, tok, mask, cache, args.trials, args.sink, args.window)
            rec(name, "retrieval_acc", r["accuracy"], c)
    if "runtime" in phases:
        from bench_leank_runtime import runtime_records  # noqa: F401  (filled below)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1))
        _log(f"wrote {args.json} ({len(records)} records)")
    return records


if __name__ == "__main__":
    main()
