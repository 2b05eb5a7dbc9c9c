"""Average bits per weight vs WikiText-2 perplexity for 4-bit recipes on SmolLM2-135M.

Measured (this session, shared and heavily loaded 2-core machine): dense 28.74 (pinned by
``tests/integration/test_cli.py``); ``best-w4`` 4.473 bits/weight, ppl 32.14 (+11.8 %),
GPTQ compress 843 s under load average ~12; RTN asym g64 4.3125 bits/weight, ppl 38.14
(+32.7 %).

The must-show: the preset ``edgeprune/recipes/best-w4.yaml`` stays within 4.5 bits per
weight on average over the decoder blocks' linear layers (scales and zero points included,
``QuantizedWeight.bits_per_weight``) and reaches <= +15 % perplexity over dense.

Every recipe is calibrated on the same windows (``--nsamples`` x 512 from C4 validation,
seed 0) and scored by ``edgeprune.evaluate.perplexity`` (WikiText-2 test, no BOS, first
``--nwindows`` windows of 512 tokens). The best recipe is also saved as a
compressed-tensors checkpoint, reloaded, and re-scored (the two perplexities must match).

Usage::

    .venv/bin/python bench/best_w4.py --json bench/results/best_w4.json
    .venv/bin/python bench/best_w4.py --quick --json /tmp/bw4.json      # best-w4 + RTN only, fewer windows

JSON records: ``{"case", "metric": "ppl" | "bits_per_weight" | "compress_s" |
"ppl_increase_pct", "ours", "peer": null, "theirs": null}``. Timing on the shared 2-core
machine is noisy. ``--quick`` (8 calibration windows, RTN and best-w4, 10 evaluation
windows, one checkpoint save and reload): a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import tempfile
import time
from pathlib import Path

import benchlib
from benchlib import C4, WIKI

BEST = benchlib.ROOT / "edgeprune" / "recipes" / "best-w4.yaml"


def recipes():
    from edgeprune.recipe import GPTQConfig, Recipe, RTNConfig
    g4 = dict(bits=4, group_size=64, sym=False, act_order=True, static_groups=True)
    return {
        "rtn_w4g64_sym": Recipe([RTNConfig(bits=4, group_size=64, sym=True)]),
        "rtn_w4g64_asym": Recipe([RTNConfig(bits=4, group_size=64, sym=False)]),
        "gptq_w4g64_asym": Recipe([GPTQConfig(**g4)]),
        "best-w4": Recipe.from_file(BEST),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "RTN + best-w4, 8 calibration windows, 10 eval windows")
    ap.add_argument("--cases", help="comma-separated subset of " + ", ".join(["dense", "rtn_w4g64_sym",
                                                                              "rtn_w4g64_asym",
                                                                              "gptq_w4g64_asym", "best-w4"]))
    ap.add_argument("--nsamples", type=int)
    ap.add_argument("--nwindows", type=int)
    a = ap.parse_args(argv)
    nsamples = a.nsamples or (8 if a.quick else 32)
    nwindows = a.nwindows or (10 if a.quick else 40)

    from rich.console import Console
    from rich.table import Table

    from edgeprune.calibration import build_calibration
    from edgeprune.checkpoint import load_checkpoint, save_checkpoint
    from edgeprune.engine import compress
    from edgeprune.evaluate import perplexity
    from edgeprune.models import load_model

    console = Console(width=150)
    R = recipes()
    names = a.cases.split(",") if a.cases else (["dense", "rtn_w4g64_asym", "best-w4"] if a.quick
                                                 else ["dense", *R])
    base, tok = load_model("smollm2-135m")
    calib = build_calibration(tok, C4, nsamples=nsamples, seqlen=512, seed=0)

    def ppl(m):
        return float(perplexity(m, tok, WIKI, seqlen=512, nwindows=nwindows, progress=False).ppl)

    dense = ppl(base)
    records, rows = [benchlib.record("dense", "ppl", dense)], []
    rows.append(("dense", 32.0, dense, None, None))
    for name in names:
        if name == "dense":
            continue
        m = copy.deepcopy(base)
        t0 = time.perf_counter()
        res = compress(m, R[name], calib.input_ids, progress=False, measure_errors=False)
        secs = time.perf_counter() - t0
        bpw = res.summary()["avg_bits_per_weight"]
        p = ppl(m)
        extra = {}
        if name == "best-w4":
            with tempfile.TemporaryDirectory() as d:
                out = save_checkpoint(m, tok, res, Path(d) / "best-w4", provenance={
                    "source": "smollm2-135m", "calibration": calib.info, "seed": 0})
                m2, _, info = load_checkpoint(out)
                extra["reloaded_ppl"] = ppl(m2)
                extra["checkpoint_bits_per_weight"] = info.avg_bits_per_weight
                del m2
        for metric, v in (("ppl", p), ("bits_per_weight", bpw), ("compress_s", secs),
                          ("ppl_increase_pct", 100 * (p / dense - 1)), *extra.items()):
            records.append(benchlib.record(name, metric, v))
        rows.append((name, bpw, p, secs, res.fallbacks[:1]))
        console.print(f"{name}: {bpw:.4f} bits/weight, ppl {p:.3f} (+{100 * (p / dense - 1):.1f}%), "
                      f"{secs:.0f} s {extra}")
        if a.json:
            benchlib.write_records(a.json, records)
        del m
        gc.collect()

    t = Table(title=f"SmolLM2-135M 4-bit recipes — calib C4 {nsamples}x512, WikiText-2 {nwindows}x512")
    for c in ("recipe", "avg bits/weight", "ppl", "vs dense", "compress s (noisy)", "fallbacks"):
        t.add_column(c)
    for name, bpw, p, secs, fb in rows:
        t.add_row(name, "fp32" if name == "dense" else f"{bpw:.3f}", f"{p:.2f}",
                  "—" if name == "dense" else f"+{100 * (p / dense - 1):.1f}%",
                  "—" if secs is None else f"{secs:.0f}", str(fb or ""))
    console.print(t)
    if a.json:
        benchlib.write_records(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
