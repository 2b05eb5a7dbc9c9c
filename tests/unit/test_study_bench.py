"""bench/study.py's records from a finished study (no model): summary, tasks and languages
files, percentages, a failed cell's note, the grid's wall time."""

from __future__ import annotations

import json

import pytest

from bench_modules import load_bench


def _result(tmp_path, status="computed"):
    rows = [dict(model="m", cell="dense", status="ok", ppl=20.0, kl=0.0, top1=1.0, snr_db=None, cont_change=0.0,
                 **{"acc:piqa": 0.6, "acc:arc_easy": 0.5}, acc_mean=0.55,
                 **{"ppl:eng": 10.0, "change:eng": 0.0, "ppl:deu": 30.0, "change:deu": 0.0},
                 lang_change_mean=0.0, avg_bits=None, compress_s=None),
            dict(model="m", cell="GPTQ-4 g64", status="ok", ppl=22.0, kl=0.05, top1=0.9, snr_db=18.5,
                 cont_change=0.25, **{"acc:piqa": 0.58, "acc:arc_easy": 0.49}, acc_mean=0.535,
                 **{"ppl:eng": 11.0, "change:eng": 0.1, "ppl:deu": 36.0, "change:deu": 0.2},
                 lang_change_mean=0.15, avg_bits=4.25, compress_s=61.0),
            dict(model="m", cell="RTN-4 g128", status="failed: group_size 128 does not divide 576",
                 ppl=None, kl=None, top1=None, snr_db=None, cont_change=None,
                 **{"acc:piqa": None, "acc:arc_easy": None}, acc_mean=None,
                 **{"ppl:eng": None, "change:eng": None, "ppl:deu": None, "change:deu": None},
                 lang_change_mean=None, avg_bits=None, compress_s=None)]
    out = tmp_path / "study"
    out.mkdir()
    done = {"status": "computed", "units": {"text": {}, "task:piqa": {}}, "computed": ["text", "task:piqa"]}
    cells = [done, dict(done, computed=["text"] if status == "cached" else done["computed"]), {"status": "failed"}]
    (out / "results.json").write_text(json.dumps({"config": {"tasks": ["piqa", "arc_easy"]}, "seconds": 5400.0,
                                                  "rows": rows, "cells": cells}), encoding="utf-8")
    return out


def test_records_of_a_finished_study(benchlib, tmp_path):
    bench = load_bench("study")
    path = tmp_path / "s.json"
    assert bench.main(["--from", str(_result(tmp_path)), "--json", str(path)]) == 0
    summ = {(r["case"], r["metric"]): r["ours"] for r in json.loads(path.read_text())}
    tasks = {(r["case"], r["metric"]): r["ours"] for r in json.loads((tmp_path / "s_tasks.json").read_text())}
    langs = {(r["case"], r["metric"]): r["ours"] for r in json.loads((tmp_path / "s_langs.json").read_text())}
    g = "m/GPTQ-4 g64"
    assert summ[(g, "ppl")] == 22.0 and summ[(g, "top1_agree_pct")] == pytest.approx(90.0)
    assert summ[(g, "cont_changed_pct")] == pytest.approx(25.0) and summ[(g, "lang_change_mean_pct")] == pytest.approx(15.0)
    assert summ[("m/grid", "grid_wall_min")] == pytest.approx(90.0) and summ[("m/grid", "cells")] == 3
    assert summ[("m/RTN-4 g128", "note")].startswith("failed: group_size")
    assert summ[("m/RTN-4 g128", "ppl")] is None
    assert tasks[(g, "acc_piqa_pct")] == pytest.approx(58.0) and tasks[(g, "acc_mean_pct")] == pytest.approx(53.5)
    assert langs[(g, "ppl_deu")] == 36.0 and langs[(g, "change_pct_deu")] == pytest.approx(20.0)
    assert langs[("m/dense", "change_pct_eng")] == 0.0


def test_a_grid_served_partly_from_the_cache_has_no_wall_time(benchlib, tmp_path):
    bench = load_bench("study")
    path = tmp_path / "s.json"
    assert bench.main(["--from", str(_result(tmp_path, status="cached")), "--json", str(path)]) == 0
    grid = {r["metric"]: r["ours"] for r in json.loads(path.read_text()) if r["case"] == "m/grid"}
    assert "grid_wall_min" not in grid and grid["cells"] == 3 and "from the cache" in grid["note"]


def test_the_documented_command_and_a_missing_run(benchlib, tmp_path):
    bench = load_bench("study")
    args = bench.study_args(tmp_path / "o", quick=False, limit=500, threads=2, model="smollm2-135m")
    assert args[args.index("--cells") + 1] == bench.CELLS and args[args.index("--limit") + 1] == "500"
    assert args[args.index("--tasks") + 1].count(",") == 6 and args[args.index("--nsamples") + 1] == "128"
    assert "--dtype" not in args
    b16 = bench.study_args(tmp_path / "o", quick=False, limit=500, threads=2, model="smollm2-135m", dtype="bfloat16")
    assert b16[b16.index("--dtype") + 1] == "bfloat16" and b16[:b16.index("--dtype")] == args[:-2]
    assert "--ray" not in args
    r = bench.study_args(tmp_path / "o", quick=False, limit=500, threads=1, model="smollm2-135m",
                         dtype="bfloat16", ray="local")
    assert r[r.index("--ray") + 1] == "local" and r[r.index("--threads") + 1] == "1"
    assert r[r.index("--out") - 2:r.index("--out")] == ["--ray", "local"]
    assert "--calib-dtype" not in r
    c = bench.study_args(tmp_path / "o", quick=False, limit=500, threads=2, model="smollm2-135m",
                         calib_dtype="bfloat16")
    assert c[c.index("--calib-dtype") + 1] == "bfloat16" and c[:c.index("--calib-dtype")] == args[:-2]
    with pytest.raises(SystemExit, match="results.json is missing"):
        bench.main(["--from", str(tmp_path), "--json", str(tmp_path / "x.json")])


def test_grid_compute_time_sums_every_unit_and_compression_over_runs(benchlib):
    bench = load_bench("study")
    dense = {"model": "m", "status": "cached", "spec": {"method": "dense"},
             "units": {"text": {"seconds": 60.0}, "task:piqa": {"seconds": 30.0}}, "record": {}}
    gptq = {"model": "m", "status": "computed", "spec": {"method": "gptq"},
            "units": {"text": {"seconds": 90.0}, "task:piqa": {"seconds": 30.0}}, "record": {"seconds": 300.0}}
    assert bench.grid_compute_seconds([dense, gptq]) == pytest.approx(510.0)
    # a unit cached before units carried their time, a compressed cell without its
    # compression time, or a failed cell: no figure rather than a wrong one
    old = dict(dense, units={"text": {"ppl": 20.0}, "task:piqa": {"seconds": 30.0}})
    assert bench.grid_compute_seconds([old, gptq]) is None
    assert bench.grid_compute_seconds([dense, dict(gptq, record={})]) is None
    assert bench.grid_compute_seconds([dense, {"model": "m", "status": "failed"}]) is None
    assert bench.grid_compute_seconds([]) is None
