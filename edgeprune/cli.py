"""The ``edgeprune`` command line (click). It parses options and calls the Python API.

Verbs: ``run`` (the main job), ``compress``, ``eval``, ``export``, ``generate``,
``profile``, ``devices``. Every verb that measures something takes ``--json PATH``.
Errors print one line (``error: ... (fix: ...)``) and exit with code 2; nothing
half-written is left behind.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

import click

from runtime.errors import EdgePruneError, ConfigError

METHODS = ["magnitude", "wanda", "sparsegpt", "rtn", "gptq", "awq"]


def _console():
    from rich.console import Console

    # markup off: paths, model names and protocol labels such as "[heldout]" print as they
    # are (rich read them as style tags, dropped them, or raised MarkupError on "[/x]")
    con = Console(stderr=False, highlight=False, markup=False)
    if not con.is_terminal:        # piped / redirected: no 80-column wrapping of tables
        con = Console(stderr=False, highlight=False, markup=False, width=200)
    return con


def _write_json(path: Optional[str], data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temporary file, then rename)."""
    from runtime.profiler import _atomic_write

    if path:
        _atomic_write(Path(path), json.dumps(_finite(data), indent=2, default=str).encode())


def _finite(x):
    """``x`` with non-finite floats as the strings ``"inf"``, ``"-inf"``, ``"nan"`` (strict
    JSON has no NaN / Infinity; json.dumps would write them anyway)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _check_output(path: Optional[str], flag: str, inputs=(), folder: bool = False) -> None:
    """Refuse, before any work, an output path (``--json`` file, ``--out`` folder the
    command adds files to) that is or lies in an input folder (or is an input file), has
    the wrong kind (a folder for a file, a file for a folder), or whose nearest existing
    parent cannot take a new file (a file, read-only, ``/proc``): probed with an unnamed
    temporary file. The path is checked as given, as the writers use it (a quoted ``~``
    is a folder named ``~``, not the home folder).

    Raises:
        ConfigError: naming the flag, the path and the fix.
    """
    import tempfile

    if not path:
        return
    p = Path(path).resolve()
    for src in inputs:
        if not src or not Path(src).exists():
            continue          # a model alias, or an input the command reports itself
        src = Path(src).resolve()
        if p == src or (src.is_dir() and src in p.parents):
            raise ConfigError(f"refusing to write {flag} {path}: it is or lies inside the "
                              f"input {src}", f"write {flag} outside the input folder")
    if folder and p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a folder", f"pass a folder to {flag}")
    if not folder and (p.is_dir() or str(path).endswith(("/", os.sep))):
        raise ConfigError(f"{flag} {path} names a folder", f"pass a file path, e.g. {flag} out.json")
    parent = p if folder and p.is_dir() else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        if not parent.is_dir():
            raise OSError(f"{parent} is not a folder")
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be written ({e})",
                          f"pass a path in a writable folder to {flag}") from e


def _parse_pattern(pattern: Optional[str]) -> tuple[Optional[int], Optional[int]]:
    if not pattern:
        return None, None
    try:
        n, m = (int(x) for x in pattern.split(":"))
    except ValueError:
        raise ConfigError(f"--pattern {pattern!r} is not N:M", "use e.g. --pattern 2:4") from None
    return n, m


def _table(title: str, columns: list[str], rows: list[list[Any]]):
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        first = c == columns[0]   # names (e.g. device profiles) are never cut
        t.add_column(c, justify="left" if first else "right", no_wrap=first, overflow="fold")
    from .pipeline import format_value

    for r in rows:
        t.add_row(*[format_value(v) for v in r])
    return t


def _parse_levels(items) -> dict:
    """``("down_proj=0", ...)`` -> ``{"down_proj": 0}``; raises ConfigError on a bad item."""
    out = {}
    for it in items or ():
        k, sep, v = str(it).partition("=")
        if not sep or not k or not v.strip().isdigit():
            raise ConfigError(f"--accuracy-level-for {it!r} is not SUFFIX=LEVEL",
                              "pass e.g. --accuracy-level-for down_proj=0")
        out[k.strip()] = int(v)
    return out


def method_options(f):
    """Options shared by ``run`` and ``compress``."""
    opts = [
        click.option("--method", type=click.Choice(METHODS), default=None,
                     help="Compression method (default for run: the best-w4 preset, GPTQ int4 g64 with 8-bit v_proj and first-layer down_proj)."),
        click.option("--recipe", type=click.Path(dir_okay=False), default=None,
                     help="TOML/YAML recipe file chaining methods, or a preset name such as best-w4 (it fixes the method and its settings: not with --method, --bits, --group-size, --sym, --sparsity or --pattern)."),
        click.option("--bits", type=int, default=None, help="Quantization bits: 2, 3, 4 or 8."),
        click.option("--group-size", type=int, default=None, help="Quantization group size (-1 = per row)."),
        click.option("--sym/--asym", default=None, help="Symmetric or asymmetric grid."),
        click.option("--sparsity", type=float, default=None, help="Unstructured sparsity in [0, 1)."),
        click.option("--pattern", default=None, help="N:M sparsity, e.g. 2:4 (prune_n:prune_m)."),
        click.option("--calib", default=None,
                     help="Calibration text: .txt/.jsonl/.parquet file, hf:NAME, or 'self' (text sampled "
                          "from the model), or 'default' (the embedded text) (default: run 'self', compress 'default')."),
        click.option("--nsamples", type=int, default=None,
                     help="Calibration windows (default: run 32, compress 128)."),
        click.option("--seqlen", type=int, default=512, show_default=True, help="Tokens per calibration window."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--device", default="cpu", show_default=True, help="cpu or cuda."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@click.group(context_settings=dict(help_option_names=["-h", "--help"]))
@click.version_option(package_name="edgeprune")
def cli():
    """edgeprune: compress, export, run and profile small language models on device."""


@cli.command("run")
@click.option("--model", default="smollm2-135m", show_default=True,
              help="Alias, .gguf file, HF folder or hub id.")
@method_options
@click.option("--eval-text", default=None, help="Evaluation text file (default: embedded held-out text).")
@click.option("--eval-seqlen", type=int, default=512, show_default=True,
              help="Tokens per evaluation window (capped at the model's context).")
@click.option("--eval-nwindows", type=int, default=40, show_default=True, help="0 = the whole text.")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--prompt-len", type=int, default=128, show_default=True)
@click.option("--gen-len", type=int, default=128, show_default=True)
@click.option("--repeat", type=int, default=3, show_default=True)
@click.option("--out", "out_dir", default="runs/demo", show_default=True, help="Output folder.")
@click.option("--overwrite", is_flag=True, help="Replace an output folder holding a different run.")
@click.option("--json", "json_path", default=None, help="Also write the report to this JSON file.")
def run_cmd(model, method, recipe, bits, group_size, sym, sparsity, pattern, calib, nsamples, seqlen,
            seed, device, eval_text, eval_seqlen, eval_nwindows, threads, prompt_len, gen_len, repeat,
            out_dir, overwrite, json_path):
    """The main job: compress, evaluate, export, run and report on one model."""
    _check_output(out_dir, "--out", folder=True)   # writable; input protection follows
    _check_output(json_path, "--json", [model])
    from .pipeline import RunConfig, run_pipeline

    pn, pm = _parse_pattern(pattern)
    cfg = RunConfig(model=model, method=method, recipe=recipe, bits=bits, group_size=group_size, sym=sym,
                    sparsity=sparsity, prune_n=pn, prune_m=pm, calib=calib, nsamples=RunConfig.nsamples if nsamples is None else nsamples,
                    seqlen=seqlen, seed=seed, eval_text=eval_text, eval_seqlen=eval_seqlen,
                    eval_nwindows=eval_nwindows,
                    threads=threads, prompt_len=prompt_len, gen_len=gen_len, repeat=repeat, device=device)
    con = _console()
    rep = run_pipeline(cfg, out_dir, overwrite=overwrite, log=lambda m: con.print(m))
    rows = [[k, v.get("dense"), v.get("compressed")] for k, v in rep.rows.items()]
    con.print(_table(f"{model}: dense vs compressed ({rep.compression.get('recipe', {}).get('name', '')})",
                     ["metric", "dense", "compressed"], rows))
    for k, s in rep.samples.items():
        con.print(f"{k} sample: {s}")
    con.print(f"report: {Path(rep.out_dir) / 'report.md'} and report.json "
              f"(total {rep.seconds.get('total', 0):.0f} s)")
    _write_json(json_path, rep.to_dict())


@cli.command("compress")
@click.argument("model")
@method_options
@click.option("--out", "out_dir", required=True, help="Checkpoint folder to write.")
@click.option("--format", "fmt", type=click.Choice(["compressed-tensors", "dense"]),
              default="compressed-tensors", show_default=True)
@click.option("--asym-layout", type=click.Choice(["naive-quantized", "pack-quantized"]),
              default="naive-quantized", show_default=True,
              help="compressed-tensors layout of asymmetric layers: naive (int8 codes) loads in plain "
                   "transformers; pack (8 codes per int32) is half the size but transformers 5.24 cannot load it.")
@click.option("--overwrite", is_flag=True)
@click.option("--json", "json_path", default=None, help="Write the compression summary here.")
def compress_cmd(model, method, recipe, bits, group_size, sym, sparsity, pattern, calib, nsamples, seqlen,
                 seed, device, out_dir, fmt, asym_layout, overwrite, json_path):
    """Compress MODEL with a method or recipe and save a checkpoint."""
    _check_output(out_dir, "--out", folder=True)   # writable; input protection follows
    _check_output(json_path, "--json", [model])
    from . import checkpoint as ckpt
    from .calibration import build_calibration
    from .engine import check_recipe, compress
    from .models import load_model
    from .pipeline import RunConfig, build_recipe

    if not method and not recipe:
        raise ConfigError("no compression method given", f"pass --method ({', '.join(METHODS)}) or --recipe FILE")
    pn, pm = _parse_pattern(pattern)
    cfg = RunConfig(model=model, method=method, recipe=recipe, bits=bits, group_size=group_size, sym=sym,
                    sparsity=sparsity, prune_n=pn, prune_m=pm, calib=calib, nsamples=128 if nsamples is None else nsamples,
                    seqlen=seqlen, seed=seed)
    rec = build_recipe(cfg)
    rec.validate()
    from .models import local_source

    local = local_source(model)               # the input model's file or folder (aliases too)
    # refused before any work: the input's folder, a folder of foreign files, or another
    # run's checkpoint without --overwrite (save_checkpoint checks again when it writes)
    ckpt.check_out_dir(Path(out_dir).expanduser().resolve(), [local] if local is not None else [],
                       overwrite)
    con = _console()
    m, tok, src = load_model(model, return_source=True, device=device)
    check_recipe(m, rec)                     # shapes vs recipe before calibrating
    cal = build_calibration(tok, calib, nsamples=cfg.nsamples, seqlen=seqlen, seed=seed,
                            model_max_length=getattr(m.config, "max_position_embeddings", None), model=m)
    res = compress(m, rec, cal.input_ids, device=device)
    res.calibration = cal.info
    if res.quantized and fmt == "dense":
        con.print("note: --format dense stores dequantized floats; integer codes are not kept")
    path = ckpt.save_checkpoint(m, tok, res, out_dir, format=fmt, overwrite=overwrite, asym_layout=asym_layout,
                                provenance=dict(method=rec.to_dict(), source=src.to_dict(),
                                                calibration=cal.info, seed=seed))
    summ = res.summary()
    con.print(f"compressed {model} with {rec.to_dict()} in {res.seconds:.1f} s -> {path}")
    if summ.get("avg_bits_per_weight"):
        con.print(f"average bits per weight (scales included): {summ['avg_bits_per_weight']:.3f}")
    if res.fallbacks:
        con.print("fallbacks: " + "; ".join(res.fallbacks))
    _write_json(json_path, summ)


@cli.command("eval")
@click.argument("model")
@click.option("--text", default=None, help="Text file: plain UTF-8, .jsonl ({\"text\": ...} per line) "
                                          "or .parquet ('text' column) (default: embedded held-out text).")
@click.option("--seqlen", type=int, default=512, show_default=True)
@click.option("--nwindows", type=int, default=40, show_default=True, help="0 = the whole text.")
@click.option("--dense", "dense_ref", default=None, help="Reference model for KL / top-1 agreement.")
@click.option("--threads", type=int, default=None, help="CPU threads (torch and onnxruntime; default: all).")
@click.option("--json", "json_path", default=None, help="Write the figures here.")
def eval_cmd(model, text, seqlen, nwindows, dense_ref, threads, json_path):
    """Perplexity of MODEL (alias, .gguf, HF folder, checkpoint or ONNX export folder)."""
    _check_output(json_path, "--json", [model] + ([dense_ref] if dense_ref else []))
    from .evaluate import fidelity, perplexity

    if threads is not None and threads < 1:
        raise ConfigError(f"--threads {threads} must be >= 1", "pass e.g. --threads 2, or omit it for all")
    if threads:
        import torch

        torch.set_num_threads(threads)
    nw = None if nwindows == 0 else nwindows
    m, tok = _load_any(model, threads)
    con = _console()
    if dense_ref:
        d, _ = _load_any(dense_ref, threads)
        r = fidelity(d, m, tok, text, seqlen=seqlen, nwindows=nw)
        rows = [["perplexity", r.ppl], ["dense perplexity", r.ppl_dense], ["KL(dense||model) nats/token", r.kl],
                ["top-1 agreement", r.top1_agree]]
        out = r.to_dict()
        proto = r.protocol
    else:
        r = perplexity(m, tok, text, seqlen=seqlen, nwindows=nw)
        rows = [["perplexity", r.ppl], ["NLL nats/token", r.nll]]
        out = r.to_dict()
        proto = r.protocol
    out["model"] = model
    con.print(_table(f"{model}", ["metric", "value"], rows))
    con.print(f"protocol: {proto.text_source} (sha256 {proto.text_sha256[:12]}…), no BOS, "
              f"{proto.nwindows} x {proto.seqlen} tokens, {proto.ntokens_scored} scored")
    _write_json(json_path, out)


def _load_any(source: str, threads=None):
    """A torch model, or an ONNX export folder wrapped as a logits function."""
    p = Path(source)
    if p.is_dir() and (p / "model.onnx").is_file() and (p / "edgeprune.json").is_file():
        import numpy as np
        from transformers import PreTrainedTokenizerFast

        import runtime

        sess = runtime.load(p, threads=threads)
        tok = PreTrainedTokenizerFast(tokenizer_file=str(p / "tokenizer.json"))

        def fn(ids):
            return sess.logits(np.asarray(ids, dtype=np.int64))

        # the trained context, for evaluation's check (exports record it since this field)
        ctx = sess.meta.get("max_position_embeddings")
        if isinstance(ctx, int):
            from types import SimpleNamespace
            fn.config = SimpleNamespace(max_position_embeddings=ctx)
        return fn, tok
    from .models import load_model

    return load_model(source)


@cli.command("export")
@click.argument("checkpoint")
@click.argument("out")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int4"]), default=None,
              help="Default: int4 for quantized checkpoints, fp32 otherwise (fp32/fp16 of a "
                   "quantized checkpoint: its dequantized weights, no int codes).")
@click.option("--sparse-24", is_flag=True, help="Require and record an exact 2:4 pattern.")
@click.option("--compact-24", is_flag=True, help="Store 2:4 weights as values + 2-bit positions.")
@click.option("--graph", type=click.Choice(["fused", "plain"]), default="fused", show_default=True)
@click.option("--lm-head", type=click.Choice(["fp", "q8", "int4"]), default=None,
              help="lm_head precision (default q8 for int4 exports).")
@click.option("--accuracy-level", type=int, default=4, show_default=True,
              help="MatMulNBits compute: 4 = int8 activations (fast), 0 = fp32.")
@click.option("--accuracy-level-for", "accuracy_levels", multiple=True, metavar="SUFFIX=LEVEL",
              help="Per-projection override, e.g. down_proj=0 or layers.3.mlp.down_proj=0; a projection fused with others (q/k/v, gate/up) gets its own node (repeatable).")
@click.option("--group-size", type=int, default=64, show_default=True,
              help="RTN group size for weights quantized at export (no codes in the checkpoint).")
@click.option("--max-length", type=int, default=None)
@click.option("--k-keep", type=float, default=None,
              help="LeanK: fraction of key channels kept in the middle of the KV cache, in (0, 1].")
@click.option("--leank-mask", default=None, help="LeanK: a mask JSON from `edgeprune leank` (else learned now).")
@click.option("--leank-method", type=click.Choice(["learned", "magnitude"]), default="learned", show_default=True)
@click.option("--leank-sink", type=int, default=None, help="LeanK: first tokens keeping full keys.")
@click.option("--leank-window", type=int, default=None, help="LeanK: recent tokens keeping full keys.")
@click.option("--act-sparsity", type=float, default=None,
              help="COUNTDOWN: fraction of MLP coefficients skipped per decode token, in [0, 1).")
@click.option("--countdown", "countdown_mode", type=click.Choice(["m", "d"]), default="d", show_default=True,
              help="COUNTDOWN variant: m (threshold |up(x)| times a static channel scale; no predictor) "
                   "or d (predict act(gate(x))*up(x) with a 4-bit copy of gate/up).")
@click.option("--calib", default=None, help="Calibration text for LeanK/COUNTDOWN (default: embedded text).")
@click.option("--no-validate", is_flag=True,
              help="Skip the logits check against the PyTorch model (a failed check writes nothing).")
@click.option("--overwrite", is_flag=True)
@click.option("--json", "json_path", default=None)
def export_cmd(checkpoint, out, precision, sparse_24, compact_24, graph, lm_head, accuracy_level,
               accuracy_levels, group_size, max_length, k_keep, leank_mask, leank_method, leank_sink, leank_window,
               act_sparsity, countdown_mode, calib, no_validate, overwrite, json_path):
    """Export CHECKPOINT (checkpoint, HF folder, .gguf or alias) to an ONNX folder OUT.

    With --k-keep the key cache keeps only LeanK's kept channels (LeanK, EMNLP 2025); with
    --act-sparsity decode steps skip MLP coefficients (COUNTDOWN, EMNLP 2025).
    """
    import exporters

    from . import checkpoint as ckpt
    from .models import load_model

    # outputs and numeric options first: an error now, not after loading or calibrating
    _check_output(json_path, "--json", [checkpoint])
    exporters.check_export_args(precision or "int4", group_size, accuracy_level, max_length)
    levels = _parse_levels(accuracy_levels)
    if (k_keep is not None or leank_mask) and act_sparsity is not None:
        raise ConfigError(f"{'--k-keep' if k_keep is not None else '--leank-mask'} and "
                          "--act-sparsity cannot be combined in one export yet",
                          "export LeanK and COUNTDOWN variants separately")
    if leank_mask and k_keep is not None:
        raise ConfigError("--leank-mask and --k-keep both given: the mask already fixes the "
                          "kept channels", "pass --leank-mask alone, or --k-keep alone to "
                          "learn a new mask")
    if act_sparsity is not None:
        from . import countdown as cd

        act_sparsity = cd.check_act_sparsity(act_sparsity)
    p = Path(checkpoint)
    quantized, sparsity, prov = None, None, {"source": checkpoint}
    if p.is_dir() and ckpt.is_edgeprune_checkpoint(p):
        model, tok, info = ckpt.load_checkpoint(p)
        quantized = info.quantized or None
        if info.sparsity_pattern:
            sparsity = {"pattern": sorted(set(info.sparsity_pattern.values()))}
        prov.update(checkpoint=str(p.resolve()), compression=info.provenance)
    else:
        model, tok = load_model(checkpoint)
    precision = precision or ("int4" if quantized else "fp32")
    kwargs = dict(precision=precision, quantized=quantized, sparsity=sparsity, sparse_24=sparse_24,
                  compact_24=compact_24, graph=graph, lm_head=lm_head, accuracy_level=accuracy_level,
                  accuracy_levels=levels,
                  group_size=group_size, max_length=max_length, provenance=prov, overwrite=overwrite,
                  validate=not no_validate)
    calib_ids = None
    if act_sparsity is not None:
        from .calibration import build_calibration

        calib_ids = build_calibration(tok, calib, nsamples=16, seqlen=512, model=model).input_ids
    if k_keep is not None or leank_mask:
        from . import leank as lk

        if leank_mask:
            mask = lk.LeanKMask.load(leank_mask)
        else:
            from .calibration import build_calibration

            lk.check_leank_args(k_keep=k_keep, sink=leank_sink, window=leank_window)
            # long windows: training sees pruned keys as far away as the deployed cache does
            calib_ids = build_calibration(tok, calib, nsamples=lk.DEFAULT_CALIB_NSAMPLES,
                                          seqlen=lk.DEFAULT_CALIB_SEQLEN, model=model).input_ids
            mask = lk.learn_mask(model, calib_ids, k_keep, method=leank_method,
                                 train_sink=leank_sink, train_window=leank_window)
        res = exporters.export_onnx(model, tok, out, leank=mask, leank_sink=leank_sink,
                                    leank_window=leank_window, **kwargs)
    elif act_sparsity is not None:
        from exporters.countdown import export_countdown

        spec = cd.calibrate(model, calib_ids, act_sparsity, mode=countdown_mode)
        res = export_countdown(model, tok, out, spec, **kwargs)
    else:
        res = exporters.export_onnx(model, tok, out, **kwargs)
    _console().print(res.summary())
    _write_json(json_path, dict(folder=str(res.folder), files=res.files, parity=res.parity, timings=res.timings))


@cli.command("leank")
@click.argument("model")
@click.option("--k-keep", type=float, required=True, help="Fraction of key channels kept, in (0, 1].")
@click.option("--method", type=click.Choice(["learned", "magnitude"]), default="learned", show_default=True)
@click.option("--calib", default=None, help="Calibration text (default: embedded text).")
@click.option("--nsamples", type=int, default=4, show_default=True)
@click.option("--seqlen", type=int, default=2048, show_default=True,
              help="Calibration window; longer than sink + window so training meets far keys.")
@click.option("--sink", type=int, default=None,
              help="Training regime: the sink you will export with (default 64).")
@click.option("--window", type=int, default=None,
              help="Training regime: the window you will export with (default 448).")
@click.option("--alignment", type=int, default=None,
              help="Every head keeps a multiple of this many channels (default 8).")
@click.option("--min-per-head", type=int, default=None,
              help="Channels every head keeps at least (default: one alignment block; 0 allows dead heads).")
@click.option("--out", "out_path", required=True, help="Mask JSON to write.")
def leank_cmd(model, k_keep, method, calib, nsamples, seqlen, sink, window, alignment, min_per_head,
              out_path):
    """Learn a LeanK key-channel mask for MODEL (LeanK, EMNLP 2025) and save it as JSON."""
    from . import leank as lk
    from .calibration import build_calibration
    from .models import load_model

    lk.check_leank_args(k_keep=k_keep, alignment=alignment, sink=sink, window=window)
    _check_output(out_path, "--out", [model])
    m, tok = load_model(model)
    ids = build_calibration(tok, calib, nsamples=nsamples, seqlen=seqlen, model=m,
                            model_max_length=getattr(m.config, "max_position_embeddings", None)).input_ids
    extra = {k: v for k, v in (("alignment", alignment), ("min_per_head", min_per_head)) if v is not None}
    mask = lk.learn_mask(m, ids, k_keep, method=method, train_sink=sink, train_window=window, **extra)
    path = mask.save(out_path)
    _console().print(f"LeanK {method} mask, k_keep={k_keep}: {path}")


@cli.command("generate")
@click.argument("folder")
@click.argument("prompt")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-k", type=int, default=0)
@click.option("--top-p", type=float, default=1.0)
@click.option("--repetition-penalty", type=float, default=1.0)
@click.option("--seed", type=int, default=None)
@click.option("--chat/--no-chat", default=True, show_default=True, help="Render with the chat template.")
@click.option("--threads", type=int, default=None)
@click.option("--max-length", type=int, default=None,
              help="Context length in tokens (default and upper bound: the export's).")
@click.option("--context-policy", type=click.Choice(["error", "sliding_window"]), default="error",
              show_default=True, help="What happens when the context is full: raise, or re-prefill "
                                      "the last max_length // 2 tokens and go on (a longer "
                                      "prompt is cut to that window too).")
@click.option("--stop", "stops", multiple=True,
              help="Stop string (repeatable); the escapes \\n, \\t and \\\\ are understood, so "
                   "--stop '\\n\\n' stops at a blank line.")
@click.option("--prompt-lookup-num-tokens", type=int, default=0, show_default=True,
              help="Prompt-lookup speculative decoding: draft up to this many tokens from an "
                   "earlier occurrence of the last n-gram and score them in one pass (0: off). "
                   "Faster where the text repeats its context; same sampler, same draws.")
@click.option("--max-matching-ngram-size", type=int, default=2, show_default=True,
              help="Longest n-gram prompt lookup matches.")
def generate_cmd(folder, prompt, max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed, chat,
                 threads, max_length, context_policy, stops, prompt_lookup_num_tokens,
                 max_matching_ngram_size):
    """Stream a completion of PROMPT from an exported FOLDER (runtime only, no torch)."""
    import runtime

    with runtime.load(folder, threads=threads, max_length=max_length,
                      context_policy=context_policy) as sess:
        for piece in sess.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                 top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, chat=chat,
                                 stop=[_unescape(x) for x in stops] or None,
                                 prompt_lookup_num_tokens=prompt_lookup_num_tokens,
                                 max_matching_ngram_size=max_matching_ngram_size):
            click.echo(piece, nl=False)
    click.echo()


def _unescape(text: str) -> str:
    r"""``\n``, ``\t`` and ``\\`` typed on a command line (shells pass them as two
    characters) as the characters they name; any other backslash is kept as it is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


