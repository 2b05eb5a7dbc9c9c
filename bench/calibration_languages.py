"""Per-language cost of int4 by calibration source: the shipped export scored on seven languages.

SmolLM2-135M-Instruct, the pipeline's default recipe (best-w4: GPTQ int4 g64 asym, 8-bit
``v_proj`` and first ``down_proj``), ``--nsamples`` x 512 calibration windows (seed 0) from
each source, exported to int4 (``edgeprune compress`` + ``edgeprune export``), then scored
through the runtime against the fp32 export of the dense model (``edgeprune eval EXPORT
--dense DENSE --langs ... --text WikiText-2``):

* per language of NTREX-128 (``../shared/data/multilingual/ntrex128``: the same sentences
  in English, Arabic, German, French, Russian, Spanish and Chinese; first ``--lang-lines``
  lines, 512-token windows): ``ppl_increase_pct_<code>`` = 100 (ppl / dense ppl - 1);
* ``ppl_increase_pct_en``, ``ppl_increase_pct_worst`` (the largest over the seven),
  ``worst_over_en`` (their ratio: issue 29 asks <= 1.5) and ``ppl_increase_pct_wikitext2``
  (WikiText-2 test, 40 x 512, no BOS).

Sources: ``self`` (text sampled from the model, unseeded: mostly English),
``self-multilingual`` (sampled windows seeded with the shipped prompts in twelve
languages), ``self-mixed`` (half unseeded, half seeded), ``self-mixed-<pct>`` (pct %
seeded), ``default`` (the embedded
English documentation text), or a text file; ``SOURCE:N`` calibrates on ``N`` windows
instead of ``--nsamples`` (case name ``SOURCE:N``). No peer
runs here (``peer``/``theirs`` null). Quality only: valid on a loaded machine.

Usage::

    .venv/bin/python bench/calibration_languages.py --json bench/results/calibration_languages.json
    # another recipe (case names get @best-w4-clip)
    .venv/bin/python bench/calibration_languages.py --sources self --recipe best-w4-clip \\
        --json bench/results/calibration_languages_clip.json
    # reuse finished work: an export per source and/or its `edgeprune eval --json` output
    .venv/bin/python bench/calibration_languages.py --sources self --export self=runs/a/onnx-compressed \\
        --dense runs/a/onnx-dense --eval-json self=/tmp/eval-self.json --json /tmp/cl.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import benchlib
from benchlib import SHARED, WIKI
from benchlib import edgeprune_cli as _cli

NTREX = SHARED / "data" / "multilingual" / "ntrex128"


def _pairs(items) -> dict[str, str]:
    out = {}
    for it in items or ():
        k, sep, v = it.partition("=")
        if not sep:
            raise SystemExit(f"expected SOURCE=PATH, got {it!r}")
        out[k] = v
    return out


def records_from_eval(source: str, ev: dict) -> list[dict]:
    """Records of one ``edgeprune eval --json`` result (``languages`` with ``rel_change``
    per language; ``ppl`` / ``ppl_dense`` of the ``--text``)."""
    langs = ev.get("languages") or {}
    if "eng" not in langs:
        raise SystemExit(f"{source}: the eval result has no English ('eng') language")
    inc = {c: 100.0 * v["rel_change"] for c, v in langs.items()}
    worst = max(inc, key=inc.get)
    recs = [benchlib.record(source, f"ppl_increase_pct_{c}", v) for c, v in inc.items()]
    recs += [benchlib.record(source, "ppl_increase_pct_en", inc["eng"]),
             benchlib.record(source, "ppl_increase_pct_worst", inc[worst]),
             benchlib.note_record(source, f"worst language: {worst}"),
             benchlib.record(source, "worst_over_en", inc[worst] / inc["eng"] if inc["eng"] > 0 else None)]
    if ev.get("ppl") and ev.get("ppl_dense"):
        recs.append(benchlib.record(source, "ppl_increase_pct_wikitext2",
                                    100.0 * (ev["ppl"] / ev["ppl_dense"] - 1)))
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "sources default and self-multilingual, 100 lines, 10 WikiText windows")
    ap.add_argument("--sources", default=None, help="comma list: self, self-multilingual, self-mixed, default, or text files; "
                                                           "SOURCE:N for N calibration windows")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--lang-lines", type=int, default=None, help="default 300")
    ap.add_argument("--nwindows", type=int, default=None, help="WikiText-2 windows (default 40)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--export", action="append", help="SOURCE=FOLDER: a finished int4 export of that source")
    ap.add_argument("--dense", default=None, help="fp32 export of the dense model (default: built)")
    ap.add_argument("--eval-json", action="append", help="SOURCE=FILE: a finished `edgeprune eval --json` of it")
    ap.add_argument("--work", default=None, help="default bench/.cache/calibration_languages")
    ap.add_argument("--recipe", default="best-w4", help="preset name or recipe file (default best-w4); "
                                                        "another recipe adds @<its stem> to the case names")
    a = ap.parse_args(argv)

    sources = (a.sources or ("default,self-multilingual" if a.quick else "self,self-multilingual,default")).split(",")
    lines = a.lang_lines or (100 if a.quick else 300)
    nwin = a.nwindows or (10 if a.quick else 40)
    work = Path(a.work or benchlib.CACHE / "calibration_languages")
    work.mkdir(parents=True, exist_ok=True)
    exports, evals = _pairs(a.export), _pairs(a.eval_json)
    dense = Path(a.dense) if a.dense else work / "dense"
    suffix = "" if a.recipe == "best-w4" else "@" + Path(a.recipe).stem
    recs: list[dict] = []
    for src in sources:
        if src in evals:
            ev = json.loads(Path(evals[src]).read_text(encoding="utf-8"))
        else:
            name, _, ns = src.partition(":") if not Path(src).suffix else (src, "", "")
            tag = (Path(name).stem if Path(name).suffix else name) + (f"-n{ns}" if ns else "") + suffix
            ex = Path(exports.get(src) or work / f"int4-{tag}")
            if not (ex / "model.onnx").is_file():
                ck = work / f"ckpt-{tag}"
                _cli("compress", "smollm2-135m", "--recipe", a.recipe, "--calib", name, "--nsamples",
                     ns or str(a.nsamples), "--threads", str(a.threads), "--out", str(ck), "--overwrite")
                _cli("export", str(ck), str(ex), "--no-validate", "--threads", str(a.threads), "--overwrite")
            if not (dense / "model.onnx").is_file():
                _cli("export", "smollm2-135m", str(dense), "--precision", "fp32", "--no-validate",
                     "--threads", str(a.threads), "--overwrite")
            out = work / f"eval-{tag}.json"
            _cli("eval", str(ex), "--dense", str(dense), "--langs", str(NTREX), "--lang-lines", str(lines),
                 "--text", str(WIKI), "--nwindows", str(nwin), "--threads", str(a.threads), "--json", str(out))
            ev = json.loads(out.read_text(encoding="utf-8"))
        rs = records_from_eval(src + suffix, ev)
        by = {r["metric"]: r["ours"] for r in rs}
        summary = ("ppl_increase_pct_en", "ppl_increase_pct_worst", "ppl_increase_pct_wikitext2")
        worst = max((k for k in by if k.startswith("ppl_increase_pct_") and k not in summary), key=by.get)
        print(f"{src + suffix:20s} en {by['ppl_increase_pct_en']:+.1f} %  worst {worst[17:]} "
              f"{by['ppl_increase_pct_worst']:+.1f} %  worst/en {by['worst_over_en']:.2f}  "
              f"WikiText-2 {by.get('ppl_increase_pct_wikitext2', float('nan')):+.1f} %", flush=True)
        recs += rs
    if a.json:
        benchlib.write_records(a.json, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
