"""Write docs/benchmarks.md and the README's results table from bench/results/*.json.

Nothing in either is typed by hand: every figure is a record of a results file, shown
with the file's name and date (the date of the commit that last changed it, or the file's
own time, said so, when it is not committed as it is).

* ``docs/benchmarks.md``: how to run the benches, then one table per results file
  (``case, metric, ours, peer, theirs, ratio``), newest file first.
* ``README.md``, between ``<!-- results:start -->`` and ``<!-- results:end -->``: the
  headline comparisons (:data:`README_BENCHES`): one row per peer, model and case, a column
  per metric (``ours vs theirs (ratio)``).
* the page of each results file of :data:`DOC_TABLES`, between
  ``<!-- results:<stem>:start -->`` and ``<!-- results:<stem>:end -->``: the file pivoted,
  a row per case and a column per chosen metric (:func:`render_pivot`).

Usage::

    python bench/report.py            # or: make bench-docs
    python bench/report.py --check    # exit 1 when either file is out of date
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import benchlib

DOC = benchlib.ROOT / "docs" / "benchmarks.md"
README = benchlib.ROOT / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
# The README's table: (peer, model, results stem, metrics shown from it), in order. Speeds
# and memory come from one host's files (the AVX-512 host of 2026-12-05); perplexity and
# compression time from the files that measured them (perplexity does not depend on the host).
_SPEED = ("decode_tok_s", "peak_rss_mib")
README_BENCHES = (
    ("llama.cpp", "SmolLM2-135M", "compare_llamacpp_smollm2_default_ppl", ("ppl",)),
    ("llama.cpp", "SmolLM2-135M", "compare_llamacpp_smollm2_avx512", _SPEED),
    ("llama.cpp", "Qwen2.5-Coder-0.5B", "compare_llamacpp_qwen2.5-coder-0.5b_rtn-g64", ("ppl",)),
    ("llama.cpp", "Qwen2.5-Coder-0.5B", "compare_llamacpp_qwen2.5-coder-0.5b_speed_avx512", _SPEED),
    ("llama.cpp", "Gemma-3-270M", "compare_llamacpp_gemma3-270m_h4", ("ppl",)),
    ("llama.cpp", "Gemma-3-270M", "compare_llamacpp_gemma3-270m_h4_avx512", _SPEED),
    ("onnxruntime-genai", "SmolLM2-135M", "compare_runtimes_smollm2_avx512", _SPEED),
    ("onnxruntime-genai", "Qwen2.5-Coder-0.5B", "compare_runtimes_qwen2.5-coder-0.5b", ("wikitext2_ppl",)),
    ("onnxruntime-genai", "Qwen2.5-Coder-0.5B", "compare_runtimes_qwen2.5-coder-0.5b_avx512", _SPEED),
    ("onnxruntime-genai", "Gemma-3-270M", "compare_runtimes_gemma3-270m_gptq-g128-h4", ("wikitext2_ppl",)),
    ("onnxruntime-genai", "Gemma-3-270M", "compare_runtimes_gemma3-270m_gptq-g128-h4_avx512", _SPEED),
    ("llm-compressor", "Qwen2.5-Coder-0.5B", "compare_methods_qwen2.5-coder-0.5b", ("ppl", "compress_s")),
)
# the model aliases that prefix the cases of the families' benches
MODEL_PREFIXES = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")
# the README's columns: (heading, metrics that fill it; ppl and wikitext2_ppl are both
# WikiText-2 test, 40 x 512 tokens)
README_COLUMNS = (("decode tok/s (higher wins)", ("decode_tok_s",)),
                  ("peak RSS MiB (lower wins)", ("peak_rss_mib",)),
                  ("WikiText-2 perplexity (lower wins)", ("ppl", "wikitext2_ppl")),
                  ("compression s (lower wins)", ("compress_s",)))
# results files shown as a case x metric table on a page: results stem -> (page, metrics)
_IG_METRICS = ("wikitext2_ppl", "ppl_lang_mean", "acc_task_mean", "kl_nats", "ppl_eng", "ppl_deu",
               "ppl_fra", "ppl_spa", "ppl_arb", "ppl_rus", "ppl_zho-CN", "acc_piqa", "acc_arc_easy",
               "acc_hellaswag", "acc_boolq", "k")
DOC_TABLES = {
    "igpruning": ("docs/igpruning.md", _IG_METRICS),
    "igpruning_quick_norefine": ("docs/igpruning.md", _IG_METRICS),
    "igpruning_speed": ("docs/igpruning.md", ("decode_tok_s", "decode_speedup_vs_dense", "ideal_speedup",
                                              "skipped_weight_fraction", "router_ms", "ttft_ms", "kv_bytes")),
    "accuracy_levels": ("docs/int4-export.md", ("argmax_agree", "max_abs_dlogit", "argmax_agree_onepass_vs_exact",
                                                "argmax_agree_decode_vs_exact", "decode_tok_s_t1",
                                                "ratio_vs_level4_t1", "decode_tok_s_t2", "ratio_vs_level4_t2")),
    "activation_quant": ("docs/int4-export.md", ("wikitext2_ppl",)),
    "accuracy_levels_vproj": ("docs/int4-export.md", ("wikitext2_ppl", "argmax_agree", "argmax_agree_onepass_vs_exact",
                                                      "argmax_agree_decode_vs_exact", "decode_tok_s_t1",
                                                      "ratio_vs_level4_t1", "decode_tok_s_t2", "ratio_vs_level4_t2")),
    "accuracy_levels_default": ("docs/int4-export.md", ("argmax_agree", "max_abs_dlogit", "argmax_agree_onepass_vs_exact",
                                                "argmax_agree_decode_vs_exact", "decode_tok_s_t1",
                                                "ratio_vs_level4_t1", "decode_tok_s_t2", "ratio_vs_level4_t2")),
    "compare_llamacpp_longctx": ("docs/kv-cache.md", (
        "decode_tok_s", "decode_tok_s:theirs", "decode_ratio_paired", "decode_ratio_paired_min",
        "decode_ratio_paired_max", "prefill_tok_s", "prefill_tok_s:theirs", "peak_rss_mib",
        "peak_rss_mib:theirs", "kv_cache_mib", "kv_cache_mib:theirs")),
    "task_parity": ("docs/study.md", tuple(f"{m}_{t}{side}" for t in ("piqa", "arc_easy", "hellaswag")
                                           for m in ("acc", "acc_norm") for side in ("", ":theirs"))
                    + ("max_abs_diff_points",)),
    "compare_methods_qwen2.5-coder-0.5b": ("docs/models.md", ("ppl", "ppl:theirs", "compress_s",
                                                                "compress_s:theirs")),
    **{stem: ("docs/signround-fista.md", ("ppl", "bits_per_weight", "compress_s"))
       for stem in ("compare_methods_presets", "compare_methods_presets_calib128", "compare_methods_presets_e2e",
                    "compare_methods_presets_e2e_calib128", "compare_methods_qwen2.5-coder-0.5b_e2e",
                    "compare_methods_gemma3-270m_e2e")},
    # issue 28: FISTAPruner vs SparseGPT and Wanda (50 % and 2:4, one thread each); SignRound vs AutoRound
    **{stem: ("docs/signround-fista.md", ("ppl", "compress_s"))
       for stem in ("compare_methods_fista50", "compare_methods_fista24")},
    **{stem: ("docs/signround-fista.md", ("ppl", "ppl:theirs", "compress_s", "compress_s:theirs"))
       for stem in ("compare_methods_autoround", "compare_methods_autoround_fullrange",
                    "compare_methods_gemma3-270m_autoround", "compare_methods_gemma3-270m_autoround_2threads",
                    "compare_methods_gemma3-270m_autoround_2threads_fused", "compare_methods_autoround_fullrange_fused",
                    "compare_methods_smollm2_llmcompressor",
                    "compare_methods_qwen2.5-coder-0.5b_autoround", "compare_methods_gemma3-270m_llmcompressor",
                    "compare_methods_qwen2.5-coder-0.5b_autoround_2threads",
                    "compare_methods_qwen2.5-coder-0.5b_autoround_stream", "compare_methods_autoround_stream",
                    "compare_methods_gemma3-270m_autoround_stream",
                    "compare_methods_qwen2.5-coder-0.5b_autoround_epyc")},
    # issue 28 on the other two models (one thread each)
    **{stem: ("docs/signround-fista.md", ("ppl", "bits_per_weight", "compress_s"))
       for stem in ("compare_methods_gemma3-270m", "compare_methods_qwen2.5-coder-0.5b_issue28",
                    "compare_methods_qwen2.5-coder-0.5b_2of4")},
    # the AVX-512 host of 2026-12-05: every family vs llama.cpp and onnxruntime-genai (issue 22)
    **{stem: ("docs/models.md", ("decode_tok_s", "decode_tok_s:theirs", "decode_ratio_paired",
                                 "ttft_ms", "ttft_ms:theirs", "peak_rss_mib", "peak_rss_mib:theirs"))
       for stem in ("compare_llamacpp_smollm2_avx512", "compare_runtimes_smollm2_avx512",
                    "compare_llamacpp_qwen2.5-coder-0.5b_speed_avx512",
                    "compare_runtimes_qwen2.5-coder-0.5b_avx512",
                    "compare_llamacpp_gemma3-270m_h4_avx512",
                    # an AMD EPYC host, 2026-12-07
                    "compare_llamacpp_smollm2_epyc", "compare_runtimes_smollm2_epyc",
                    "compare_llamacpp_qwen2.5-coder-0.5b_speed_epyc",
                    "compare_runtimes_smollm2_default_epyc", "compare_llamacpp_gemma3-270m_h4_epyc",
                    "compare_runtimes_gemma3-270m_gptq-g128-h4_epyc", "compare_runtimes_qwen2.5-coder-0.5b_epyc")},
    # the shipped SmolLM2 default (best-w4-refit) on the EPYC host: paired-round spread shown
    **{stem: ("docs/models.md", (
        "decode_tok_s", "decode_tok_s:theirs", "decode_ratio_paired", "decode_ratio_paired_min",
        "decode_ratio_paired_max", "peak_rss_mib", "peak_rss_mib:theirs"))
       for stem in ("compare_llamacpp_smollm2_default_epyc", "compare_llamacpp_smollm2_default_epyc16")},
    "compare_runtimes_smollm2_ppl": ("docs/models.md", ("wikitext2_ppl", "wikitext2_ppl:theirs")),
    "family_parity_smollm2": ("docs/models.md", ("max_abs_logit_diff", "top1_agreement", "reference_abs_max",
                                                 "greedy_identical", "greedy_tokens")),
    "compare_llamacpp_smollm2_default_ppl": ("docs/models.md", (
        "ppl", "ppl:theirs", "ppl_ratio", "bits_per_weight_linears", "bits_per_weight_head", "file_mib",
        "file_mib:theirs")),
    **{stem: ("docs/models.md", (
        "decode_tok_s", "decode_tok_s:theirs", "ttft_ms", "ttft_ms:theirs", "peak_rss_mib",
        "peak_rss_mib:theirs", "decode_us_per_step", "decode_us_per_step:theirs", "nodes_per_step",
        "nodes_per_step:theirs", "traced_step_us", "traced_step_us:theirs", "outside_nodes_us_per_step",
        "outside_nodes_us_per_step:theirs"))
       for stem in ("compare_runtimes_gemma3-270m_gptq-g128-h4_avx512", "compare_runtimes_smollm2_ops_avx512")},
    "attention_ceiling": ("docs/kv-cache.md", ("kv_mib", "gqa_ms", "one_gemm_ms", "kv_read_floor_ms", "gqa_gb_s",
                                               "one_gemm_max_abs_err")),
    "attention_ceiling_leank": ("docs/kv-cache.md", (
        "gqa_ms", "leank_ms", "leank_head_major_ms", "leank_int8_ms", "leank_head_major_vs_gqa",
        "leank_int8_vs_gqa", "kv_mib", "leank_kv_mib", "leank_int8_kv_mib", "kv_read_floor_ms")),
    "compare_llamacpp_longctx_avx512": ("docs/kv-cache.md", (
        "decode_tok_s", "decode_tok_s:theirs", "decode_ratio_paired", "decode_ratio_paired_min",
        "decode_ratio_paired_max", "peak_rss_mib", "peak_rss_mib:theirs", "kv_cache_mib", "kv_cache_mib:theirs")),
    # the study grid (bench/study.py): summary, tasks, languages
    **{f"study_{m}{tag}": ("docs/study.md", cols)
       for m in ("smollm2-135m", "smollm2-135m-limit500", "smollm2-135m-limit500-bf16", "gemma3-270m",
                 "qwen2.5-coder-0.5b")
       for tag, cols in (
           ("", ("ppl", "kl_nats", "top1_agree_pct", "snr_db", "cont_changed_pct", "acc_mean_pct",
                 "lang_change_mean_pct", "avg_bits", "compress_s", "grid_wall_min", "grid_compute_min", "cells",
                 "note")),
           ("_tasks", tuple(f"acc_{t}_pct" for t in ("piqa", "arc_easy", "arc_challenge", "hellaswag",
                                                     "winogrande", "boolq", "openbookqa", "mean"))),
           ("_langs", tuple(f"{k}_{c}" for c in ("eng", "deu", "fra", "spa", "zho-CN", "rus", "arb")
                            for k in ("ppl", "change_pct"))))},
    **{stem: ("docs/evaluation.md", tuple(f"ppl_increase_pct_{c}" for c in (
        "eng", "arb", "deu", "fra", "rus", "spa", "zho-CN")) + ("worst_over_en", "ppl_increase_pct_wikitext2"))
       for stem in ("calibration_languages", "calibration_languages_clip")},
}
NO_RESULTS = ("No results are committed yet: run the benches with `--json bench/results/<script>.json` "
              "(e.g. `make bench-quick`), then `make bench-docs`.")

PREAMBLE = """\
# Benchmarks