@cli.command("profile")
@click.argument("folder")
@click.option("--device", "device_name", default="cpu-host", show_default=True,
              help="Device profile name (see `edgeprune devices`).")
@click.option("--prompt-len", type=int, default=128, show_default=True)
@click.option("--gen-len", type=int, default=128, show_default=True)
@click.option("--repeat", type=int, default=5, show_default=True)
@click.option("--sweep", is_flag=True, help="Also sweep context lengths and draw a PNG.")
@click.option("--target", "targets", multiple=True, help="Profiles to project to (repeatable).")
@click.option("--out", "out_dir", default=None,
              help="Folder for the plot and profile.md (default: the plot goes to ./runs/profile-NAME/).")
@click.option("--threads", type=int, default=None, help="Threads to run with instead of the profile's.")
@click.option("--json", "json_path", default=None)
def profile_cmd(folder, device_name, prompt_len, gen_len, repeat, sweep, targets, out_dir, threads, json_path):
    """Measure latency and memory of an exported FOLDER under a device profile."""
    from runtime.profiler import _atomic_write, profile

    # outputs checked before minutes of measuring, not after
    _check_output(out_dir, "--out", [folder], folder=True)
    _check_output(json_path, "--json", [folder])
    rep = profile(folder, device_name, prompt_len=prompt_len, gen_len=gen_len, repeat=repeat,
                  sweep=True if sweep else None, targets=list(targets) or None, out_dir=out_dir,
                  threads=threads)
    md = rep.to_markdown()
    click.echo(md)          # Markdown as is: no terminal-width wrapping, no rich markup
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        _atomic_write(Path(out_dir) / "profile.md", md.encode())
    if json_path:
        rep.to_json(json_path)


