"""Task accuracy through ``edgeprune eval --tasks`` against lm-eval's own HF runner, and
each export against the PyTorch model it came from (issue 23's first must-show).

SmolLM2-135M-Instruct, zero-shot, the first ``--limit`` documents of each task from the
local task data (``../shared/data/tasks``; the folder ``edgeprune eval`` prepares is the
one ``lm_eval --include_path`` reads, so both score the same documents):

* ``dense/torch_vs_lm_eval_hf``: ``edgeprune eval smollm2-135m`` (PyTorch) vs ``lm_eval
  --model hf`` on the same dequantized checkpoint (lm-eval's HFLM);
* ``dense/onnx_fp32_vs_torch``: the fp32 ONNX export through ``runtime`` vs PyTorch;
* ``rtn4/int4_vs_fake_quant``: RTN int4 g64 (``edgeprune compress --method rtn``), its
  default int4 export (int8-activation ``MatMulNBits``, 8-bit head) vs its PyTorch
  fake-quant checkpoint; ``rtn4/int4_exact_vs_fake_quant``: the same export with fp32
  compute and a float head (``--accuracy-level 0 --lm-head fp``).

Records per case and task: ``acc_<task>`` and ``acc_norm_<task>`` (ours = the first side,
theirs = the reference), and ``max_abs_diff_points`` over them (100 x accuracy). No timing:
valid on a loaded machine. About 10 minutes per side at ``--limit 500`` on 1 thread.

Usage::

    .venv/bin/python bench/task_parity.py --limit 500 --json bench/results/task_parity.json
    # reuse finished `edgeprune eval --json` files / an lm-eval output folder
    .venv/bin/python bench/task_parity.py --limit 500 --work /tmp/ev500 --json /tmp/tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import benchlib
from benchlib import SHARED
from benchlib import edgeprune_cli as _cli

TASKS = ("piqa", "arc_easy", "hellaswag")
#: case -> (ours side, reference side, peer label)
CASES = {"dense/torch_vs_lm_eval_hf": ("dense_torch", "lmeval_hf", "lm-eval hf"),
         "dense/onnx_fp32_vs_torch": ("dense_onnx", "dense_torch", "ours PyTorch"),
         "rtn4/int4_vs_fake_quant": ("rtn4_onnx", "rtn4_torch", "ours PyTorch fake-quant"),
         "rtn4/int4_exact_vs_fake_quant": ("rtn4x_onnx", "rtn4_torch", "ours PyTorch fake-quant")}


def _ours(path: Path) -> dict:
    """``{task: {"acc", "acc_norm"}}`` of an ``edgeprune eval --json`` file."""
    t = json.loads(path.read_text(encoding="utf-8"))["tasks"]["tasks"]
    return {k: {"acc": v["acc"], "acc_norm": v["acc_norm"]} for k, v in t.items()}


def _lm_eval(folder: Path) -> dict:
    """The same from the newest ``results_*.json`` lm-eval wrote under ``folder``."""
    files = sorted(folder.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"no lm-eval results_*.json under {folder}")
    res = json.loads(files[-1].read_text(encoding="utf-8"))["results"]
    return {k: {"acc": v["acc,none"], "acc_norm": v["acc_norm,none"]} for k, v in res.items()}


def run_sides(work: Path, limit: int, task_data: Path, threads: int) -> dict:
    """Every side's scores, computing only those whose output is not in ``work`` yet."""
    work.mkdir(parents=True, exist_ok=True)
    common = ["--tasks", ",".join(TASKS), "--limit", str(limit), "--task-data", str(task_data),
              "--threads", str(threads)]

    def ev(model: Path | str, name: str) -> dict:
        out = work / f"{name}.json"
        if not out.is_file():
            _cli("eval", str(model), *common, "--json", str(out))
        return _ours(out)

    sides = {"dense_torch": ev("smollm2-135m", "dense_torch")}
    hf = work / "lmeval_hf"
    if not list(hf.rglob("results_*.json")):
        prep = json.loads((work / "dense_torch.json").read_text())["tasks"]["protocol"]["prepared"]
        from edgeprune.models.aliases import resolve_alias
        from edgeprune.models.cache import entry_for_file   # the dequantized checkpoint folder
        lm_eval = Path(sys.executable).with_name("lm_eval")
        subprocess.run([str(lm_eval), "--model", "hf", "--model_args",
                        f"pretrained={entry_for_file(resolve_alias('smollm2-135m'))},dtype=float32",
                        "--include_path", prep, "--tasks", ",".join(TASKS), "--limit", str(limit),
                        "--batch_size", "8", "--device", "cpu", "--output_path", str(hf)],
                       check=True, env=dict(os.environ, HF_DATASETS_OFFLINE="1"))
    sides["lmeval_hf"] = _lm_eval(hf)
    if not (work / "onnx-dense" / "model.onnx").is_file():
        _cli("export", "smollm2-135m", str(work / "onnx-dense"), "--precision", "fp32", "--overwrite")
    sides["dense_onnx"] = ev(work / "onnx-dense", "dense_onnx")
    if not (work / "rtn4").is_dir():
        _cli("compress", "smollm2-135m", "--method", "rtn", "--bits", "4", "--group-size", "64",
             "--out", str(work / "rtn4"))
    sides["rtn4_torch"] = ev(work / "rtn4", "rtn4_torch")
    for name, extra in (("onnx-rtn4", []), ("onnx-rtn4-exact", ["--lm-head", "fp", "--accuracy-level", "0"])):
        if not (work / name / "model.onnx").is_file():
            _cli("export", str(work / "rtn4"), str(work / name), *extra, "--overwrite")
    sides["rtn4_onnx"] = ev(work / "onnx-rtn4", "rtn4_onnx")
    sides["rtn4x_onnx"] = ev(work / "onnx-rtn4-exact", "rtn4x_onnx")
    return sides


def records(sides: dict) -> list[dict]:
    """The records of :data:`CASES` from the sides' scores (accuracies in points)."""
    recs = []
    for case, (ours, ref, peer) in CASES.items():
        if ours not in sides or ref not in sides:
            continue
        diffs = []
        for task in TASKS:
            for m in ("acc", "acc_norm"):
                a, b = 100 * sides[ours][task][m], 100 * sides[ref][task][m]
                recs.append(benchlib.record(case, f"{m}_{task}", a, peer=peer, theirs=b))
                diffs.append(abs(a - b))
        recs.append(benchlib.record(case, "max_abs_diff_points", max(diffs), peer=peer))
        print(f"{case:32s} largest difference {max(diffs):.1f} points", flush=True)
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "--limit 20")
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default 500)")
    ap.add_argument("--task-data", default=str(SHARED / "data" / "tasks"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default=None, help="default bench/.cache/task_parity-<limit>")
    a = ap.parse_args(argv)
    limit = a.limit or (20 if a.quick else 500)
    work = Path(a.work or benchlib.CACHE / f"task_parity-{limit}")
    recs = records(run_sides(work, limit, Path(a.task_data), a.threads))
    recs.append(benchlib.note_record("protocol", f"SmolLM2-135M-Instruct, zero-shot, first {limit} "
                                     f"documents of {', '.join(TASKS)} (local task data), accuracy in points"))
    if a.json:
        benchlib.write_records(a.json, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
