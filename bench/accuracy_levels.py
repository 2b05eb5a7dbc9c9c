"""Per-projection ``MatMulNBits`` accuracy levels: one pass vs decode path, and their decode cost.

An int4 export's ``MatMulNBits`` nodes run at ``accuracy_level=4`` by default (int8
activations: the fast CPU kernel). The int8 quantization of the activations is not the same
for a ``[S, K]`` prefill and a ``[1, K]`` decode step, so the one-pass logits that
perplexity is computed from differ from what decoding computes (issue 29: argmax agreement
93.8 % on SmolLM2-135M's default export). Level 0 (fp32 activations) makes the two paths
agree but is slower. This bench exports one compressed checkpoint with several per-projection
overrides (``exporters.export_onnx(accuracy_levels=...)``, ``edgeprune export
--accuracy-level-for``) and measures, per setting:

* ``argmax_agree`` / ``max_abs_dlogit`` / ``kl_nats``: one pass vs decode path
  (``edgeprune.evaluation.decode_path.compare_paths``) on ``--tokens`` held-out tokens
  (the embedded held-out text, windows of ``--seqlen``);
* ``argmax_agree_{onepass,decode}_vs_exact``: each path against the all-level-0 export's
  one-pass logits (fp32 activations: the compute the PyTorch fake-quant model does), which
  says which path the int8 activations move;
* ``wikitext2_ppl`` (with ``--ppl-windows N``): one-pass perplexity of the export on
  WikiText-2 test, N x 512, no BOS (what ``edgeprune eval EXPORT --text`` reports);
* ``decode_tok_s_t{1,2}``: decode tokens/s (prompt 128, 128 new tokens, the profiler's
  isolated worker), settings interleaved round by round (``--rounds``), and the same-round
  ratio to the all-level-4 export (``ratio_vs_level4_t{n}``, median over rounds).

No peer runs here (``peer``/``theirs`` null). Timing figures are only meaningful on a quiet
machine; ``--skip-speed`` measures the agreement alone (valid under load).

Usage::

    .venv/bin/python bench/accuracy_levels.py --checkpoint runs/demo/checkpoint \\
        --json bench/results/accuracy_levels.json
    .venv/bin/python bench/accuracy_levels.py --quick --json /tmp/al.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import benchlib

#: name -> (default level, per-suffix overrides[, lm_head kind: fp | q8 (default) | int4])
SETTINGS: dict[str, tuple[int, dict]] = {
    "level4": (4, {}),
    "lm_head=0": (4, {"lm_head": 0}),
    "down_proj=0": (4, {"down_proj": 0}),
    "down_proj+lm_head=0": (4, {"down_proj": 0, "lm_head": 0}),
    "mlp=0": (4, {"down_proj": 0, "gate_proj": 0, "up_proj": 0}),
    "attn=0": (4, {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 0}),
    "v_proj=0": (4, {"v_proj": 0}),
    "decoder=0": (0, {"lm_head": 4}),
    "level0": (0, {}),
    "level0+fp_head": (0, {}, "fp"),
    "level4+fp_head": (4, {}, "fp"),
}
#: settings with the 8-bit lm_head at level 0: onnxruntime 1.32 has no fp32-compute 8-bit
#: kernel (~1.5 tok/s decode), so they are scored for agreement only, never timed
UNTIMED = {"lm_head=0", "down_proj+lm_head=0", "level0"}


def _export(ckpt: Path, out: Path, level: int, levels: dict, lm_head=None) -> Path:
    import edgeprune_exporters as exporters
    from edgeprune.cli.export import load_source

    if (out / "model.onnx").exists() and (out / "edgeprune.json").exists():
        return out
    model, tok, quantized, sparsity, prov = load_source(str(ckpt))
    exporters.export_onnx(model, tok, out, precision="int4", quantized=quantized or None,
                          accuracy_level=level, accuracy_levels=levels or None, lm_head=lm_head,
                          provenance=prov)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "settings level4, down_proj=0, level0; 256 tokens; 1 round at 1 thread")
    ap.add_argument("--checkpoint", default=None,
                    help="compressed checkpoint (default: build the best-w4 preset of SmolLM2-135M, "
                         "calibrated on the embedded text, into bench/.cache)")
    ap.add_argument("--settings", default=None, help="comma list of: " + ", ".join(SETTINGS))
    ap.add_argument("--tokens", type=int, default=None, help="held-out tokens scored (default 512)")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=None, help="speed rounds (default 4)")
    ap.add_argument("--threads", default="1,2", help="thread counts timed")
    ap.add_argument("--ppl-windows", type=int, default=0,
                    help="also score each export's WikiText-2 perplexity on N x 512 windows (0 = skip)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--work", default=None, help="export cache folder (default bench/.cache/accuracy_levels)")
    a = ap.parse_args(argv)

    import edgeprune_runtime as runtime
    from edgeprune.evaluate import eval_windows
    import numpy as np

    from edgeprune.evaluation.decode_path import compare_paths, decode_path_logits

    names = (a.settings or ("level4,down_proj=0,level0" if a.quick else ",".join(SETTINGS))).split(",")
    bad = [n for n in names if n not in SETTINGS]
    if bad:
        ap.error(f"unknown setting(s) {bad}; choose from {list(SETTINGS)}")
    if "level4" not in names:
        names.insert(0, "level4")
    ntok = a.tokens or (256 if a.quick else 512)
    rounds = a.rounds or (1 if a.quick else 4)
    threads = [1] if a.quick else [int(t) for t in a.threads.split(",")]
    work = Path(a.work or Path(__file__).resolve().parent / ".cache" / "accuracy_levels")
    work.mkdir(parents=True, exist_ok=True)

    ckpt = Path(a.checkpoint) if a.checkpoint else None
    if ckpt is None:
        ckpt = work / "checkpoint"
        from edgeprune.checkpoint import is_edgeprune_checkpoint
        if not (ckpt.is_dir() and is_edgeprune_checkpoint(ckpt)):
            print("building the best-w4 checkpoint of smollm2-135m (embedded calibration text)", flush=True)
            from edgeprune.pipeline import RunConfig, run_pipeline
            run_pipeline(RunConfig(calib="default", repeat=1, decode_windows=1, eval_nwindows=4),
                         work / "run", overwrite=True, export_dense=False)
            (work / "run" / "checkpoint").rename(ckpt)

    recs: list[dict] = []
    folders: dict[str, Path] = {}
    for n in names:
        t = time.perf_counter()
        folders[n] = _export(ckpt, work / ("onnx-" + n.replace("=", "")), *SETTINGS[n])
        print(f"export {n}: {time.perf_counter() - t:.0f} s", flush=True)

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    seqlen = min(a.seqlen, ntok)
    wins, _ = eval_windows(tok, None, seqlen=seqlen, nwindows=max(1, ntok // seqlen))
    wins = wins.numpy()
    # the exact-compute reference: the level-0 export's one-pass logits (fp32 activations;
    # one pass only: its 8-bit head at level 0 decodes too slowly to score token by token)
    ref = folders.get("level0") or _export(ckpt, work / "onnx-level0", *SETTINGS["level0"])
    with runtime.load(ref, threads=1) as s:
        exact = [s.logits(r[None])[0] for r in wins]
    for n in names:
        with runtime.load(folders[n], threads=1) as s:
            one = [s.logits(r[None])[0] for r in wins]
            dec = [decode_path_logits(s, r) for r in wins]
        pa = compare_paths(np.concatenate(one), np.concatenate(dec))
        line = (f"{n:24s} one pass vs decode: argmax {pa.argmax_agree:.4f}  max|dlogit| "
                f"{pa.max_abs_dlogit:.3f}  KL {pa.kl:.2e}  ({pa.ntokens} tokens)")
        recs += [benchlib.record(n, "argmax_agree", pa.argmax_agree),
                 benchlib.record(n, "max_abs_dlogit", pa.max_abs_dlogit),
                 benchlib.record(n, "kl_nats", pa.kl)]
        ex = np.concatenate(exact)
        for path, lg in (("onepass", one), ("decode", dec)):
            pe = compare_paths(ex, np.concatenate(lg))
            recs.append(benchlib.record(n, f"argmax_agree_{path}_vs_exact", pe.argmax_agree))
            line += f"  | {path} vs exact {pe.argmax_agree:.4f}"
        print(line, flush=True)

    if a.ppl_windows:
        from edgeprune.evaluate import perplexity
        from edgeprune.evaluation.backends import RuntimeModel
        for n in names:
            with runtime.load(folders[n]) as s:
                r = perplexity(RuntimeModel(s), tok, benchlib.WIKI, seqlen=512, nwindows=a.ppl_windows,
                               progress=False)
            recs.append(benchlib.record(n, "wikitext2_ppl", r.ppl))
            print(f"{n:24s} WikiText-2 perplexity {r.ppl:.3f} ({a.ppl_windows} x 512)", flush=True)

    if not a.skip_speed:
        from edgeprune_devices.profiler import profile
        for t in threads:
            timed = [n for n in names if n not in UNTIMED]
            speed: dict[str, list[float]] = {n: [] for n in timed}
            for r in range(rounds):
                for n in (timed if r % 2 == 0 else timed[::-1]):   # alternate the order per round
                    rep = profile(folders[n], "cpu-host", prompt_len=128, gen_len=128, repeat=2,
                                  targets=[], threads=t)
                    speed[n].append(rep.measured["decode_tok_s"]["median"])
                print(f"threads {t} round {r + 1}/{rounds}: "
                      + "  ".join(f"{n} {v[-1]:.1f}" for n, v in speed.items()), flush=True)
            for n in timed:
                ratios = [x / y for x, y in zip(speed[n], speed["level4"])]
                recs += [benchlib.record(n, f"decode_tok_s_t{t}", statistics.median(speed[n])),
                         benchlib.record(n, f"ratio_vs_level4_t{t}", statistics.median(ratios))]
                print(f"threads {t} {n:24s} {statistics.median(speed[n]):6.1f} tok/s  "
                      f"{statistics.median(ratios):.3f}x level4", flush=True)
    if a.json:
        benchlib.write_records(a.json, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
