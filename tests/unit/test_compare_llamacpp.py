"""bench/compare_llamacpp.py's model choice and perplexity table (no model, no llama.cpp).

Bench code is not a package: the files are loaded from their paths (tests/bench_modules.py),
with ``benchlib`` registered under its own name (the ``benchlib`` fixture, tests/conftest.py).
"""

from __future__ import annotations

import sys

import pytest

from bench_modules import load_bench


@pytest.fixture
def bench(benchlib):
    return load_bench("compare_llamacpp")


def test_unknown_model_names_the_supported_aliases(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--model", "llama-7b"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "llama-7b" in err
    for alias in ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"):
        assert alias in err


def test_negative_repeat_is_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--repeat", "-1"])
    assert "--repeat must be >= 0" in capsys.readouterr().err


def test_smollm2_export_folders_keep_their_names(bench):
    bl = sys.modules["benchlib"]
    assert bl.ours_folder("rtn-g32") == bl.CACHE / "smollm2-int4"
    assert bl.ours_folder("default") == bl.CACHE / "smollm2-int4-default"
    assert bl.ours_folder("rtn-g64", "gemma3-270m") == bl.CACHE / "gemma3-270m-int4-rtn-g64"
    for m, cfg in bench.MODELS.items():
        assert cfg["shipped"] in cfg["quants"] and "q4_0" in cfg["quants"]
        assert all(v in bl.OURS_VARIANTS for v in cfg.get("variants", []))


def test_quality_report_ratio_bound_and_bits(bench, capsys):
    ppl = {"dense": {"ppl": 20.0}, "rtn-g64": {"ppl": 24.0}, "q4_0": {"ppl": 25.0},
           "q4_k_m": {"ppl": 21.0, "cached": True}}
    sizes = {"rtn-g64": {"bits_per_weight": 4.3125, "stored_bits_per_weight": 4.5625,
                         "head_bits_per_weight": 8.1875, "head_stored_bits_per_weight": 8.28,
                         "file_mib": 300.0, "head": {"mode": "q8", "storage": "int8 block 128 asym"}},
             "q4_0": {"bits_per_weight": 4.5, "head_bits_per_weight": 8.5, "file_mib": 330.0,
                      "head_type": "Q8_0 (output.weight)"},
             "q4_k_m": {"error": "OSError: gone"}}
    recs = bench.quality_report("m", "m/", ["rtn-g64"], ["q4_0", "q4_k_m"], ppl, sizes, 40)
    by = {(r["case"], r["metric"]): r for r in recs}
    assert by[("m/dense_fp32", "ppl")]["ours"] == 20.0
    assert by[("m/int4-rtn-g64_vs_q4_0", "ppl_ratio")]["ours"] == pytest.approx(0.96)
    assert "NOT met" in by[("m/int4-rtn-g64_vs_q4_0", "note")]["ours"]
    assert by[("m/int4-rtn-g64_vs_dense_fp32", "ppl_ratio")]["ours"] == pytest.approx(1.2)
    assert by[("m/int4-rtn-g64", "bits_per_weight_linears")]["ours"] == 4.3125
    assert by[("m/q4_0", "bits_per_weight_linears")]["theirs"] == 4.5
    assert by[("m/q4_k_m", "error")]["theirs"] == "OSError: gone"
    assert ("m/q4_k_m", "note") in by                      # reused from the cache, said so
    for r in recs:
        sys.modules["benchlib"].validate_record(r)
    out = capsys.readouterr().out
    assert "0.960x" in out and "4.312" in out
