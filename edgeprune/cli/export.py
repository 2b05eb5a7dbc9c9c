"""``edgeprune export``: a checkpoint or model -> an ONNX folder with a KV cache."""

from __future__ import annotations

from pathlib import Path

import click

from runtime.errors import ConfigError

from ._app import cli
from ._common import _check_output, _console, _parse_levels, _write_json

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

    from .. import checkpoint as ckpt
    from ..models import load_model

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
        from .. import countdown as cd

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
        from ..calibration import build_calibration

        calib_ids = build_calibration(tok, calib, nsamples=16, seqlen=512, model=model).input_ids
    if k_keep is not None or leank_mask:
        from .. import leank as lk

        if leank_mask:
            mask = lk.LeanKMask.load(leank_mask)
        else:
            from ..calibration import build_calibration

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
