"""IG-Pruning (issue 26): static vs input-guided depth pruning, quality and decode speed.

For each model (``--models``, default SmolLM2-135M-Instruct) and skip ratio
(0.125 / 0.25 / 0.375 of the ``2L`` attention/MLP sub-blocks), three specs calibrated on the
same windows (``edgeprune.igprune.calibrate_all``):

* ``angular``: ShortGPT Block Influence (Men et al. 2024), one static mask;
* ``l0``: the best single Hard-Concrete / L0 mask (Louizos et al. 2018), static;
* ``ig``: IG-Pruning (Qiao, Zhang, Feng; EMNLP 2025): K-means of the prompts' early-layer
  embeddings (K from the sweep ``--ks``, chosen by silhouette), one L0 mask per cluster,
  routed per prompt / window.

Quality (PyTorch, ``IgPruneSpec.reference``, each window / task context routed by its own
first tokens; the unit tests prove the ONNX graph computes the same): WikiText-2 test
perplexity (no BOS), per-language perplexity on NTREX-128 (``../shared/data/multilingual/
ntrex128/``, first ``--lang-lines`` lines), KL(dense || pruned) on the WikiText-2 windows,
zero-shot accuracy through lm-eval on the local task data (PIQA, ARC-Easy, HellaSwag, BoolQ;
``--limit`` items each).

Speed (ONNX runtime, at skip ratio 0.25 or ``--speed-ratio``): one IG-Pruning export (a
plain graph with a per-request mask) and the plain dense export, fp32 (and int4 with
``--int4``): decode tokens/s of the dense export, of the IG graph routed (router included:
``router_ms`` and the time to first token hold it), of the IG graph with the all-ones mask
(the cost of the ``If`` gates) and with each static mask; KV bytes at the generation's
length per mask; the ideal speed-up = a decode step's weight bytes / the bytes left after
skipping (embedding row and norms ignored; lm_head included).

Calibration: ``--nsamples`` windows of ``--seqlen`` tokens from each of: English Wikipedia
(``wikipedia/exllamav2_wiki.utf8``), C4 validation, and NTREX-128 lines from 1000 on in
each of its languages (the evaluation reads the first ``--lang-lines`` lines), so the
clusters have different kinds of text to find. No peer tool implements IG-Pruning:
``peer`` / ``theirs`` are null.

Usage::

    .venv/bin/python bench/igpruning.py --json bench/results/igpruning.json
    .venv/bin/python bench/igpruning.py --quick --json /tmp/ig.json

``--quick``: skip ratio 0.25 only, 3 x 128-token calibration windows per source, 15
training steps per mask, 4 WikiText-2 windows of 256, 30 lines per language, 8 items per
task, 24 decode tokens once, fp32 only.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import benchlib
from benchlib import C4, SHARED, WIKI

NTREX = SHARED / "data" / "multilingual" / "ntrex128"
WIKIPEDIA = SHARED / "data" / "wikipedia" / "exllamav2_wiki.utf8"
TASK_DATA = SHARED / "data" / "tasks"
TASKS = "piqa,arc_easy,hellaswag,boolq"


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def rec(records, case, metric, value):
    records.append(benchlib.record(case, metric, None if value is None else float(value)))


# ------------------------------------------------------------------------------ calibration
def calibration_windows(tok, nsamples: int, seqlen: int, seed: int = 0) -> tuple[torch.Tensor, list]:
    """``nsamples`` windows per source (Wikipedia, C4, each NTREX language from line 1000),
    ``int64 [sources * nsamples, seqlen]``, and the source of each window."""
    import pyarrow.parquet as pq

    from edgeprune.calibration import token_stream

    docs = {"wikipedia": [WIKIPEDIA.read_text(encoding="utf-8")[:400_000]],
            "c4": [t for t in pq.read_table(C4).column("text").to_pylist()[:400]]}
    for f in sorted(NTREX.glob("newstest2019-*.txt")):
        docs["ntrex-" + f.stem.split(".")[-1]] = ["\n".join(f.read_text(encoding="utf-8").splitlines()[1000:])]
    rng = np.random.default_rng(seed)
    wins, src = [], []
    for name, d in docs.items():
        ids = token_stream(tok, d, max_tokens=seqlen * nsamples * 8)
        starts = rng.choice(max(1, len(ids) - seqlen), size=nsamples, replace=False)
        wins += [ids[s:s + seqlen] for s in sorted(starts)]
        src += [name] * nsamples
    return torch.tensor(wins, dtype=torch.long), src


def spec_path(folder: Path, alias: str, ratio: float, method: str) -> Path:
    return Path(folder) / f"{alias}-skip{ratio:g}-{method}.safetensors"


def save_specs(specs: dict, folder: Path, alias: str, ratio: float) -> None:
    """Write each ``{method: IgPruneSpec}`` to :func:`spec_path` (what ``--skip-quality``
    reads, so the speed is measured on the specs whose quality was measured)."""
    from edgeprune.variants import save_spec

    Path(folder).mkdir(parents=True, exist_ok=True)
    for m, spec in specs.items():
        save_spec(spec, spec_path(folder, alias, ratio, m))


def saved_specs(folder: Path, alias: str, ratio: float):
    """``{method: IgPruneSpec}`` from :func:`save_specs`, or None when one is missing."""
    from edgeprune.igprune import METHODS, IgPruneSpec
    from edgeprune.variants import load_spec

    paths = {m: spec_path(folder, alias, ratio, m) for m in METHODS}
    if not all(p.is_file() for p in paths.values()):
        log(f"{alias} skip {ratio:g}: no saved specs in {folder}, calibrating")
        return None
    log(f"{alias} skip {ratio:g}: specs from {folder}")
    return {m: load_spec(p, IgPruneSpec) for m, p in paths.items()}


# ------------------------------------------------------------------------------ quality
def quality(model, tok, spec, wiki, langs, dense, a, limit) -> dict:
    """Figures of ``model`` under ``spec`` (None: dense)."""
    import contextlib

    from edgeprune.evaluation.languages import language_perplexity
    from edgeprune.evaluation.tasks import run_tasks
    from edgeprune.igprune.evaluation import window_metrics

    out = {}
    small = wiki.numel() * model.config.vocab_size * 4 <= 600 * 2 ** 20   # keep the dense log-probs
    w = window_metrics(model, spec, wiki, None if dense is None else dense["logp"],
                       keep_logp=spec is None and small)
    out.update(wikitext2_ppl=w["ppl"], kl_nats=w["kl_nats"], logp=w["logp"], routes=w["routes"])
    ctx = spec.reference(model) if spec is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        lp = language_perplexity(model, tok, langs, lines=a.lang_lines, seqlen=a.lang_seqlen,
                                 progress=False)
        out["lang"] = {c: r.ppl for c, r in lp.items()}
        if limit:
            tr = run_tasks(model, tok, a.tasks, limit=limit, task_data=TASK_DATA, progress=False)
            out["tasks"] = {t: r.acc for t, r in tr.tasks.items()}
    return out


def quality_records(records, case, q):
    rec(records, case, "wikitext2_ppl", q["wikitext2_ppl"])
    rec(records, case, "kl_nats", q["kl_nats"])
    for c, v in q["lang"].items():
        rec(records, case, f"ppl_{c}", v)
    rec(records, case, "ppl_lang_mean", statistics.fmean(q["lang"].values()))
    for t, v in (q.get("tasks") or {}).items():
        rec(records, case, f"acc_{t}", v)
    if q.get("tasks"):
        rec(records, case, "acc_task_mean", statistics.fmean(v for v in q["tasks"].values() if v is not None))


# ------------------------------------------------------------------------------ speed
def step_weight_bytes(model, item: float) -> tuple[float, list]:
    """``(bytes of weights a decode step reads, [bytes of each of the 2L sub-blocks])``:
    the sub-blocks' linears plus lm_head (``item`` bytes per weight)."""
    subs = []
    for lay in model.model.layers:
        subs.append(sum(p.numel() for p in lay.self_attn.parameters()) * item)
        subs.append(sum(p.numel() for p in lay.mlp.parameters()) * item)
    head = model.lm_head.weight.numel() * item
    return sum(subs) + head, subs