<!-- generated by `python bench/report.py` (make bench-docs) from bench/results/*.json: do not edit -->

Every table below is generated from a results file in `bench/results/`, committed beside
the code that produced it; nothing is copied by hand. Older figures, whose JSON was not
kept, are in [history.md](history.md).

## Running the benches

Each script in `bench/` runs edgeprune side by side with a peer tool (each peer in its own
virtualenv `.venv-<peer>`, created on first use and git-ignored), prints its table, and with
`--json PATH` writes a list of records `{"case", "metric", "ours", "peer", "theirs"}`
(`bench/benchlib.py`: metric names carry their unit, e.g. `decode_tok_s`, `peak_rss_mib`,
`ppl`; a failure is an `error` record, never dropped). `--quick` finishes in under 10
minutes on 2 cores once the peer virtualenvs exist; `make bench-peers` builds them ahead
(llama-cpp-python compiles from source: about 13 minutes, once).

```bash
make bench-peers                      # the peer virtualenvs (once)
make bench-quick                      # the four peer comparisons, --quick, into bench/results/
make bench-docs                       # this page and the README's table
.venv/bin/python bench/compare_llamacpp.py --json bench/results/compare_llamacpp.json   # a full run
```

| script | compares |
|---|---|
| `compare_methods.py` | compression methods vs llm-compressor (same calibration windows, same evaluation) |
| `compare_runtimes.py` | our int4 export + runtime vs onnxruntime-genai's int4 model |
| `compare_llamacpp.py` | our int4 export vs llama.cpp Q4_0 / Q4_1 (speed, memory, perplexity) |
| `lookup.py` | prompt-lookup decoding, ours vs llama.cpp's, by kind of text |
| `best_w4.py`, `calibration_domain.py`, `calibration_languages.py` | the default recipe and the calibration text |
| `accuracy_levels.py`, `activation_quant.py` | int4 `MatMulNBits` accuracy levels: one pass vs decode path, decode cost, the int8 activations' perplexity cost |
| `study.py`, `task_parity.py` | the pruning-vs-quantization study grid; task scores vs lm-eval |
| `leank.py`, `countdown.py`, `countdown_study.py` | the LeanK and COUNTDOWN variants |
| `kernel_ceiling.py`, `gather_bandwidth.py`, `head_two_stage.py`, `hugepages_ab.py` | kernels, memory and decode-step studies |

Timings come from whatever machine ran the bench (a shared 2-core host unless said):
differences under 10-15 % are noise there; `ratio` is ours / theirs.
"""


def fmt(v) -> str:
    """A record value for a Markdown cell: ``—`` for null, 3-4 significant figures for
    numbers, text with ``|`` escaped and cut at 160 characters."""
    if v is None:
        return "—"
    if isinstance(v, str):
        t = " ".join(v.split()).replace("|", "\\|")
        return t if len(t) <= 160 else t[:159] + "…"
    if isinstance(v, int):
        return f"{v:,}"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 10:
        return f"{v:.2f}"
    return "0" if v == 0 else f"{v:.3g}"


def fmt_ratio(q: Optional[float]) -> str:
    """A ratio for a cell: two decimals (empty when there is none)."""
    return "" if q is None else (f"{q:.2f}" if abs(q) < 100 else fmt(q))


def ratio(ours, theirs) -> Optional[float]:
    """``ours / theirs`` when both are numbers and ``theirs`` is not 0, else None."""
    num = (int, float)
    if isinstance(ours, num) and isinstance(theirs, num) and theirs:
        return ours / theirs
    return None


def file_date(path: Path) -> str:
    """``committed YYYY-MM-DD`` (the last commit that changed ``path``, when the file is
    committed as it is), else ``written YYYY-MM-DD, not committed`` from its mtime."""
    def git(*args):
        p = subprocess.run(["git", *args], cwd=str(benchlib.ROOT), capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None

    rel = str(path.resolve().relative_to(benchlib.ROOT)) if path.resolve().is_relative_to(
        benchlib.ROOT) else str(path)
    day = git("log", "-1", "--format=%cs", "--", rel)
    if day and git("status", "--porcelain", "--", rel) == "":
        return f"committed {day}"
    return f"written {time.strftime('%Y-%m-%d', time.localtime(path.stat().st_mtime))}, not committed"


def render_file(name: str, date: str, records: Sequence[dict]) -> str:
    """One results file as a Markdown section: heading, source line, table."""
    script = benchlib.BENCH / f"{Path(name).stem}.py"
    src = f"`bench/results/{name}`, {date}" + (
        f"; written by `bench/{script.name}`" if script.is_file() else "")
    lines = [f"## {name}", "", src, "",
             "| case | metric | ours | peer | theirs | ratio |", "|---|---|---|---|---|---|"]
    for r in records:
        q = ratio(r["ours"], r["theirs"])
        lines.append("| " + " | ".join([fmt(r["case"]), fmt(r["metric"]), fmt(r["ours"]),
                                        fmt(r["peer"]), fmt(r["theirs"]), fmt_ratio(q)]) + " |")
    return "\n".join(lines) + "\n"


def render_benchmarks(files: Sequence[tuple[str, str, list]]) -> str:
    """``docs/benchmarks.md``: :data:`PREAMBLE`, then one section per
    ``(file name, date, records)`` in the order given."""
    body = [render_file(n, d, r) for n, d, r in files] or [NO_RESULTS + "\n"]
    return PREAMBLE + "\n" + "\n".join(body)


def render_summary(files: Sequence[tuple[str, str, list]], benches=README_BENCHES) -> str:
    """The README's table: for each ``(peer, model, stem, metrics)`` of ``benches`` whose
    results file is among ``files``, one row per case that has one of ``metrics`` with both
    figures; a column per :data:`README_COLUMNS` entry, each cell ``ours vs theirs
    (ratio)``; the file and its date last. :data:`NO_RESULTS` when no row has a figure."""
    by_stem = {Path(n).stem: (n, d, r) for n, d, r in files}
    rows = []
    for peer, model, stem, metrics in benches:
        if stem not in by_stem:
            continue
        name, date, records = by_stem[stem]
        cases: dict = {}
        for r in records:
            if r["peer"] == peer and r["metric"] in metrics and ratio(r["ours"], r["theirs"]) is not None:
                cases.setdefault(r["case"], {}).setdefault(r["metric"], r)
        for case, got in cases.items():
            cells = []
            for _, col in README_COLUMNS:
                r = next((got[m] for m in col if m in got), None)
                cells.append("" if r is None else
                             f"{fmt(r['ours'])} vs {fmt(r['theirs'])} ({fmt_ratio(ratio(r['ours'], r['theirs']))})")
            head, _, rest = case.partition("/")
            shown = rest if rest and head in MODEL_PREFIXES else case      # the model is a column
            rows.append("| " + " | ".join([peer, model, fmt(shown), *cells, f"`{name}`, {date}"]) + " |")
    if not rows:
        return NO_RESULTS
    head = ["peer", "model", "case", *(h for h, _ in README_COLUMNS), "from"]
    return "\n".join(["| " + " | ".join(head) + " |", "|---" * len(head) + "|", *rows,
                      "", "Each cell: ours vs the peer's (ratio, ours / theirs). Generated by "
                      "`bench/report.py` from `bench/results/`; every case of every bench is in "
                      "[docs/benchmarks.md](docs/benchmarks.md), and what each export is in "
                      "[docs/models.md](docs/models.md)."])


def render_pivot(name: str, date: str, records: Sequence[dict], metrics: Sequence[str]) -> str:
    """One results file as a Markdown table: a row per case that has any of ``metrics``
    (in the file's order), a column per metric of ``metrics`` it has (``—`` where a case
    lacks one), then the source line. A metric written ``NAME:theirs`` is the peer's value
    of ``NAME`` (column ``NAME (peer)``); every other one is ours."""
    rows: dict = {}
    for r in records:
        for m in metrics:
            base, _, side = m.partition(":")
            if r["metric"] == base:
                rows.setdefault(r["case"], {})[m] = r["theirs"] if side == "theirs" else r["ours"]
    rows = {c: v for c, v in rows.items() if any(x is not None for x in v.values())}
    cols = [m for m in metrics if any(v.get(m) is not None for v in rows.values())]
    if not rows:
        return f"No figures yet in `bench/results/{name}`."
    head = [m.replace(":theirs", " (peer)") for m in cols]
    lines = ["| case | " + " | ".join(head) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += ["| " + " | ".join([fmt(c)] + [fmt(v.get(m)) for m in cols]) + " |" for c, v in rows.items()]
    return "\n".join(lines + ["", f"Generated by `bench/report.py` from `bench/results/{name}`, {date}."])


def markers(stem: Optional[str] = None) -> tuple[str, str]:
    """The start / end lines around a generated block: :data:`START`, :data:`END` for the
    README's table, ``<!-- results:<stem>:start -->`` ... for a results file of :data:`DOC_TABLES`."""
    return (START, END) if stem is None else (f"<!-- results:{stem}:start -->", f"<!-- results:{stem}:end -->")


def fill_block(text: str, block: str, stem: Optional[str] = None) -> str:
    """``text`` with the lines between the :func:`markers` of ``stem`` replaced by ``block``.

    Raises:
        ValueError: a marker is missing or out of order (the message says which).
    """
    start, end = markers(stem)
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"the page needs the lines {start} and {end} (in that order) "
                         "around the generated results table")
    return text[:i + len(start)] + "\n" + block.rstrip("\n") + "\n" + text[j:]


def render_pages(files: Sequence[tuple[str, str, list]]) -> dict:
    """``{path: new text}``: ``docs/benchmarks.md``, the README and every page of
    :data:`DOC_TABLES` (a page whose results file is missing keeps its block)."""
    pages = {DOC: render_benchmarks(files),
             README: fill_block(README.read_text(encoding="utf-8"), render_summary(files))}
    by_stem = {Path(n).stem: (n, d, r) for n, d, r in files}
    for stem, (page, metrics) in DOC_TABLES.items():
        path = benchlib.ROOT / page
        if stem in by_stem and path.is_file():
            text = pages[path] if path in pages else path.read_text(encoding="utf-8")
            pages[path] = fill_block(text, render_pivot(*by_stem[stem], metrics), stem)
    return pages


def load_results(folder: Path) -> list[tuple[str, str, list]]:
    """``(file name, date, records)`` of every ``*.json`` in ``folder``, newest first
    (then by name); each file checked by ``benchlib.read_records``."""
    out = []
    for p in sorted(folder.glob("*.json")):
        if p.name.startswith("."):
            continue
        out.append((p.name, file_date(p), benchlib.read_records(p)))
    out.sort(key=lambda f: f[0])
    return sorted(out, key=lambda f: _day(f[1]), reverse=True)     # stable: names stay sorted


def _day(date: str) -> str:
    """The ``YYYY-MM-DD`` inside a :func:`file_date` string."""
    return next((w.rstrip(",") for w in date.split() if w[:1].isdigit()), "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=benchlib.RESULTS)
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if docs/benchmarks.md or the README block is stale")
    a = ap.parse_args(argv)
    from edgeprune_runtime.files import atomic_write

    files = load_results(a.results)
    pages = render_pages(files)
    stale = [p for p, text in pages.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
    if a.check:
        for p in stale:
            print(f"{p.relative_to(benchlib.ROOT)} is out of date (fix: python bench/report.py)")
        return 1 if stale else 0
    for p in stale:
        atomic_write(p, pages[p])
    print(f"{len(files)} results files -> " + ", ".join(str(p.relative_to(benchlib.ROOT)) for p in pages)
          + f" ({'updated: ' + str(len(stale)) if stale else 'already current'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
