"""The pruning-vs-quantization study on SmolLM2-135M as bench records (issue 23).

Runs the one ``edgeprune study`` command of docs/study.md (seven cells: dense, GPTQ-4,
AWQ-4, GPTQ-8, SparseGPT-50 %, Wanda-50 %, SparseGPT 2:4; 128 x 512 C4 calibration windows;
WikiText-2 40 x 512 for perplexity, KL, top-1 and activation SNR; 32 greedy continuations;
seven tasks, first ``--limit`` documents; seven NTREX languages, first 200 lines), times the
whole grid, and turns its ``results.json`` into records for docs/study.md (``bench/report.py``
renders them). ``--from OUT`` converts a finished run without running anything. No peer
runs here (``peer``/``theirs`` null).

Records, case ``<model>/<cell>``:

* ``--json PATH``: ``ppl``, ``kl_nats``, ``top1_agree_pct``, ``snr_db``,
  ``cont_changed_pct``, ``acc_mean_pct``, ``lang_change_mean_pct``, ``avg_bits``,
  ``compress_s``, and ``status`` notes for failed cells; case ``<model>/grid``:
  ``cells`` and ``grid_wall_min`` (the study's own wall time; only when that run computed
  every cell, else a note), and ``grid_compute_min``: every cell's compression seconds plus
  every unit's own seconds, however many runs computed them (model loading excluded;
  only when every unit carries its seconds: units cached before 2026-12-06 do not);
* ``PATH`` with ``_tasks`` before ``.json``: ``acc_<task>_pct`` per task;
* ``PATH`` with ``_langs``: ``ppl_<lang>`` and ``change_pct_<lang>`` per language.

The grid's time is only meaningful on a quiet machine (the issue asks <= 90 minutes on 2
cores at ``--limit 500``); the quality figures are valid under load.

Usage::

    .venv/bin/python bench/study.py --json bench/results/study_smollm2-135m.json   # ~90 min
    .venv/bin/python bench/study.py --quick --json /tmp/study_quick.json             # < 10 min
    .venv/bin/python bench/study.py --from runs/study-smollm2 --json bench/results/study_smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import benchlib
from benchlib import SHARED, WIKI
from benchlib import edgeprune_cli as _cli

CELLS = "gptq:4,awq:4,sparsegpt:0.5,wanda:0.5,gptq:8,sparsegpt:2:4"
TASKS = "piqa,arc_easy,arc_challenge,hellaswag,winogrande,boolq,openbookqa"


def study_args(out: Path, *, quick: bool, limit: int, threads: int, model: str,
               dtype: str = "float32", ray: "str | None" = None, calib_dtype: str = "float32") -> list[str]:
    """The ``edgeprune study`` arguments of docs/study.md (``quick``: 2 cells, 4
    calibration windows, 4 text windows, 2 tasks, 20 documents, 20 language lines;
    ``dtype``: of task and language scoring, ``--dtype`` added unless float32;
    ``calib_dtype``: of the calibration forward passes, ``--calib-dtype`` likewise; ``ray``:
    ``--ray`` added when given)."""
    extra = [] if dtype == "float32" else ["--dtype", dtype]
    extra += [] if calib_dtype == "float32" else ["--calib-dtype", calib_dtype]
    extra += ["--ray", ray] if ray else []
    return ["study", "--models", model,
            "--cells", "gptq:4,sparsegpt:0.5" if quick else CELLS,
            "--calib", str(SHARED / "data" / "c4" / "c4_validation_2k.parquet"),
            "--nsamples", "4" if quick else "128", "--seqlen", "512",
            "--text", str(WIKI), "--nwindows", "4" if quick else "40",
            "--continuations", "4" if quick else "32",
            "--tasks", "piqa,arc_easy" if quick else TASKS,
            "--limit", str(20 if quick else limit), "--task-data", str(SHARED / "data" / "tasks"),
            "--langs", str(SHARED / "data" / "multilingual" / "ntrex128"),
            "--lang-lines", "20" if quick else "200",
            "--threads", str(threads), *extra, "--out", str(out)]


def _pct(v):
    return None if v is None else 100.0 * v


def records(result: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """``(summary, tasks, languages)`` records of a study ``results.json``."""
    rows = result.get("rows") or []
    if not rows:
        raise SystemExit("results.json holds no rows")
    tasks = list((result.get("config") or {}).get("tasks") or [])
    langs = [k[4:] for k in rows[0] if k.startswith("ppl:")]
    summ, trec, lrec = [], [], []
    R = benchlib.record
    for r in rows:
        case = f"{r['model']}/{r['cell']}"
        if r.get("status") != "ok":
            summ.append(benchlib.note_record(case, str(r.get("status"))))
        summ += [R(case, "ppl", r.get("ppl")), R(case, "kl_nats", r.get("kl")),
                 R(case, "top1_agree_pct", _pct(r.get("top1"))), R(case, "snr_db", r.get("snr_db")),
                 R(case, "cont_changed_pct", _pct(r.get("cont_change"))),
                 R(case, "acc_mean_pct", _pct(r.get("acc_mean"))),
                 R(case, "lang_change_mean_pct", _pct(r.get("lang_change_mean"))),
                 R(case, "avg_bits", r.get("avg_bits")), R(case, "compress_s", r.get("compress_s"))]
        trec += [R(case, f"acc_{t}_pct", _pct(r.get(f"acc:{t}"))) for t in tasks]
        trec.append(R(case, "acc_mean_pct", _pct(r.get("acc_mean"))))
        for c in langs:
            lrec += [R(case, f"ppl_{c}", r.get(f"ppl:{c}")), R(case, f"change_pct_{c}", _pct(r.get(f"change:{c}")))]
    cells = result.get("cells") or []
    # the run's clock is the grid's only when the run computed every unit of every cell
    whole = bool(cells) and all(c.get("status") == "failed" or
                                set(c.get("computed") or []) >= set(c.get("units") or {}) for c in cells)
    for model in dict.fromkeys(r["model"] for r in rows):
        summ.append(R(f"{model}/grid", "cells", sum(r["model"] == model for r in rows)))
        compute = grid_compute_seconds([c for c in cells if c.get("model") == model])
        if compute is not None:
            summ.append(R(f"{model}/grid", "grid_compute_min", compute / 60.0))
        if whole:
            summ.append(R(f"{model}/grid", "grid_wall_min", (result.get("seconds") or 0.0) / 60.0))
        else:
            summ.append(benchlib.note_record(f"{model}/grid", "cells partly from the cache: "
                                             "the run's wall time is not the grid's"))
    return summ, trec, lrec


def grid_compute_seconds(cells: list) -> "float | None":
    """Compression seconds of every compressed cell plus the ``seconds`` of every unit of
    every cell (``results.json``'s ``cells``), or None when a unit or a compressed cell's
    record lacks its time (or a cell failed)."""
    total = 0.0
    for c in cells:
        if c.get("status") == "failed":
            return None
        units = c.get("units") or {}
        if not units or any(not isinstance((v or {}).get("seconds"), (int, float)) for v in units.values()):
            return None
        total += sum(v["seconds"] for v in units.values())
        if (c.get("spec") or {}).get("method") not in (None, "dense"):
            sec = (c.get("record") or {}).get("seconds")
            if not isinstance(sec, (int, float)):
                return None
            total += sec
    return total if cells else None


def _sibling(path: Path, tag: str) -> Path:
    return path.with_name(f"{path.stem}_{tag}{path.suffix}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "2 cells, 4 calibration windows, 2 tasks x 20 documents, 20 language lines")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=500, help="documents per task (default 500)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="task and language scoring precision (bfloat16: about 2x faster on AVX512-BF16/AMX)")
    ap.add_argument("--calib-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="precision of the compressions' calibration forward passes (weights and Hessians stay float32)")
    ap.add_argument("--ray", default=None, help="'local' or a cluster address: cells as Ray tasks, each with "
                    "--threads CPUs (on 2 cores, --threads 1 --ray local runs two cells at once)")
    ap.add_argument("--out", default=None, help="the study's folder (default bench/.cache/study[-quick])")
    ap.add_argument("--from", dest="from_", default=None, help="a finished study folder: convert only")
    ap.add_argument("--plots-to", default=None, help="copy the study's plots/*.png here (e.g. docs)")
    a = ap.parse_args(argv)

    out = Path(a.from_ or a.out or benchlib.CACHE / ("study-quick" if a.quick else "study"))
    if not a.from_:
        args = study_args(out, quick=a.quick, limit=a.limit, threads=a.threads, model=a.model, dtype=a.dtype,
                          ray=a.ray, calib_dtype=a.calib_dtype)
        print("edgeprune " + " ".join(args), flush=True)
        t0 = time.perf_counter()
        _cli(*args)
        print(f"grid done in {(time.perf_counter() - t0) / 60:.1f} min (this process's clock)", flush=True)
    res_file = out / "results.json"
    if not res_file.is_file():
        raise SystemExit(f"{res_file} is missing: run the study first (without --from)")
    result = json.loads(res_file.read_text(encoding="utf-8"))
    summ, trec, lrec = records(result)
    for r in summ:
        if r["metric"] in ("ppl", "kl_nats", "snr_db", "acc_mean_pct") and r["ours"] is not None:
            print(f"{r['case']:32s} {r['metric']:14s} {r['ours']:.4g}")
    if a.plots_to:
        dest = Path(a.plots_to)
        for png in sorted((out / "plots").glob("*.png")):
            shutil.copyfile(png, dest / f"study-{png.name}")
            print(f"copied {png.name} -> {dest / ('study-' + png.name)}")
    if a.json:
        p = Path(a.json)
        benchlib.write_records(p, summ)
        benchlib.write_records(_sibling(p, "tasks"), trec)
        benchlib.write_records(_sibling(p, "langs"), lrec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