def speed(records, case_prefix, model, tok, specs, a, workdir: Path, precision: str):
    """Export the ``ig`` spec and the dense plain graph at ``precision``; decode speeds."""
    import edgeprune_runtime as runtime
    from edgeprune_exporters import export_onnx

    ig = specs["ig"]
    item = 4.0 if precision == "fp32" else 0.5 + 4.5 / 32     # int4: codes + scale/zero per block of 32
    total, subs = step_weight_bytes(model, item)
    folders = {}
    # the IG export is named by its spec (masks and centroids): a re-calibrated spec gets a new one
    tag = hashlib.sha256(repr(ig.masks).encode() + ig.centroids.tobytes()).hexdigest()[:10]
    for name, variants in (("dense", None), ("ig", [ig])):
        out = workdir / (f"{name}-{precision}" if variants is None else f"{name}-{tag}-{precision}")
        if not out.exists():
            log(f"export {name} {precision}")
            export_onnx(model, tok, out, precision=precision, graph="plain", variants=variants,
                        max_length=512, group_size=32, overwrite=True)
        folders[name] = out
    text = WIKI.read_text(encoding="utf-8")[5000:9000]
    prompt = tok(text)["input_ids"][:a.prompt_len]
    L2 = 2 * model.config.num_hidden_layers
    cases = {"dense": (folders["dense"], None), "ig-ones": (folders["ig"], [1] * L2),
             "ig-routed": (folders["ig"], "route")}
    for m in ("angular", "l0"):
        cases[f"{m}"] = (folders["ig"], specs[m].masks[0])
    sessions = {}
    for name, (folder, _) in cases.items():
        if folder not in sessions:
            sessions[folder] = runtime.load(folder, threads=a.threads)
            sessions[folder].eos_token_ids = []
    times = {n: [] for n in cases}
    info = {}
    for _ in range(a.repeat):                 # interleaved rounds: the machine is shared
        for name, (folder, mask) in cases.items():
            s = sessions[folder]
            if mask is None or mask == "route":
                r = s.generate(prompt, max_new_tokens=a.new_tokens)
            else:
                with s.using_mask(mask):
                    r = s.generate(prompt, max_new_tokens=a.new_tokens)
            times[name].append(r.decode_tok_s)
            info[name] = (r.ttft_ms, getattr(s, "last_route", None), getattr(s, "current_mask", None))
    base = statistics.median(times["dense"])
    length = len(prompt) + a.new_tokens
    for name in cases:
        case = f"{case_prefix}/{name}-{precision}"
        tps = statistics.median(times[name])
        rec(records, case, "decode_tok_s", tps)
        rec(records, case, "decode_speedup_vs_dense", tps / base)
        rec(records, case, "ttft_ms", info[name][0])
        s, mask = sessions[cases[name][0]], info[name][2]
        if name == "dense":
            rec(records, case, "kv_bytes", sum(s.kv_cache_bytes(length).values()))
            continue
        rt = info[name][1] or {}
        rec(records, case, "router_ms", rt.get("router_ms"))
        rec(records, case, "kv_bytes", sum(s.kv_cache_bytes(length, mask=mask).values()))
        skipped = sum(b for b, k in zip(subs, mask) if not k)
        rec(records, case, "ideal_speedup", total / (total - skipped))
        rec(records, case, "skipped_weight_fraction", skipped / total)
    for s in sessions.values():
        s.close()