@cli.command("devices")
@click.option("--json", "json_path", default=None)
def devices_cmd(json_path):
    """List the device profiles (devices/profiles/*.toml)."""
    import devices

    _check_output(json_path, "--json")
    profs = devices.list_profiles()
    rows = []
    for p in profs:
        d = p.to_dict()
        rows.append([d["name"], d["device_class"], d["execution_provider"].replace("ExecutionProvider", ""),
                     d["threads"], round(d["memory_budget_bytes"] / 2**20),
                     d["bandwidth_gbs"] or "measured", d["peak_fp32_gflops"] or "measured",
                     d["peak_int8_gops"] or "measured"])
    con = _console()
    con.print(_table("device profiles (devices/profiles/*.toml)",
                     ["name", "class", "provider", "threads", "memory budget MiB",
                      "bandwidth GB/s", "fp32 GFLOP/s", "int8 GOP/s"], rows))
    con.print("sources of the figures:")
    for p in profs:
        con.print(f"  {p.name}: {p.source or 'not given'}")
    _write_json(json_path, [p.to_dict() for p in profs])


#: Python keyword arguments that library errors suggest, and the CLI flags that set them.
_CLI_FLAGS = {"threads": "--threads", "max_new_tokens": "--max-new-tokens", "max_length": "--max-length",
              "top_k": "--top-k", "top_p": "--top-p", "temperature": "--temperature",
              "repetition_penalty": "--repetition-penalty", "context_policy": "--context-policy",
              "prompt_len": "--prompt-len", "gen_len": "--gen-len", "repeat": "--repeat",
              "seed": "--seed", "min_per_head": "--min-per-head", "alignment": "--alignment",
              "prompt_lookup_num_tokens": "--prompt-lookup-num-tokens",
              "max_matching_ngram_size": "--max-matching-ngram-size"}


