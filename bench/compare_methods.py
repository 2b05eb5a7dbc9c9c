"""edgeprune's compression methods vs llm-compressor on the same model, data and settings.

For every method (RTN / GPTQ / AWQ W4 g64 symmetric, SparseGPT and Wanda 50% and 2:4,
magnitude baselines, dense) on SmolLM2-135M-Instruct:

* both tools calibrate on the *same* token windows (``--nsamples`` x ``--seqlen`` from C4
  validation, drawn by ``edgeprune.calibration`` with ``--seed``; saved as .npy for the
  peer);
* llm-compressor (``.venv-llmcompressor``, created on first use: ``torch==2.13.0`` then
  ``llmcompressor==0.14.0.1``) runs in a subprocess on an HF folder holding the same fp32
  weights, and saves its result as a dense folder (fake-quantized / masked weights);
* both results are scored by the *same* code, ``edgeprune.evaluate.perplexity`` on
  WikiText-2 test (no BOS, first ``--nwindows`` windows of 512 tokens);
* wall time is each tool's compression call only (model loading and saving excluded).

Settings matched on both sides: 4-bit symmetric g64, GPTQ ``damp 0.01``, block 128 and
static activation ordering (llm-compressor's default ``actorder="static"`` = our
``act_order=True, static_groups=True``); AWQ 20-point grid with duo scaling; pruning at 50%
or 2:4 on every decoder linear, ``lm_head`` excluded (llm-compressor's pruning modifiers
need the regex ``re:.*lm_head`` for that, otherwise they prune the tied head/embedding).

One difference is ours by design: GPTQ and SparseGPT run ``true_sequential`` (default),
compressing q/k/v, o, gate/up, down of a block in turn, each from the outputs of the
groups already compressed (the GPTQ reference code's ``--true-sequential``);
llm-compressor calibrates every linear of a block from one pass. The ``*_onepass`` cases
turn it off, so both settings are reported against the same peer figure.

New methods and their peers (issue 28):

* ``signround_w4g64``: our SignRound (``edgeprune.methods.signround``, the "fast" schedule:
  50 steps, lr 5e-3, 4 windows per step, :data:`SIGNROUND`) vs Intel's AutoRound
  (``auto-round`` from PyPI in ``.venv-autoround``, ``benchlib.PEER_VENVS["autoround"]``,
  ``bench/_autoround_worker.py``) with the same windows, steps, step size and windows per
  step; and vs our ``gptq_w4g64``. Our default symmetric grid is ``2 max|w| / 15`` around
  code 8; AutoRound's ``int_sym`` is the full-range one (a signed scale, ``max|w| / 8``):
  ``signround_w4g64_fullrange`` runs ours on that grid (``full_range=True``), the
  like-for-like pair.
* ``fista_50`` / ``fista_2:4``: FISTAPruner (``edgeprune.methods.fista``) vs llm-compressor's
  SparseGPT (the ``sparsegpt`` / ``sparsegpt24`` peer runs) and vs our ``sparsegpt_*`` and
  ``wanda_*``.
* every shipped preset by its name (``best-w4``, ``best-w4-refit``, ``best-w4-signround``,
  ``best-50``, ``best-2-4``, ...: ``edgeprune/recipes/*.yaml``), and any recipe file as
  ``recipe:PATH``, with their bits per weight (metric ``bits_per_weight``).

The table "new methods vs edgeprune's own" gives the perplexity ratios against our own
baselines when both cases ran, with the issue's bounds (SignRound <= 0.97 x GPTQ,
FISTAPruner <= 0.95 x SparseGPT); those pairs are also records with
``"peer": "edgeprune <case>"``.

Usage::

    .venv/bin/python bench/compare_methods.py --json bench/results/compare_methods.json
    .venv/bin/python bench/compare_methods.py --quick --json bench/results/compare_methods.json
    .venv/bin/python bench/compare_methods.py --cases gptq_w4g64,signround_w4g64 --json bench/results/signround.json
    .venv/bin/python bench/compare_methods.py --model qwen2.5-coder-0.5b --group-size 128 \
        --cases gptq_w4g128,sparsegpt_50 --json bench/results/compare_methods_qwen2.5-coder-0.5b.json

``--model ALIAS`` runs the same cases on another model (its dense weights saved for the
peer as ``bench/.cache/ALIAS-fp32``), ``--group-size`` sets both sides' groups (the cases
are named by it); peer results are cached per model and group size.

``--quick``: dense, RTN, GPTQ and Wanda only, 8 x 512 calibration windows, 10 evaluation
windows: ours and the peer's compressions plus 7 perplexity passes, several minutes on 2
cores once ``.venv-llmcompressor`` exists (``make bench-peers``); peer figures are reused
from the cache on later runs.

Peer results are cached under ``bench/.cache/peers/`` keyed by method and calibration;
a cached figure is reused (and labelled ``cached`` in the table and a ``note`` record)
unless ``--fresh-peers``. Timing on this shared 2-core machine is noisy (other jobs run).
Metrics: ``ppl``, ``compress_s``, ``bits_per_weight``; a failure is an ``error`` record, never hidden.
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import benchlib
from benchlib import C4, CACHE, WIKI

PEER = "llm-compressor"


def cases(group_size: int = 64):
    """(case name, edgeprune config factory or None for dense, peer method key or None)."""
    from edgeprune.pipeline import preset_names
    from edgeprune.recipe import (AWQConfig, FISTAConfig, GPTQConfig, MagnitudeConfig, RTNConfig,
                                  SignRoundConfig, SparseGPTConfig, WandaConfig)
    g = group_size
    return [
        ("dense", None, None),
        (f"rtn_w4g{g}", lambda: RTNConfig(bits=4, group_size=g, sym=True), "rtn"),
        (f"gptq_w4g{g}", lambda: GPTQConfig(bits=4, group_size=g, sym=True, act_order=True,
                                             static_groups=True, damp_percent=0.01, blocksize=128),
         "gptq"),
        (f"awq_w4g{g}", lambda: AWQConfig(bits=4, group_size=g, sym=True, n_grid=20, duo_scaling=True),
         "awq"),
        (f"gptq_w4g{g}_onepass", lambda: GPTQConfig(bits=4, group_size=g, sym=True, act_order=True,
                                                     static_groups=True, damp_percent=0.01, blocksize=128,
                                                     true_sequential=False), "gptq"),
        ("sparsegpt_50", lambda: SparseGPTConfig(sparsity=0.5, percdamp=0.01, blocksize=128), "sparsegpt"),
        ("sparsegpt_50_onepass", lambda: SparseGPTConfig(sparsity=0.5, percdamp=0.01, blocksize=128,
                                                         true_sequential=False), "sparsegpt"),
        ("sparsegpt_2:4", lambda: SparseGPTConfig(prune_n=2, prune_m=4, percdamp=0.01, blocksize=128),
         "sparsegpt24"),
        ("wanda_50", lambda: WandaConfig(sparsity=0.5), "wanda"),
        ("wanda_2:4", lambda: WandaConfig(prune_n=2, prune_m=4), "wanda24"),
        ("magnitude_50", lambda: MagnitudeConfig(sparsity=0.5), None),
        ("magnitude_2:4", lambda: MagnitudeConfig(prune_n=2, prune_m=4), None),
        # SignRound (ours) vs AutoRound (auto-round from PyPI): same windows, steps, step size
        # and windows per step (SIGNROUND below); the _fullrange case also on AutoRound's grid
        (f"signround_w4g{g}", lambda: SignRoundConfig(bits=4, group_size=g, sym=True, **SIGNROUND), AUTOROUND),
        (f"signround_w4g{g}_fullrange", lambda: SignRoundConfig(bits=4, group_size=g, sym=True, full_range=True,
                                                                **SIGNROUND), AUTOROUND),
        ("fista_50", lambda: FISTAConfig(sparsity=0.5), "sparsegpt"),
        ("fista_2:4", lambda: FISTAConfig(prune_n=2, prune_m=4), "sparsegpt24"),
        # every shipped preset (edgeprune/recipes/*.yaml), by its name
        *[(name, (lambda n=name: _preset(n)), None) for name in preset_names()],
    ]


def recipe_case(name: str):
    """A ``recipe:PATH`` case (any recipe file, scored like the presets), or None when
    ``name`` is not one."""
    if not name.startswith("recipe:"):
        return None
    return (name, lambda: _preset(name.split(":", 1)[1]), None)


def _preset(name: str):
    from edgeprune.pipeline import resolve_recipe
    from edgeprune.recipe import Recipe
    return Recipe.from_file(resolve_recipe(name))


#: the SignRound / AutoRound schedule compared: AutoRound's "light" recipe (50 steps,
#: lr 5e-3) with 4 calibration windows per step, our "fast" default
SIGNROUND = {"iters": 50, "lr": 5e-3, "batch_size": 4}
AUTOROUND = "autoround"


def _peer_name(method) -> str:
    """The peer tool that runs ``method`` (a case's peer key)."""
    return "auto-round" if method == AUTOROUND else PEER


def quick_cases(group_size: int = 64) -> tuple:
    """The ``--quick`` set at ``group_size``."""
    return ("dense", f"rtn_w4g{group_size}", f"gptq_w4g{group_size}", "wanda_50")


QUICK_CASES = quick_cases()


def _ppl(model, tok, nwindows: int) -> float:
    from edgeprune.evaluate import perplexity
    return float(perplexity(model, tok, WIKI, seqlen=512, nwindows=nwindows, progress=False).ppl)


def _dense_folder(model, tok, alias: str = benchlib.SMOLLM2) -> Path:
    """The fp32 model as an HF folder for the peer (written once, atomically)."""
    out = CACHE / f"{alias}-fp32"
    if (out / "config.json").exists() and any(out.glob("model*.safetensors")):
        return out
    tmp = CACHE / f".{alias}-fp32.tmp-{os.getpid()}"
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    os.replace(tmp, out)
    return out


def _peer_run(method: str, model_dir: Path, calib_path: Path, key: str, nwindows: int, tok,
              fresh: bool, timeout: float, log: Path, alias: str = benchlib.SMOLLM2,
              group_size: int = 64) -> dict:
    """Run llm-compressor or AutoRound (or reuse its cached result):
    {"ppl", "seconds", "error", "note"}. SmolLM2 at group 64 keeps its cache names."""
    cdir = CACHE / "peers"
    cdir.mkdir(parents=True, exist_ok=True)
    sched = "-".join(f"{k}{v}" for k, v in SIGNROUND.items()) if method == AUTOROUND else ""
    tag = "" if (alias, group_size) == (benchlib.SMOLLM2, 64) else f"-{alias}-g{group_size}"
    cfile = cdir / f"{method}{sched and '-' + sched}{tag}-{key}-w{nwindows}.json"
    if cfile.exists() and not fresh:
        rec = json.loads(cfile.read_text())
        rec["note"] = f"cached {rec.get('when', '?')} ({cfile.name})"
        return rec
    rec = {"ppl": None, "seconds": None, "error": None, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        py = benchlib.ensure_peer("autoround" if method == AUTOROUND else "llmcompressor", log=log)
    except RuntimeError as e:
        rec["error"] = f"peer venv setup failed: {e}"
        return rec
    out = CACHE / f"peer-{method}"
    res_file = CACHE / f"peer-{method}.result.json"
    if res_file.exists():
        res_file.unlink()
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    if method == AUTOROUND:
        args = [benchlib.BENCH / "_autoround_worker.py", "--iters", SIGNROUND["iters"],
                "--lr", SIGNROUND["lr"], "--batch-size", SIGNROUND["batch_size"]]
    else:
        args = [benchlib.BENCH / "_llmc_worker.py", "--method", method, "--group-size", group_size]
    r = benchlib.run_peer(py, args + ["--model", model_dir, "--calib", calib_path, "--out", out,
                                      "--result", res_file], timeout=timeout, log=log)
    res = json.loads(res_file.read_text()) if res_file.exists() else {
        "ok": False, "error": f"worker exited rc={r['rc']}: {r['tail'][-600:]}"}
    rec["version"] = res.get("version")
    if not res.get("ok"):
        rec["error"] = res.get("error") or f"rc={r['rc']}"
    else:
        rec["seconds"] = res["seconds"]
        from transformers import AutoModelForCausalLM
        pm = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        rec["ppl"] = _ppl(pm, tok, nwindows)
        del pm
        shutil.rmtree(out, ignore_errors=True)
    cfile.write_text(json.dumps(rec, indent=2))
    return rec


#: (new method's case, our baseline's case, the issue's bound on the perplexity ratio or None)
VS_OURS = [("signround_w4g{g}", "gptq_w4g{g}", 0.97), ("signround_w4g{g}_fullrange", "gptq_w4g{g}", 0.97),
           ("fista_50", "sparsegpt_50", 0.95), ("fista_50", "wanda_50", None),
           ("fista_2:4", "sparsegpt_2:4", 0.95), ("fista_2:4", "wanda_2:4", None)]


def _vs_ours(rows, records, console, Table, f, prefix: str = "", group_size: int = 64) -> None:
    """SignRound vs our GPTQ, FISTAPruner vs our SparseGPT / Wanda (same run, same
    calibration): one record per pair whose both cases ran (``peer`` = ``"edgeprune <case>"``;
    case names carry the model's ``prefix`` and the run's ``group_size``)."""
    got = {r[0]: r for r in rows}
    t = Table(title="new methods vs edgeprune's own (same calibration; perplexity ratio; seconds noisy)")
    for col in ("case", "vs", "ppl", "ppl vs", "ratio", "bound", "ok", "s", "s vs"):
        t.add_column(col)
    for new, base, bound in VS_OURS:
        new, base = (prefix + c.format(g=group_size) for c in (new, base))
        if new not in got or base not in got or got[new][1] is None or got[base][1] is None:
            continue
        po, pb = got[new][1], got[base][1]
        ok = "—" if bound is None else ("yes" if po / pb <= bound else "NO")
        t.add_row(new, base, f(po), f(pb), f(po / pb, "{:.3f}"), "—" if bound is None else f"<= {bound}", ok,
                  f(got[new][3], "{:.0f}"), f(got[base][3], "{:.0f}"))
        records.append(benchlib.record(new, "ppl", po, peer=f"edgeprune {base}", theirs=pb))
    if t.row_count:
        console.print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "8x512 calibration, 10 eval windows, dense/RTN/GPTQ/Wanda only")
    ap.add_argument("--cases", help="comma-separated case names (default: all, or the quick set)")
    ap.add_argument("--nsamples", type=int, default=None)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--nwindows", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peer", action="store_true", help="run edgeprune only")
    ap.add_argument("--fresh-peers", action="store_true", help="ignore cached peer results")
    ap.add_argument("--peer-timeout", type=float, default=2400.0, help="seconds per peer run")
    ap.add_argument("--signround-iters", type=int, default=None,
                    help=f"signed-gradient steps per block for signround_w4g64 and AutoRound alike "
                         f"(default {SIGNROUND['iters']}, the fast schedule)")
    ap.add_argument("--model", default=benchlib.SMOLLM2, metavar="ALIAS",
                    help="an edgeprune.load_model alias (default %(default)s; e.g. qwen2.5-coder-0.5b); "
                         "other models' cases start with 'ALIAS/'")
    ap.add_argument("--group-size", type=int, default=64,
                    help="the quantizers' group size on both sides (cases are named by it, e.g. "
                         "gptq_w4g128)")
    a = ap.parse_args(argv)
    if a.signround_iters is not None:
        if a.signround_iters < 0:
            ap.error(f"--signround-iters {a.signround_iters} must be >= 0")
        SIGNROUND["iters"] = a.signround_iters
    nsamples = a.nsamples or (8 if a.quick else 32)
    nwindows = a.nwindows or (10 if a.quick else 40)

    from edgeprune.calibration import build_calibration
    from edgeprune.engine import compress
    from edgeprune.models import load_model
    from rich.console import Console
    from rich.table import Table

    console = Console(width=170)
    CACHE.mkdir(parents=True, exist_ok=True)
    log = CACHE / "compare_methods.peer.log"
    all_cases = cases(a.group_size)
    wanted = (a.cases.split(",") if a.cases else (quick_cases(a.group_size) if a.quick else [c[0] for c in all_cases]))
    all_cases += [c for c in map(recipe_case, wanted) if c is not None]
    unknown = set(wanted) - {c[0] for c in all_cases}
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {[c[0] for c in all_cases]} "
                 "or recipe:PATH (a recipe file)")

    base, tok = load_model(a.model)
    smol = a.model == benchlib.SMOLLM2
    prefix = "" if smol else f"{a.model}/"
    calib = build_calibration(tok, C4, nsamples=nsamples, seqlen=a.seqlen, seed=a.seed)
    ids = calib.input_ids
    key = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:12]
    calib_path = CACHE / f"calib-{key}.npy"
    np.save(calib_path, ids.numpy())
    model_dir = None if a.no_peer else _dense_folder(base, tok, a.model)
    console.print(f"calibration: {calib.info['source']} {nsamples}x{a.seqlen} seed {a.seed} (sha {key}); "
                  f"eval: WikiText-2 test {nwindows}x512; threads {torch.get_num_threads()}; "
                  f"signround/autoround schedule {SIGNROUND}")

    records, rows = [], []
    for bare, factory, peer_method in all_cases:
        if bare not in wanted:
            continue
        name = prefix + bare
        ours_ppl = ours_s = None
        err = None
        if factory is None:
            ours_ppl = _ppl(base, tok, nwindows)
        else:
            m = copy.deepcopy(base)
            try:
                t0 = time.perf_counter()
                res = compress(m, factory(), ids, progress=False, measure_errors=False)
                ours_s = time.perf_counter() - t0
                ours_ppl = _ppl(m, tok, nwindows)
                bpw = res.summary()["avg_bits_per_weight"]
                if bpw is not None:
                    records.append(benchlib.record(name, "bits_per_weight", bpw))
                if res.fallbacks:
                    err = f"{len(res.fallbacks)} fallbacks: {res.fallbacks[0]}"
            except Exception as e:  # noqa: BLE001 - recorded, the bench goes on
                err = f"edgeprune failed: {type(e).__name__}: {e}"
            del m
            gc.collect()
        peer = {"ppl": None, "seconds": None, "error": None}
        if peer_method and not a.no_peer:
            peer = _peer_run(peer_method, model_dir, calib_path, key, nwindows, tok, a.fresh_peers,
                             a.peer_timeout, log, a.model, a.group_size)
        note = "; ".join(x for x in (err, peer.get("error") and f"{_peer_name(peer_method)}: {peer['error']}",
                                     peer.get("note")) if x)
        has_peer = bool(peer_method) and not a.no_peer
        pname = _peer_name(peer_method) if has_peer else None
        for metric, ours, theirs in (("ppl", ours_ppl, peer.get("ppl")),
                                     ("compress_s", ours_s, peer.get("seconds"))):
            if metric == "compress_s" and factory is None:
                continue
            records.append(benchlib.record(name, metric, ours, peer=pname,
                                           theirs=theirs if has_peer else None))
        if err:
            records.append(benchlib.error_record(name, err, peer=pname, side="ours"))
        if has_peer and peer.get("error"):
            records.append(benchlib.error_record(name, peer["error"], peer=pname))
        if has_peer and peer.get("note"):
            records.append(benchlib.note_record(name, peer["note"], peer=pname))
        rows.append((name, ours_ppl, peer.get("ppl"), ours_s, peer.get("seconds"), note, pname))
        console.print(f"[bold]{name}[/]: ppl {ours_ppl} / {peer.get('ppl')}  s {ours_s} / {peer.get('seconds')}"
                      + (f"  ({note})" if note else ""))
        if a.json:
            benchlib.write_records(a.json, records)

    def f(x, fmt="{:.2f}"):
        return "—" if x is None else fmt.format(x)

    t = Table(title=f"edgeprune vs {PEER} / auto-round — {a.model}, calib C4 {nsamples}x{a.seqlen}, "
                    f"WikiText-2 {nwindows}x512 (seconds: shared 2-core machine, noisy)")
    for col in ("case", "peer", "ppl ours", "ppl theirs", "ppl ratio", "s ours", "s theirs", "s ratio", "ok", "note"):
        t.add_column(col)
    for name, po, pt, so, st, note, pn in rows:
        pr = po / pt if po and pt else None
        sr = so / st if so and st else None
        ok = "—" if pr is None else ("yes" if pr <= 1.005 and (sr is None or sr <= 1.0) else "NO")
        t.add_row(name, pn if pt is not None else "—", f(po), f(pt), f(pr, "{:.3f}"), f(so, "{:.1f}"),
                  f(st, "{:.1f}"), f(sr, "{:.2f}"), ok, (note or "")[:80])
    console.print(t)
    _vs_ours(rows, records, console, Table, f, prefix, a.group_size)
    if a.json:
        benchlib.write_records(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