# ------------------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "skip ratio 0.25, small calibration and evaluation, fp32 speed once")
    ap.add_argument("--models", default="smollm2-135m", help="comma-separated aliases")
    ap.add_argument("--ratios", default=None, help="skip ratios (0.125,0.25,0.375)")
    ap.add_argument("--ks", default="2,3,4")
    ap.add_argument("--no-refine", action="store_true",
                    help="the paper's independent per-cluster masks (default: refined from the single "
                         "L0 mask, the lowest-KL candidate kept per cluster; calibrate_all(refine=))")
    ap.add_argument("--steps", type=int, default=None, help="Hard-Concrete steps per mask (60)")
    ap.add_argument("--nsamples", type=int, default=None, help="calibration windows per source (8)")
    ap.add_argument("--seqlen", type=int, default=None, help="calibration window (256)")
    ap.add_argument("--nwindows", type=int, default=None, help="WikiText-2 windows (20)")
    ap.add_argument("--eval-seqlen", type=int, default=None, help="WikiText-2 window (512)")
    ap.add_argument("--lang-lines", type=int, default=None, help="lines per language (200)")
    ap.add_argument("--lang-seqlen", type=int, default=256)
    ap.add_argument("--tasks", default=TASKS)
    ap.add_argument("--limit", type=int, default=None, help="items per task (100; 0: no tasks)")
    ap.add_argument("--speed-ratio", type=float, default=0.25)
    ap.add_argument("--int4", action="store_true", help="also time int4 exports")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=None, help="interleaved timing rounds (3)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decode tokens (64)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-quality", action="store_true",
                    help="speed only, with the specs a quality run saved in --specs (calibrated "
                         "afresh when none are there)")
    ap.add_argument("--specs", type=Path, default=benchlib.CACHE / "igpruning" / "specs",
                    help="folder of the calibrated specs (<alias>-skip<ratio>-<method>.safetensors): "
                         "every calibration writes them, --skip-quality reads them")
    ap.add_argument("--machine", default="a shared 2-core host under load (timings not valid)",
                    help="what the timings were measured on, noted in the records")
    ap.add_argument("--workdir", type=Path, default=benchlib.CACHE / "igpruning")
    a = ap.parse_args(argv)
    q = a.quick
    ratios = [float(r) for r in (a.ratios or ("0.25" if q else "0.125,0.25,0.375")).split(",")]
    steps = a.steps or (15 if q else 60)
    nsamples, seqlen = a.nsamples or (3 if q else 8), a.seqlen or (128 if q else 256)
    nwin, eseq = a.nwindows or (4 if q else 20), a.eval_seqlen or (256 if q else 512)
    a.lang_lines = a.lang_lines or (30 if q else 200)
    limit = a.limit if a.limit is not None else (8 if q else 100)
    a.repeat = a.repeat or (1 if q else 3)
    a.new_tokens = a.new_tokens or (24 if q else 64)
    ks = tuple(int(k) for k in a.ks.split(","))
    torch.set_num_threads(a.threads)

    from edgeprune.evaluation import eval_windows
    from edgeprune.evaluation.languages import load_languages
    from edgeprune.igprune import calibrate_all
    from edgeprune.models import load_model

    records: list = []

    def flush():
        if a.json:
            benchlib.write_records(a.json, records)

    langs = load_languages(str(NTREX))
    for alias in a.models.split(","):
        t0 = time.perf_counter()
        model, tok = load_model(alias)
        model = model.float().eval()
        calib, src = calibration_windows(tok, nsamples, seqlen)
        wiki, _ = eval_windows(tok, WIKI, seqlen=eseq, nwindows=nwin)
        log(f"{alias}: {len(calib)} calibration windows, {len(wiki)} WikiText-2 windows")
        if not a.skip_quality:
            dense = quality(model, tok, None, wiki, langs, None, a, limit)
            quality_records(records, f"{alias}/dense", dense)
            flush()
        for ratio in ratios:
            t = time.perf_counter()
            case = f"{alias}/skip{ratio:g}"
            specs = saved_specs(a.specs, alias, ratio) if a.skip_quality else None
            if specs is None:
                specs = calibrate_all(model, calib, ratio, ks=ks, steps=steps, refine=not a.no_refine,
                                      progress=True)
                save_specs(specs, a.specs, alias, ratio)
                rec(records, f"{case}/ig", "calibration_s", time.perf_counter() - t)
            ig = specs["ig"]
            rec(records, f"{case}/ig", "k", ig.settings["k"])
            routes = ig.route(model, calib).tolist()
            by_src = {s: sorted({r for r, s2 in zip(routes, src) if s2 == s}) for s in dict.fromkeys(src)}
            records.append(benchlib.note_record(f"{case}/ig", f"K sweep {ig.settings['k_sweep']}; "
                                                f"clusters by calibration source {by_src}; masks {ig.masks}"))
            for m in ("angular", "l0"):
                records.append(benchlib.note_record(f"{case}/{m}", f"mask {specs[m].masks[0]}"))
            for m, spec in specs.items():
                if a.skip_quality:
                    break
                log(f"{case}/{m}: quality")
                qm = quality(model, tok, spec, wiki, langs, dense, a, limit)
                quality_records(records, f"{case}/{m}", qm)
                if m == "ig":
                    rec(records, f"{case}/ig", "wikitext2_windows_per_mask",
                        max(np.bincount(qm["routes"], minlength=len(spec.masks))))
                flush()
            if not a.skip_speed and abs(ratio - a.speed_ratio) < 1e-9:
                log(f"{case}: speed")
                for prec in ("fp32", "int4") if a.int4 else ("fp32",):
                    speed(records, case, model, tok, specs, a, a.workdir / alias / f"{ratio:g}", prec)
                    flush()
        records.append(benchlib.note_record(alias, f"machine: {a.machine}; {a.threads} thread(s); "
                                            f"model total {time.perf_counter() - t0:.0f} s"))
        flush()
    for r in records:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