def _as_cli_hint(message: str) -> str:
    """An error's fix as the command line spells it: ``pass e.g. threads=2`` (the Python
    API's words) becomes ``pass e.g. --threads 2``."""
    import re

    return re.sub(r"\b(" + "|".join(_CLI_FLAGS) + r")=(?!=)'?([\w.\-]+)'?",
                  lambda m: f"{_CLI_FLAGS[m.group(1)]} {m.group(2)}", message)


def main(argv=None) -> int:
    """Console entry point: runs the click group, turning edgeprune errors into one line.

    SIGTERM (``kill``, ``timeout``) is turned into the same clean stop as Ctrl-C, so the
    temporary output folders are removed on the way out."""
    import signal
    import warnings

    def _term(signum, frame):
        raise KeyboardInterrupt

    def _warn(message, category, filename, lineno, file=None, line=None):
        click.echo(f"warning: {message}", err=True)      # one line, no source excerpt

    prev_warn, warnings.showwarning = warnings.showwarning, _warn

    try:
        prev = signal.signal(signal.SIGTERM, _term)
    except ValueError:                       # not the main thread (embedded use): leave it
        prev = None
    try:
        cli.main(args=argv, prog_name="edgeprune", standalone_mode=False)
        return 0
    except EdgePruneError as exc:
        click.echo(f"error: {_as_cli_hint(str(exc))}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted; partial outputs were removed", err=True)
        return 130
    except Exception as exc:  # noqa: BLE001 -- last resort: one line, not a torch traceback
        if os.environ.get("EDGEPRUNE_DEBUG"):
            raise
        click.echo(f"internal error: {type(exc).__name__}: {exc} (set EDGEPRUNE_DEBUG=1 for the traceback "
                   "and report it)", err=True)
        return 1
    finally:
        warnings.showwarning = prev_warn
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
