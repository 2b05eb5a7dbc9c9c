"""``edgeprune compress``: a method or recipe -> a compressed-tensors checkpoint."""

from __future__ import annotations

import warnings
from pathlib import Path

import click

from edgeprune_runtime.errors import ConfigError

from ._app import cli
from ._common import (METHODS, _check_output, _console, _parse_pattern, _write_json, describe_recipe,
                      method_options, threads_option)

@cli.command("compress")
@click.argument("model")
@method_options
@click.option("--out", "out_dir", required=True, help="Checkpoint folder to write.")
@click.option("--format", "fmt", type=click.Choice(["compressed-tensors", "dense"]),
              default="compressed-tensors", show_default=True)
@click.option("--asym-layout", type=click.Choice(["pack-quantized", "pack-quantized-compact", "naive-quantized"]),
              default="pack-quantized", show_default=True,
              help="compressed-tensors layout of asymmetric layers: pack-quantized (8 codes per int32, zero "
                   "points padded so plain transformers 5.24 loads it); pack-quantized-compact (zero points "
                   "unpadded, as llm-compressor writes; transformers 5.24 cannot load it); naive-quantized "
                   "(one int8 per code, twice the size).")
@click.option("--embedding-dtype", type=click.Choice(["auto", "float16", "bfloat16", "float32"]), default="auto",
              show_default=True,
              help="Precision of the embedding (and an untied, unquantized lm_head), set before compressing "
                   "and kept in the checkpoint: auto = bfloat16 when exact, else float16; float32 keeps it.")
@click.option("--measure-error", is_flag=True,
              help="Measure each layer's reconstruction error on calibration windows (in --json). "
                   "Data-free methods (rtn, magnitude) build no calibration windows and run no forward "
                   "pass unless this flag, --calib or --nsamples is given.")
@click.option("--calib-dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Precision of the calibration forward passes (weights, Hessians and the method stay "
                   "float32); bfloat16 is faster on CPUs with AVX512-BF16 or AMX.")
@threads_option()
@click.option("--overwrite", is_flag=True)
@click.option("--json", "json_path", default=None, help="Write the compression summary here.")
def compress_cmd(model, method, recipe, bits, group_size, sym, sparsity, pattern, calib, nsamples, seqlen,
                 seed, device, out_dir, fmt, asym_layout, embedding_dtype, measure_error, calib_dtype, threads,
                 overwrite, json_path):
    """Compress MODEL with a method or recipe and save a checkpoint.

    Data-free methods (rtn, magnitude) read only the weights: no calibration data and no
    forward pass, unless --measure-error, --calib or --nsamples asks for per-layer errors.
    """
    _check_output(json_path, "--json", [model])
    from .. import checkpoint as ckpt
    from ..engine import FallbackWarning, check_recipe, compress, needs_calibration
    from ..models import load_model
    from ..pipeline import RunConfig, build_recipe

    if not method and not recipe:
        raise ConfigError("no compression method given", f"pass --method ({', '.join(METHODS)}) or --recipe FILE")
    pn, pm = _parse_pattern(pattern)
    cfg = RunConfig(model=model, method=method, recipe=recipe, bits=bits, group_size=group_size, sym=sym,
                    sparsity=sparsity, prune_n=pn, prune_m=pm, calib=calib, nsamples=128 if nsamples is None else nsamples,
                    seqlen=seqlen, seed=seed)
    rec = build_recipe(cfg)
    rec.validate()
    # data only where the method needs it or the user asked for the errors measured on it
    use_data = needs_calibration(rec) or measure_error or calib is not None or nsamples is not None
    from ..models import local_source

    local = local_source(model)               # the input model's file or folder (aliases too)
    # refused before any work, and claimed until the checkpoint is written: the input's
    # folder, an unwritable path, a folder of foreign files, another run's checkpoint
    # without --overwrite, or a folder another compress is writing right now
    with ckpt.claim_out_dir(Path(out_dir).expanduser().resolve(), [local] if local is not None else [],
                            overwrite, label="--out"):
        con = _console()
        m, tok, src = load_model(model, return_source=True, device=device)
        check_recipe(m, rec)                     # shapes vs recipe before calibrating
        emb_dtype = None
        if fmt == "compressed-tensors":          # the model compressed is the model saved
            emb_dtype = ckpt.round_embeddings(m, embedding_dtype)
        ids, calib_info = None, {"source": None, "data_free": True}
        if use_data:
            from ..calibration import build_calibration, describe, with_forward_dtype

            cal = build_calibration(tok, calib, nsamples=cfg.nsamples, seqlen=seqlen, seed=seed,
                                    model_max_length=getattr(m.config, "max_position_embeddings", None),
                                    model=m)
            con.print(describe(cal.info))
            ids, calib_info = cal.input_ids, with_forward_dtype(cal.info, calib_dtype)
        else:
            con.print(f"{', '.join(c.method for c in rec.stages)}: data-free, no calibration data "
                      "(--measure-error measures per-layer errors on calibration windows)")
        with warnings.catch_warnings():      # printed below, with the other notes
            warnings.simplefilter("ignore", FallbackWarning)
            res = compress(m, rec, ids, device=device, forward_dtype=calib_dtype)
        res.calibration = calib_info
        if res.quantized and fmt == "dense":
            con.print("note: --format dense stores dequantized floats; integer codes are not kept")
        path = ckpt.save_checkpoint(m, tok, res, out_dir, format=fmt, overwrite=overwrite,
                                    asym_layout=asym_layout,
                                    provenance=dict(method=rec.to_dict(), source=src.to_dict(),
                                                    calibration=calib_info, seed=seed,
                                                    embedding_dtype=emb_dtype or "as loaded"))
    summ = res.summary()
    con.print(f"compressed {model} with {describe_recipe(rec.to_dict())} in {res.seconds:.1f} s -> {path}")
    if summ.get("avg_bits_per_weight"):
        con.print(f"average bits per weight (scales included): {summ['avg_bits_per_weight']:.3f}")
    if emb_dtype:
        con.print(f"embedding stored in {emb_dtype} (--embedding-dtype float32 keeps it as loaded)")
    changed = res.fallback_summary()
    if changed:
        con.print(f"fallbacks: {changed}")
    notes = [n for n in res.fallbacks if n not in set(res.method_fallbacks())]
    if notes:
        con.print("notes: " + "; ".join(notes))
    _write_json(json_path, summ)
