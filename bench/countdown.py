"""COUNTDOWN (issue 6) on SmolLM2-135M-Instruct: quality and measured CPU decode speed.

For M- and D-COUNTDOWN at act-sparsity 0 / 0.5 / 0.7 / 0.9:

* **quality** (teacher-forced, the filter applied at every position): WikiText-2 test
  perplexity (no BOS, ``--nwindows`` windows of 512), KL(dense || filtered) and top-1
  agreement vs the same model unfiltered. fp32 cases use the exact PyTorch reference
  (``edgeprune.countdown.apply_reference``; the unit tests prove the ONNX sparse graph
  gives the same logits and gathers the same rows). ``-int4`` cases score the exported
  always-sparse int4 ONNX graph against the unfiltered int4 export (RTN asym, the
  exporter's default group size, 64 since it was made explicit), so the
  row-granular int4 layout (GatherBlockQuantized, down^T re-quantized along hidden) is
  included in the figure.
* **speed**: decode tokens/s of the COUNTDOWN export (``graph_mode="if"``: dense prefill,
  sparse decode) over the plain ``exporters.export_onnx`` export of the same precision,
  same threads (1 and 2), runs interleaved (dense, filtered, dense, filtered...) and
  medians taken, because the 2-core machine is shared and timings are noisy. Case names
  carry the thread count (``d-0.7-t1``). ``mlp_bytes_fraction`` is measured from the
  graph's ``countdown_kept`` output (rows kept per layer per decode step).
* **If vs two graphs**: for ``d-0.7`` the prefill and decode speed of the ``If`` graph vs
  an always-sparse graph (``-graphs`` case): why prefill runs dense.

Calibration: ``--nsamples`` x ``--seqlen`` windows of C4 validation
(``edgeprune.calibration``), thresholds = median of per-token k-th smallest |score|.
No peer tool implements COUNTDOWN, so ``peer``/``theirs`` are null.

Usage::

    .venv/bin/python bench/countdown.py --json bench/results/countdown.json
    .venv/bin/python bench/countdown.py --quick --json /tmp/cd.json

``--quick``: 4 x 256 calibration windows, act-sparsity 0.7 only, 2 evaluation windows, 1
thread, speed for the filtered cases only (no ``m-0`` / ``d-0`` graphs), int4 for ``d-0.7``
only: 7 exports of the 135M model (4 fp32, 3 int4), the bulk of its time; 6-10 minutes
on 2 cores, more on a loaded machine. Metrics carry units (``kl_nats``, ``decode_tok_s``).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import benchlib
from benchlib import C4, WIKI


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def rec(records, case, metric, value):
    records.append(benchlib.record(case, metric, None if value is None else float(value)))


def _onnx_logits(folder, threads):
    import edgeprune_runtime as runtime
    s = runtime.load(folder, threads=threads)

    def fn(ids):
        return torch.from_numpy(s.logits(ids.numpy()))
    return fn, s


def _decode_speed(folder, threads, prompt, new, countdown_session=False):
    """Load once; returns a callable doing one timed generation -> (tok/s, report)."""
    import edgeprune_runtime as runtime
    s = benchlib.load_countdown(folder, threads) if countdown_session else \
        runtime.load(folder, threads=threads)
    s.eos_token_ids = []
    s.generate(prompt[:8], max_new_tokens=4)           # warm-up

    def run():
        r = s.generate(prompt, max_new_tokens=new)
        rep = s.mlp_read_report() if countdown_session else None
        return r.decode_tok_s, r.prefill_tok_s, rep
    return run, s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "act-sparsity 0.7, 2 windows, 1 thread, filtered speed cases "
                                 "and d-0.7 int4 only")
    ap.add_argument("--nwindows", type=int, default=None, help="WikiText-2 windows (40)")
    ap.add_argument("--nsamples", type=int, default=None)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8192,
                    help="calibration tokens per layer (D trains its predictor on them)")
    ap.add_argument("--channel-scale", default="gate_down",
                    help="M score: gate_down (|up * E|act(gate)| * ||W_down col|||) | none (paper)")
    ap.add_argument("--threshold-rule", default="pooled", help="pooled | median")
    ap.add_argument("--predictor", default="q4",
                    help="D predictor: q4 (4-bit copy of gate/up) | lowrank (rank --rank)")
    ap.add_argument("--train-epochs", type=int, default=None,
                    help="D predictor training epochs (default edgeprune's; 0 = closed form)")
    ap.add_argument("--sparsities", default=None, help="e.g. 0.5,0.7,0.9")
    ap.add_argument("--modes", default="m,d")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=None, help="interleaved timing rounds")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--int4", default=None, help="cases also run int4, e.g. m-0.5,d-0.7 "
                                                 "('all', 'none')")
    ap.add_argument("--allocation", default="uniform",
                    help="per-layer sparsity allocation: uniform (paper) | greedy | both "
                         "(greedy cases are suffixed -greedy; speed only for uniform)")
    ap.add_argument("--spec-cache", default=None, help="folder to save/reuse calibrated specs")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    quick = a.quick
    nwin = a.nwindows or (2 if quick else 40)
    nsamples = a.nsamples or (4 if quick else 16)
    sps = [float(x) for x in (a.sparsities or ("0.7" if quick else "0.5,0.7,0.9")).split(",")]
    modes = a.modes.split(",")
    threads = [int(t) for t in a.threads.split(",")]
    repeat = a.repeat or (2 if quick else 3)
    if quick and a.threads == "1,2":
        threads = [1]
    int4_cases = a.int4 if a.int4 is not None else ("d-0.7" if quick else "m-0.5,d-0.7")
    torch.set_num_threads(max(threads))

    from edgeprune.calibration import build_calibration
    from edgeprune.countdown import calibrate_many, evaluate_many
    from edgeprune.evaluate import fidelity
    from edgeprune.models import load_model
    from edgeprune_exporters import export_onnx

    records: list = []
    t_all = time.time()
    model, tok = load_model("smollm2-135m")
    cal = build_calibration(tok, C4 if C4.exists() else None, nsamples=nsamples,
                            seqlen=a.seqlen, seed=0)
    log(f"calibration {cal.info.get('source')} {nsamples}x{a.seqlen}")
    specs = {}
    allocs = ["uniform", "greedy"] if a.allocation == "both" else [a.allocation]
    from edgeprune.countdown import CountdownSpec
    cache = Path(a.spec_cache) if a.spec_cache else None
    from edgeprune.countdown import DEFAULT_TRAIN_EPOCHS
    ep = DEFAULT_TRAIN_EPOCHS if a.train_epochs is None else a.train_epochs
    key = (f"n{nsamples}-s{a.seqlen}-t{a.max_tokens}-{a.channel_scale}-{a.threshold_rule}-"
           + (f"lowrank-r{a.rank}-e{ep}" if a.predictor == "lowrank" else a.predictor))
    for mode in modes:
        for alloc in allocs:
            sfx = "" if alloc == "uniform" else "-greedy"
            want = ([0.0] if alloc == "uniform" else []) + sps
            # a spec file, or a spec folder cached before the variant registry
            cached = lambda s: next((p for p in (cache / key / f"{mode}-{s:g}{sfx}.safetensors",  # noqa: E731
                                                 cache / key / f"{mode}-{s:g}{sfx}") if p.exists()), None)
            if cache is not None and all(cached(s) for s in want):
                for s in want:
                    specs[f"{mode}-{s:g}{sfx}"] = CountdownSpec.load(cached(s))
                log(f"loaded {mode} ({alloc}) specs from {cache / key}")
                continue
            t0 = time.time()
            got = calibrate_many(model, cal.input_ids, ([0.0] if alloc == "uniform" else []) + sps,
                                 mode, rank=a.rank, allocation=alloc, max_tokens=a.max_tokens,
                                 channel_scale=a.channel_scale, threshold_rule=a.threshold_rule,
                                 train_epochs=ep, predictor=a.predictor)
            for s, sp in zip(want, got):
                specs[f"{mode}-{s:g}{sfx}"] = sp
                if cache is not None:
                    sp.save(cache / key / f"{mode}-{s:g}{sfx}.safetensors")
            log(f"calibrated {mode} ({alloc}) in {time.time() - t0:.0f}s")
    for name, sp in specs.items():
        st = sp.stats
        if sp.act_sparsity == 0:
            continue
        rec(records, name, "calib_realised_act_sparsity", st["realised_sparsity_mean"])
        rec(records, name, "calib_recall_top_coefs", st["recall_top_mean"])
        rec(records, name, "calib_coef_l1_kept", st["coef_l1_kept_mean"])
        if sp.mode == "d":
            rec(records, name, "predictor_bytes_per_layer", st["predictor_bytes_per_layer"])
            rec(records, name, "predictor_fraction_of_mlp_bytes", st["predictor_fraction_of_mlp"])
    wd = Path(a.workdir or tempfile.mkdtemp(prefix="countdown-bench-"))
    wd.mkdir(parents=True, exist_ok=True)

    def flush():
        if a.json:
            benchlib.write_records(a.json, records)

    # ------------------------------------------------------------------ quality fp32
    if not a.skip_quality:
        names = [n for n in specs if specs[n].act_sparsity > 0]
        t0 = time.time()
        res = evaluate_many(model, tok, [specs[n] for n in names], WIKI, seqlen=512,
                            nwindows=nwin)
        log(f"quality fp32 ({nwin} windows) in {time.time() - t0:.0f}s")
        ppl_dense = res[0]["ppl_dense"]
        for m in modes:
            rec(records, f"{m}-0", "ppl", ppl_dense)
            rec(records, f"{m}-0", "ppl_increase_pct", 0.0)
            rec(records, f"{m}-0", "kl_nats", 0.0)
            rec(records, f"{m}-0", "top1_agree", 1.0)
        for n, r in zip(names, res):
            for k in ("ppl", "ppl_increase_pct", "kl", "top1_agree"):
                rec(records, n, "kl_nats" if k == "kl" else k, r[k])
            rec(records, n, "realised_act_sparsity", r["realised_sparsity"])
            rec(records, n, "recall_top_coefs", r["recall_top"])
            log(f"{n:8s} ppl {r['ppl']:.3f} (dense {r['ppl_dense']:.3f}, "
                f"{r['ppl_increase_pct']:+.1f}%) KL {r['kl']:.4f} top1 {r['top1_agree']:.3f} "
                f"skipped {r['realised_sparsity']:.3f} recall {r['recall_top']:.3f}")
        flush()

    prompt = None
    if not a.skip_speed:
        from edgeprune.evaluate import resolve_text
        txt, _ = resolve_text(WIKI)
        prompt = tok(txt[:20000], add_special_tokens=False)["input_ids"][:a.prompt_len]

    def speed_cases(precision, case_names, suffix):
        dense_dir = wd / f"dense-{precision}"
        if not dense_dir.exists():
            export_onnx(model, tok, dense_dir, precision=precision, max_length=1024,
                        validate=False, overwrite=True)
        dense_runs = {t: _decode_speed(dense_dir, t, prompt, a.new_tokens) for t in threads}
        for n in case_names:
            d = wd / f"{n}-{precision}"
            t0 = time.time()
            export_onnx(model, tok, d, variants=[(specs[n], {"graph_mode": "if"})],
                        precision=precision, max_length=1024, validate=False, overwrite=True)
            log(f"exported {n} {precision} in {time.time() - t0:.0f}s")
            for t in threads:
                run_c, sess_c = _decode_speed(d, t, prompt, a.new_tokens, countdown_session=True)
                run_d = dense_runs[t][0]
                dd, cc, frac, kept = [], [], [], []
                for _ in range(repeat):
                    dd.append(run_d()[0])
                    tc, _, rep = run_c()
                    cc.append(tc)
                    frac.append(rep["mlp_bytes_fraction"])
                    kept.append(rep["kept_fraction_mean"])
                md, mc = statistics.median(dd), statistics.median(cc)
                case = f"{n}{suffix}-t{t}"
                rec(records, case, "decode_tok_s", mc)
                rec(records, case, "decode_tok_s_unfiltered", md)
                rec(records, case, "speedup", mc / md)
                rec(records, case, "mlp_bytes_fraction_measured", statistics.mean(frac))
                rec(records, case, "decode_realised_act_sparsity", 1 - statistics.mean(kept))
                log(f"{case:14s} decode {mc:6.1f} tok/s vs unfiltered {md:6.1f} -> "
                    f"x{mc / md:.2f}  (runs {[round(x, 1) for x in cc]} vs "
                    f"{[round(x, 1) for x in dd]}); MLP bytes read {statistics.mean(frac):.3f}, "
                    f"decode act-sparsity {1 - statistics.mean(kept):.3f}")
                sess_c.close()
                del run_c, sess_c
                gc.collect()
            flush()
            if n != "d-0.7" or precision != "fp32":
                shutil.rmtree(d, ignore_errors=True)
        for t, (_, s) in dense_runs.items():
            s.close()
        return dense_dir

    if not a.skip_speed:
        names = [n for n in specs if not n.endswith("-greedy")
                 and not (quick and specs[n].act_sparsity == 0)]
        speed_cases("fp32", names, "")
        # If vs always-sparse: prefill and decode of d-0.7
        if "d-0.7" in specs:
            d_if = wd / "d-0.7-fp32"
            d_sp = wd / "d-0.7-sparse-fp32"
            export_onnx(model, tok, d_sp, variants=[(specs["d-0.7"], {"graph_mode": "sparse"})],
                        precision="fp32", max_length=1024, validate=False, overwrite=True)
            long_prompt = (prompt * 8)[:256]
            for t in threads:
                ri, si = _decode_speed(d_if, t, long_prompt, 16)
                rs, ss = _decode_speed(d_sp, t, long_prompt, 16)
                pi, ps, di, ds = [], [], [], []
                for _ in range(repeat):
                    x = ri()
                    di.append(x[0])
                    pi.append(x[1])
                    x = rs()
                    ds.append(x[0])
                    ps.append(x[1])
                case = f"d-0.7-graphs-t{t}"
                rec(records, case, "prefill_tok_s_if_dense_prefill", statistics.median(pi))
                rec(records, case, "prefill_tok_s_always_sparse", statistics.median(ps))
                rec(records, case, "decode_tok_s_if", statistics.median(di))
                rec(records, case, "decode_tok_s_always_sparse", statistics.median(ds))
                log(f"{case}: prefill(256) If/dense {statistics.median(pi):.0f} tok/s vs "
                    f"always-sparse {statistics.median(ps):.0f}; decode If "
                    f"{statistics.median(di):.1f} vs always-sparse {statistics.median(ds):.1f}")
                si.close()
                ss.close()
            shutil.rmtree(d_sp, ignore_errors=True)
            shutil.rmtree(d_if, ignore_errors=True)
            flush()

    # ------------------------------------------------------------------ int4
    i4 = [] if int4_cases in ("none", "") else (
        [n for n in specs if specs[n].act_sparsity > 0] if int4_cases == "all"
        else int4_cases.split(","))
    i4 = [n for n in i4 if n in specs]
    if i4:
        if not a.skip_quality:
            dq = wd / "dense-int4"
            export_onnx(model, tok, dq, precision="int4", max_length=1024, validate=False,
                        overwrite=True)
            fd, sd = _onnx_logits(dq, max(threads))
            for n in i4:
                d = wd / f"{n}-sparse-int4"
                export_onnx(model, tok, d, variants=[(specs[n], {"graph_mode": "sparse"})],
                            precision="int4", max_length=1024, validate=False, overwrite=True)
                fm, sm = _onnx_logits(d, max(threads))
                t0 = time.time()
                nq = max(2, nwin // 8) if not quick else 2
                r = fidelity(fd, fm, tok, WIKI, seqlen=512, nwindows=nq, progress=False)
                case = f"{n}-int4"
                rec(records, case, "ppl", r.ppl)
                rec(records, case, "ppl_unfiltered_int4", r.ppl_dense)
                rec(records, case, "ppl_increase_pct", 100 * (r.ppl / r.ppl_dense - 1))
                rec(records, case, "kl_nats", r.kl)
                rec(records, case, "top1_agree", r.top1_agree)
                rec(records, case, "nwindows", nq)
                log(f"{case}: ppl {r.ppl:.3f} vs int4 unfiltered {r.ppl_dense:.3f} "
                    f"({100 * (r.ppl / r.ppl_dense - 1):+.1f}%), KL {r.kl:.4f}, "
                    f"top1 {r.top1_agree:.3f} [{nq} windows, ONNX, {time.time() - t0:.0f}s]")
                sm.close()
                shutil.rmtree(d, ignore_errors=True)
                flush()
            sd.close()
        if not a.skip_speed:
            speed_cases("int4", i4, "-int4")
    rec(records, "all", "bench_seconds", time.time() - t_all)
    flush()
    shutil.rmtree(wd, ignore_errors=True)
    log(f"done in {time.time() - t_all:.0f}s")
    return records


if __name__ == "__main__":
    main()
