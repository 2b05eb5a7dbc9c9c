"""Decode speed with and without huge pages for the pre-packed weights, in lock step.

Two sessions of the same export in one process: one loaded with ``huge_pages=True``
(``runtime.hugepages``: the weights the load made resident collapsed into 2 MiB pages),
one with ``huge_pages=False`` (4 KiB pages). Their decode steps alternate one token at a
time (the order flips every step), so the machine's drift over seconds, which on a
shared host moves whole runs by 10-30 %, hits both alike; the figure is the median of
the paired step-time ratios. The huge-page session is loaded first, the order that
reads ~3 % slower between two identical sessions, so the ratio is, if anything, low.
One thread by default: with more, each session's onnxruntime workers spin while the
other session runs and the two halve each other's speed (2 threads read ~35 instead of
~72 tok/s), so for 2 threads compare fresh processes instead
(``bench/compare_llamacpp.py`` runs ours with the default, huge pages on).

Records: ``case`` ``<export>/t<threads>``, metric ``decode_tok_s`` (ours: huge pages,
peer ``4 KiB pages``: the same runtime with ``huge_pages=False``) and
``decode_speedup_paired`` (ours only), plus ``huge_page_mib`` (MiB collapsed).

The export: ``--folder``, else the shipped ``default`` export cached under ``bench/.cache``
(built if missing; 30+ min), or with ``--quick`` the data-free ``rtn-g32`` one (1-3 min)
unless a current ``default`` is cached; the case name is the folder's, which says which.

Usage::

    python bench/hugepages_ab.py --json bench/results/hugepages_ab.json [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import benchlib


def lock_step(folder: Path, threads: int, prompt_len: int, new_tokens: int, rounds: int) -> dict:
    """Median step times (ms) of both sessions and the median paired ratio."""
    import edgeprune_runtime as runtime

    huge = runtime.load(folder, threads=threads, huge_pages=True)
    small = runtime.load(folder, threads=threads, huge_pages=False)
    ids = [int(x) for x in np.random.default_rng(0).integers(100, 40000, prompt_len)]
    ss = [huge, small]
    for s in ss:
        s.eos_token_ids = []
        s.generate(ids, max_new_tokens=8)
    dts = [[], []]
    for r in range(rounds):
        its = [s.stream(ids, max_new_tokens=new_tokens) for s in ss]
        for it in its:
            next(it)
        for k in range(new_tokens - 1):
            for i in ((0, 1) if (k + r) % 2 == 0 else (1, 0)):
                t = time.perf_counter()
                next(its[i])
                dts[i].append(time.perf_counter() - t)
        for it in its:
            list(it)
    d = np.array(dts) * 1e3
    out = {"huge_ms": float(np.median(d[0])), "small_ms": float(np.median(d[1])),
           "paired": float(np.median(d[1] / d[0])), "huge_page_mb": huge.huge_page_bytes / 2**20}
    huge.close()
    small.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", default=None,
                    help="int4 export (default: our cached default export; quick: rtn-g32 "
                         "unless default is cached)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1],
                    help="more than 1 is distorted by the other session's spinning workers")
    ap.add_argument("--rounds", type=int, default=6)
    benchlib.add_common_args(ap, "2 rounds of 64 tokens, 1 thread (~1 min, plus 1-3 min to "
                                 "build the rtn-g32 export once)")
    a = ap.parse_args(argv)
    if a.folder is None:
        variant = benchlib.quick_variants()[-1] if a.quick else "default"
        folder = benchlib.ours_folder(variant)
        err = benchlib.ensure_ours(folder, print, variant)
        if err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    else:
        folder = Path(a.folder)
    if not (folder / "model.onnx").is_file():
        print(f"error: {folder} is not an export (fix: pass an export folder to --folder)",
              file=sys.stderr)
        return 2
    threads, rounds, new = ([1], 2, 64) if a.quick else (a.threads, a.rounds, 128)
    recs = []
    for t in threads:
        r = lock_step(folder, t, 128, new, rounds)
        case = f"{folder.name}/t{t}"
        print(f"{case}: huge pages {1e3 / r['huge_ms']:.1f} tok/s, 4 KiB pages {1e3 / r['small_ms']:.1f} "
              f"tok/s, paired speed-up {r['paired']:.3f}x ({r['huge_page_mb']:.0f} MiB collapsed)")
        recs += [benchlib.record(case, "decode_tok_s", 1e3 / r["huge_ms"], peer="4 KiB pages",
                                 theirs=1e3 / r["small_ms"]),
                 benchlib.record(case, "decode_speedup_paired", r["paired"]),
                 benchlib.record(case, "huge_page_mib", r["huge_page_mb"])]
    if a.json:
        benchlib.write_records(a.json, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
