"""The bench helper (bench/benchlib.py) and the docs generator (bench/report.py).

Bench code is not a package: both files are loaded from their paths (tests/bench_modules.py),
and ``benchlib`` is registered under its own name (the ``benchlib`` fixture,
tests/conftest.py) so that ``report.py``'s ``import benchlib`` finds it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from bench_modules import load_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def report(benchlib):
    return load_bench("report")


def test_record_must_have_exactly_the_five_fields(benchlib, tmp_path):
    good = benchlib.record("int4/t1", "decode_tok_s", 50.0, peer="llama.cpp", theirs=48.0)
    missing = {k: v for k, v in good.items() if k != "theirs"}
    extra = {**good, "error": "boom"}
    with pytest.raises(benchlib.RecordError, match="missing theirs"):
        benchlib.validate_record(missing)
    with pytest.raises(benchlib.RecordError, match="extra error"):
        benchlib.validate_record(extra)
    out = tmp_path / "r.json"
    with pytest.raises(benchlib.RecordError, match=r"record 1 .*extra error.*r\.json\.invalid"):
        benchlib.write_records(out, [good, extra])
    assert not out.exists()                                        # nothing half-valid written
    assert json.loads((tmp_path / "r.json.invalid").read_text())[1]["error"] == "boom"


@pytest.mark.parametrize("bad, message", [
    ({"ours": "fast"}, "ours is text"),
    ({"theirs": float("nan")}, "theirs is nan"),
    ({"ours": True}, "ours is a bool"),
    ({"metric": "decode tok/s"}, "whitespace"),
    ({"case": ""}, "case must be a non-empty string"),
    ({"peer": 3}, "peer must be"),
])
def test_record_values_are_checked(benchlib, bad, message):
    rec = {**benchlib.record("c", "ppl", 1.0), **bad}
    with pytest.raises(benchlib.RecordError, match=message):
        benchlib.validate_record(rec)


def test_write_records_round_trip(benchlib, tmp_path, capsys):
    recs = [benchlib.record("c", "ppl", np.float32(32.25), peer="llama.cpp", theirs=np.int64(36)),
            benchlib.error_record("c", "peer build failed", peer="llama.cpp"),
            benchlib.note_record("c", "peer result cached")]
    out = benchlib.write_records(tmp_path / "sub" / "r.json", recs)
    assert f"wrote 3 records to {out}" in capsys.readouterr().out
    back = benchlib.read_records(out)
    assert back[0] == {"case": "c", "metric": "ppl", "ours": 32.25, "peer": "llama.cpp", "theirs": 36}
    assert type(back[0]["theirs"]) is int
    assert back[1]["metric"] == "error" and back[1]["theirs"] == "peer build failed"
    assert back[2]["ours"] == "peer result cached"


def test_common_args_and_worker_env(benchlib):
    import argparse

    ap = benchlib.add_common_args(argparse.ArgumentParser(), "quick help")
    a = ap.parse_args(["--quick", "--json", "x.json"])
    assert a.quick and a.json == Path("x.json")
    assert ap.parse_args([]).json is None
    env = benchlib.worker_env(OMP_NUM_THREADS=2)
    first, second = env["PYTHONPATH"].split(":")[:2]
    assert second == str(benchlib.ROOT) and env["OMP_NUM_THREADS"] == "2"
    assert (Path(first) / "edgeprune_runtime" / "session.py").resolve() == \
        benchlib.ROOT / "runtime" / "session.py"


SMALL = [
    {"case": "int4_vs_q4_0/t1", "metric": "decode_ratio_paired", "ours": 1.0412, "peer": "llama.cpp", "theirs": None},
    {"case": "int4_vs_q4_0/t1", "metric": "decode_tok_s", "ours": 52.61, "peer": "llama.cpp", "theirs": 50.2},
    {"case": "int4_vs_q4_0/t1", "metric": "peak_rss_mib", "ours": 215.3, "peer": "llama.cpp", "theirs": 222.0},
    {"case": "int4_vs_q4_0/t2", "metric": "decode_tok_s", "ours": 73.3, "peer": "llama.cpp", "theirs": 77.5},
    {"case": "int4_vs_q4_1/t1", "metric": "error", "ours": None, "peer": "llama.cpp", "theirs": "no q4_1 GGUF | sorry"},
    {"case": "machine/t1", "metric": "bandwidth_gb_s", "ours": 11.4, "peer": None, "theirs": None},
]


def test_report_renders_a_results_file(report):
    got = report.render_file("compare_llamacpp.json", "committed 2026-12-03", SMALL)
    assert got == """\
## compare_llamacpp.json

`bench/results/compare_llamacpp.json`, committed 2026-12-03; written by `bench/compare_llamacpp.py`

