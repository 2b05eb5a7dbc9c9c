"""bench/calibration_languages.py's records from a finished eval (no model): the per-language
increases, the worst over English, and the case name another recipe gets."""

from __future__ import annotations

import json

import pytest

from bench_modules import load_bench


@pytest.fixture
def bench(benchlib):
    return load_bench("calibration_languages")


def _eval(tmp_path):
    langs = {"eng": 0.10, "deu": 0.25, "arb": 0.05}
    ev = {"ppl": 33.0, "ppl_dense": 30.0, "languages": {c: {"rel_change": v} for c, v in langs.items()}}
    f = tmp_path / "eval.json"
    f.write_text(json.dumps(ev), encoding="utf-8")
    return f


@pytest.mark.parametrize("recipe,case", [("best-w4", "self"), ("best-w4-clip", "self@best-w4-clip")])
def test_records_of_a_finished_eval(bench, tmp_path, recipe, case):
    out = tmp_path / "r.json"
    assert bench.main(["--sources", "self", "--recipe", recipe, "--eval-json", f"self={_eval(tmp_path)}",
                       "--json", str(out)]) == 0
    recs = json.loads(out.read_text(encoding="utf-8"))
    by = {r["metric"]: r["ours"] for r in recs}
    assert {r["case"] for r in recs} == {case}
    assert by["ppl_increase_pct_en"] == pytest.approx(10.0) and by["ppl_increase_pct_worst"] == pytest.approx(25.0)
    assert by["worst_over_en"] == pytest.approx(2.5) and by["ppl_increase_pct_wikitext2"] == pytest.approx(10.0)
    assert by["note"] == "worst language: deu"


def test_eval_without_english_is_refused(bench, tmp_path):
    f = tmp_path / "e.json"
    f.write_text(json.dumps({"languages": {"deu": {"rel_change": 0.2}}}), encoding="utf-8")
    with pytest.raises(SystemExit, match="no English"):
        bench.main(["--sources", "self", "--eval-json", f"self={f}", "--json", str(tmp_path / "r.json")])
