"""``edgeprune export``: a checkpoint or model (+ graph variants) -> an ONNX folder with a KV cache."""

from __future__ import annotations

from pathlib import Path

import click

from edgeprune_runtime.errors import ConfigError

from ._app import cli
from ._common import _check_output, _console, _parse_levels, _write_json, threads_option

#: export's former flags for the variants' compress work (now `edgeprune leank` /
#: `edgeprune countdown`): hidden, and refused with one error naming those commands
_MOVED = {"k_keep": "--k-keep", "leank_mask": "--leank-mask", "leank_method": "--leank-method",
          "leank_sink": "--leank-sink", "leank_window": "--leank-window",
          "act_sparsity": "--act-sparsity", "countdown_mode": "--countdown", "calib": "--calib"}


def load_source(source: str):
    """``(model, tokenizer, quantized or None, sparsity record or None, provenance)`` of an
    edgeprune checkpoint folder (its dequantized weights and int codes) or of any other
    model source (``edgeprune.models.load_model``)."""
    from .. import checkpoint as ckpt
    from ..models import load_model

    p = Path(source)
    quantized, sparsity, prov = None, None, {"source": source}
    if p.is_dir() and ckpt.is_edgeprune_checkpoint(p):
        model, tok, info = ckpt.load_checkpoint(p)
        quantized = info.quantized or None
        if info.sparsity_pattern:
            sparsity = {"pattern": sorted(set(info.sparsity_pattern.values()))}
        prov.update(checkpoint=str(p.resolve()), compression=info.provenance)
    else:
        model, tok = load_model(source)
    return model, tok, quantized, sparsity, prov


def _moved_options(f):
    for param, flag in reversed(_MOVED.items()):
        f = click.option(flag, param, hidden=True, default=None)(f)
    return f


def _refuse_moved(values: dict) -> None:
    given = [flag for param, flag in _MOVED.items() if values.get(param) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)}: export no longer learns LeanK masks or calibrates "
                          "COUNTDOWN, it only exports",
                          "write the spec first (`edgeprune leank MODEL --k-keep R --out leank.json` "
                          "or `edgeprune countdown MODEL --act-sparsity S --mode d --out cd.safetensors`), "
                          "then `edgeprune export CKPT OUT --variant leank.json` (or cd.safetensors)")


def _variants(items, compact_24: bool) -> list:
    """``--variant`` values (spec files, or names of variants without a spec) -> the
    ``variants`` argument of ``exporters.export_onnx``, checked before any work."""
    from edgeprune_exporters.variants import variant_entries

    from ..variants import load_spec

    out: list = ["compact24"] if compact_24 else []
    for item in items:
        v = load_spec(item) if Path(item).exists() or item.endswith((".json", ".safetensors")) \
            else item
        if not (isinstance(v, str) and v in out):        # --compact-24 --variant compact24
            out.append(v)
    variant_entries(out)
    return out


@cli.command("export")
@click.argument("checkpoint")
@click.argument("out")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int4"]), default=None,
              help="Default: int4 for quantized checkpoints, fp32 otherwise (fp32/fp16 of a "
                   "quantized checkpoint: its dequantized weights, no int codes).")
@click.option("--variant", "variants", multiple=True, metavar="FILE_OR_NAME",
              help="Graph variant, applied in order (repeatable): a spec file from `edgeprune leank` "
                   "(LeanK key pruning) or `edgeprune countdown` (COUNTDOWN sparse MLP), or the name "
                   "of a variant without a spec (compact24).")
@click.option("--sparse-24", is_flag=True, help="Require and record an exact 2:4 pattern.")
@click.option("--compact-24", is_flag=True,
              help="Store 2:4 weights as values + 2-bit positions (= --variant compact24).")
@click.option("--graph", type=click.Choice(["fused", "plain"]), default="fused", show_default=True)
@click.option("--lm-head", type=click.Choice(["fp", "q8", "int4"]), default=None,
              help="lm_head precision (default q8 for int4 and compact 2:4 exports).")
@click.option("--accuracy-level", type=int, default=4, show_default=True,
              help="MatMulNBits compute: 4 = int8 activations (fast), 0 = fp32.")
@click.option("--accuracy-level-for", "accuracy_levels", multiple=True, metavar="SUFFIX=LEVEL",
              help="Per-projection override, e.g. down_proj=0 or layers.3.mlp.down_proj=0; a projection fused with others (q/k/v, gate/up) gets its own node (repeatable).")
@click.option("--group-size", type=int, default=64, show_default=True,
              help="RTN group size for weights quantized at export (no codes in the checkpoint).")
@click.option("--max-length", type=int, default=None)
@click.option("--no-validate", is_flag=True,
              help="Skip the logits check against the PyTorch model (a failed check writes nothing).")
@threads_option(help="CPU threads for torch (default: all cores); the validation's onnxruntime session "
                      "keeps onnxruntime's default.")
@click.option("--overwrite", is_flag=True)
@click.option("--json", "json_path", default=None)
@_moved_options
def export_cmd(checkpoint, out, precision, variants, sparse_24, compact_24, graph, lm_head,
               accuracy_level, accuracy_levels, group_size, max_length, no_validate, threads, overwrite,
               json_path, **moved):
    """Export CHECKPOINT (checkpoint, HF folder, .gguf or alias) to an ONNX folder OUT.

    Graph variants come as spec files: `edgeprune leank` writes a LeanK key-channel mask
    (LeanK, EMNLP 2025), `edgeprune countdown` a COUNTDOWN spec (sparse decode MLP,
    EMNLP 2025); pass them with --variant.
    """
    import edgeprune_exporters as exporters

    _refuse_moved(moved)
    # outputs, options and spec files first: an error now, not after loading the model
    _check_output(json_path, "--json", [checkpoint])
    exporters.check_export_args(precision or "int4", group_size, accuracy_level, max_length)
    levels = _parse_levels(accuracy_levels)
    specs = _variants(variants, compact_24)
    from edgeprune_exporters.folder import claim_out_dir

    from ..models import local_source

    src = local_source(checkpoint)
    # OUT claimed before the model loads: a read-only place, an input folder, foreign files
    # or a second export into the same folder are refused now, not after minutes of work
    with claim_out_dir(Path(out).expanduser().resolve(), [src] if src is not None else [],
                       overwrite, label="OUT"):
        model, tok, quantized, sparsity, prov = load_source(checkpoint)
        res = exporters.export_onnx(
            model, tok, out, precision=precision or ("int4" if quantized else "fp32"),
            quantized=quantized, sparsity=sparsity, sparse_24=sparse_24, variants=specs,
            graph=graph, lm_head=lm_head, accuracy_level=accuracy_level, accuracy_levels=levels,
            group_size=group_size, max_length=max_length, provenance=prov, overwrite=overwrite,
            validate=not no_validate)
    _console().print(res.summary())
    _write_json(json_path, dict(folder=str(res.folder), files=res.files, parity=res.parity, timings=res.timings))