| case | metric | ours | peer | theirs | ratio |
|---|---|---|---|---|---|
| int4_vs_q4_0/t1 | decode_ratio_paired | 1.04 | llama.cpp | — |  |
| int4_vs_q4_0/t1 | decode_tok_s | 52.61 | llama.cpp | 50.20 | 1.05 |
| int4_vs_q4_0/t1 | peak_rss_mib | 215.3 | llama.cpp | 222.0 | 0.97 |
| int4_vs_q4_0/t2 | decode_tok_s | 73.30 | llama.cpp | 77.50 | 0.95 |
| int4_vs_q4_1/t1 | error | — | llama.cpp | no q4_1 GGUF \\| sorry |  |
| machine/t1 | bandwidth_gb_s | 11.40 | — | — |  |
"""


def test_report_summary_one_row_per_case_with_a_column_per_metric(report, tmp_path):
    (tmp_path / "compare_llamacpp.json").write_text(json.dumps(SMALL))
    (tmp_path / "other.json").write_text(json.dumps(SMALL[:2]))
    files = report.load_results(tmp_path)
    assert [f[0] for f in files] == ["compare_llamacpp.json", "other.json"]
    assert "not committed" in files[0][1] and re.search(r"\d{4}-\d\d-\d\d", files[0][1])
    benches = (("llama.cpp", "SmolLM2-135M", "compare_llamacpp", ("decode_tok_s", "peak_rss_mib")),
               ("llama.cpp", "Gemma-3-270M", "missing", ("decode_tok_s",)))
    summary = report.render_summary(files, benches)
    rows = [r for r in summary.splitlines() if r.startswith("| llama.cpp")]
    # a row per case with a figure on both sides: the error and the one-sided ratio are not rows
    assert [r.split(" | ")[2] for r in rows] == ["int4_vs_q4_0/t1", "int4_vs_q4_0/t2"]
    assert rows[0].startswith("| llama.cpp | SmolLM2-135M | int4_vs_q4_0/t1 | 52.61 vs 50.20 (1.05) "
                              "| 215.3 vs 222.0 (0.97) |  |  | `compare_llamacpp.json`, written ")
    assert "| 73.30 vs 77.50 (0.95) |  |  |  |" in rows[1]
    # the model alias prefixing a family's cases is dropped (the model is a column)
    fam = [{**r, "case": "gemma3-270m/" + r["case"]} for r in SMALL]
    (tmp_path / "fam.json").write_text(json.dumps(fam))
    rows = report.render_summary(report.load_results(tmp_path),
                                 (("llama.cpp", "Gemma-3-270M", "fam", ("decode_tok_s",)),)).splitlines()
    assert rows[2].startswith("| llama.cpp | Gemma-3-270M | int4_vs_q4_0/t1 | 52.61 vs 50.20 (1.05) |  |")
    doc = report.render_benchmarks(files)
    assert doc.startswith(report.PREAMBLE) and doc.count("| case | metric | ours |") == 2
    assert report.render_summary([]) == report.NO_RESULTS
    assert report.render_summary(files, benches[1:]) == report.NO_RESULTS
    # every file the README names exists (a renamed results file would empty its rows)
    stems = {p.stem for p in report.benchlib.RESULTS.glob("*.json")}
    assert [b[2] for b in report.README_BENCHES if b[2] not in stems] == []


def test_report_fills_the_readme_block(report):
    text = f"intro\n{report.START}\nold table\n{report.END}\nrest\n"
    assert report.fill_block(text, "| new |") == f"intro\n{report.START}\n| new |\n{report.END}\nrest\n"
    with pytest.raises(ValueError, match="results:start"):
        report.fill_block("no markers here", "x")
    readme = (BENCH.parent / "README.md").read_text()
    assert report.fill_block(readme, report.NO_RESULTS)          # the README has the markers


def test_report_pivots_a_results_file_into_a_page_block(report):
    recs = [{"case": "m/dense", "metric": "wikitext2_ppl", "ours": 28.74, "peer": None, "theirs": None},
            {"case": "m/dense", "metric": "note", "ours": "x", "peer": None, "theirs": None},
            {"case": "m/skip0.25/ig", "metric": "acc_task_mean", "ours": 0.5125, "peer": None, "theirs": None},
            {"case": "m/skip0.25/ig", "metric": "wikitext2_ppl", "ours": 61.2, "peer": None, "theirs": None}]
    got = report.render_pivot("igpruning.json", "committed 2026-12-03", recs,
                              ("wikitext2_ppl", "ppl_lang_mean", "acc_task_mean"))
    assert got.splitlines()[:4] == ["| case | wikitext2_ppl | acc_task_mean |", "|---|---|---|",
                                    "| m/dense | 28.74 | — |", "| m/skip0.25/ig | 61.20 | 0.512 |"]
    assert got.endswith("from `bench/results/igpruning.json`, committed 2026-12-03.")
    # NAME:theirs is the peer's figure of NAME, in a column of its own
    side = [{"case": "a_vs_q4_0/p2048/t1", "metric": "decode_tok_s", "ours": 53.8, "peer": "llama.cpp", "theirs": 63.4},
            {"case": "a/p2048/t1", "metric": "bandwidth_limit_tok_s", "ours": 219.9, "peer": None, "theirs": None}]
    got = report.render_pivot("x.json", "d", side, ("decode_tok_s", "decode_tok_s:theirs", "peak_rss_mib"))
    assert got.splitlines()[:3] == ["| case | decode_tok_s | decode_tok_s (peer) |", "|---|---|---|",
                                    "| a_vs_q4_0/p2048/t1 | 53.80 | 63.40 |"]
    start, end = report.markers("igpruning")
    page = f"a\n{start}\nold\n{end}\nb\n"
    assert report.fill_block(page, "| t |", "igpruning") == f"a\n{start}\n| t |\n{end}\nb\n"
    for stem, (page, _) in report.DOC_TABLES.items():       # every page has its markers
        assert report.fill_block((BENCH.parent / page).read_text(), "x", stem)


def test_bench_scripts_do_not_edit_the_module_search_path():
    offenders = [p.name for p in BENCH.glob("*.py") if "sys.path" in p.read_text()]
    assert offenders == []


def test_task_parity_records_points_and_the_largest_difference(benchlib):
    tp = load_bench("task_parity")
    same = {t: {"acc": 0.5, "acc_norm": 0.25} for t in tp.TASKS}
    off = {**same, "arc_easy": {"acc": 0.52, "acc_norm": 0.25}}
    recs = tp.records({"dense_torch": off, "lmeval_hf": same})
    assert {r["case"] for r in recs} == {"dense/torch_vs_lm_eval_hf"}      # sides missing: no case
    by = {r["metric"]: r for r in recs}
    assert by["acc_arc_easy"]["ours"] == pytest.approx(52.0) and by["acc_arc_easy"]["theirs"] == 50.0
    assert by["acc_arc_easy"]["peer"] == "lm-eval hf"
    assert by["max_abs_diff_points"]["ours"] == pytest.approx(2.0)
    assert len(recs) == 2 * len(tp.TASKS) + 1


def test_llamacpp_cmake_args_follow_the_cpu_and_leave_amx_out():
    bl = load_bench("benchlib")
    avx512 = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}
    args = bl.llamacpp_cmake_args(avx512).split()
    assert args[0] == "-DGGML_NATIVE=OFF"
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=OFF",
            "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    # every ISA option said exactly once, ON or OFF
    assert sorted(a.split("=")[0] for a in args if not a.startswith("-DGGML_AMX") and a != "-DGGML_NATIVE=OFF") == \
        sorted(f"-D{k}" for k in bl.GGML_ISA)
    avx2 = bl.llamacpp_cmake_args({"avx", "avx2", "fma", "f16c"})
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2
    assert bl.llamacpp_cmake_args({"neon", "asimd"}) == ""       # not x86: native build


def _fake_tree(root: Path) -> Path:
    """A repository root with one source file per package and one cached export folder."""
    for pkg in ("edgeprune", "exporters"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "a.py").write_text(f"# {pkg}\n")
    folder = root / "cache" / "export"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"onnx")
    (folder / "edgeprune.json").write_text("{}")
    return folder


def test_sources_digest_follows_content_not_mtime(benchlib, tmp_path):
    _fake_tree(tmp_path)
    d0 = benchlib.sources_digest(tmp_path)
    src = tmp_path / "edgeprune" / "a.py"
    src.write_text(src.read_text())                       # same bytes, new mtime
    assert benchlib.sources_digest(tmp_path) == d0
    src.write_text("# changed\n")
    assert benchlib.sources_digest(tmp_path) != d0
    src.write_text("# edgeprune\n")
    (tmp_path / "exporters" / "a.py").rename(tmp_path / "exporters" / "b.py")   # a path is content too
    assert benchlib.sources_digest(tmp_path) != d0


def test_ours_is_current_reads_the_stamp_before_mtimes(benchlib, tmp_path, monkeypatch):
    folder = _fake_tree(tmp_path)
    monkeypatch.setattr(benchlib, "ROOT", tmp_path)
    monkeypatch.setattr(benchlib, "sources_digest", lambda root=tmp_path: "abc")
    old = (tmp_path / "edgeprune" / "a.py").stat().st_mtime - 100
    os.utime(folder / "edgeprune.json", (old, old))      # older than the sources
    assert not benchlib.ours_is_current(folder)           # no stamp: the mtime rule
    (folder / benchlib.SOURCES_FILE).write_text("abc\n")
    assert benchlib.ours_is_current(folder)               # the stamp matches the code of now
    (folder / benchlib.SOURCES_FILE).write_text("def\n")
    assert not benchlib.ours_is_current(folder)           # built by other code
    (folder / "model.onnx").unlink()
    (folder / benchlib.SOURCES_FILE).write_text("abc\n")
    assert not benchlib.ours_is_current(folder)           # no graph, nothing current
