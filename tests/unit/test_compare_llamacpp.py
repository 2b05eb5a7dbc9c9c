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


def test_cache_variants_pair_with_their_base_export(bench, capsys):
    """Issue 25: a KV-cache / LeanK export is compared with the export it changes, when that
    one is measured too; the perplexity ratio is recorded per pair."""
    vs = ["rtn-g32-8k", "rtn-g32-8k-kv16", "rtn-g32-8k-kv8", "rtn-g32-8k-leank0.3", "gptq-g64"]
    assert [bench.cache_base(v, vs) for v in vs] == [None, "rtn-g32-8k", "rtn-g32-8k", "rtn-g32-8k", None]
    assert bench.cache_base("rtn-g32-8k-kv8", ["rtn-g32-8k-kv8"]) is None
    ppl = {"rtn-g32-8k": {"ppl": 20.0}, "rtn-g32-8k-kv8": {"ppl": 20.1}, "rtn-g32-8k-leank0.3": {"error": "x"}}
    recs = bench.cache_quality_records("", vs, ppl)
    assert recs == [{"case": "int4-rtn-g32-8k-kv8_vs_int4-rtn-g32-8k", "metric": "ppl_ratio",
                     "ours": pytest.approx(1.005), "peer": "ours rtn-g32-8k", "theirs": None}]
    assert "20.100 / 20.000 = 1.0050" in capsys.readouterr().out
    bl = sys.modules["benchlib"]
    assert all(v in bl.OURS_VARIANTS for v in vs)
    assert bl.ours_folder("rtn-g32-8k-kv8") == bl.CACHE / "smollm2-int4-rtn-g32-8k-kv8"


def test_llama_kv_bytes_per_token_from_the_gguf_geometry(bench):
    # SmolLM2-135M: 30 layers, 3 KV heads, 9 heads of 576 / 9 = 64 channels, f16
    meta = {"general.architecture": "llama", "llama.block_count": "30",
            "llama.attention.head_count": "9", "llama.attention.head_count_kv": "3",
            "llama.embedding_length": "576"}
    assert bench._llama_kv_bytes_per_token(meta) == 30 * 3 * (64 + 64) * 2 == 23040
    meta["llama.attention.key_length"] = "128"          # a family with its own head size
    assert bench._llama_kv_bytes_per_token(meta) == 30 * 3 * (128 + 128) * 2


def test_ppl_chunk_scores_every_export_on_the_decode_path_beside_an_fp16_cache(bench, tmp_path):
    import json

    dirs = {}
    for name, rec in (("a", {}), ("b", {"kvcache": {"dtype": "int8"}}), ("c", {"kvcache": {"dtype": "fp16"}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "edgeprune.json").write_text(json.dumps({"variants": rec}))
        dirs[name] = tmp_path / name
    logs = []
    assert bench.ppl_chunk(None, {k: dirs[k] for k in "ab"}, logs.append) == 0
    assert bench.ppl_chunk(None, dirs, logs.append) == 1 and "decode path" in logs[0]
    assert bench.ppl_chunk(0, dirs, logs.append) == 0 and bench.ppl_chunk(8, dirs, logs.append) == 8


def test_plot_writes_a_png_per_thread_panel(bench, tmp_path):
    series = {("ours rtn-g32", 1): [(128, 100.0), (2048, 80.0)],
              ("llama.cpp q4_0", 1): [(128, 95.0), (2048, 85.0)],
              ("ours rtn-g32", 2): [(128, 150.0)]}
    p = bench.plot_decode_vs_context(tmp_path / "d" / "plot.png", series, "smollm2")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
