"""``edgeprune kvcache``: a float16 or int8 KV-cache spec (the spec ``export --variant`` takes)."""

from __future__ import annotations

import click

from ._app import cli
from ._common import _check_output, _console, threads_option


@cli.command("kvcache")
@click.argument("model")
@click.option("--dtype", type=click.Choice(["int8", "fp16"]), default="int8", show_default=True,
              help="Cache element type (int8: per-channel scales calibrated here; fp16 decodes "
                   "slower than the fp32 cache on x86 CPUs, docs/kv-cache.md).")
@click.option("--calib", default=None, help="Calibration text for the int8 scales (default: embedded text).")
@click.option("--nsamples", type=int, default=4, show_default=True)
@click.option("--seqlen", type=int, default=2048, show_default=True,
              help="Calibration window (tokens); the scales hold every rotary angle of the keys seen.")
@click.option("--margin", type=float, default=1.0, show_default=True,
              help="Scale multiplier (> 1 leaves headroom for larger tokens, at the cost of resolution).")
@threads_option(help="CPU threads for torch (default: all cores).")
@click.option("--out", "out_path", required=True,
              help="Spec file to write (.safetensors for int8, .json for fp16).")
def kvcache_cmd(model, dtype, calib, nsamples, seqlen, margin, threads, out_path):
    """Write a KV-cache spec for MODEL (checkpoint, HF folder, .gguf or alias): a float16
    cache, or an int8 one with per-channel scales calibrated on MODEL's own cache;
    `edgeprune export CKPT OUT --variant FILE` builds the graph (docs/kv-cache.md)."""
    from ..kvcache import KVCacheSpec
    from ..variants import save_spec

    _check_output(out_path, "--out", [model])
    if dtype == "fp16":
        spec = KVCacheSpec("fp16")
    else:
        from ..calibration import build_calibration
        from .export import load_source

        m, tok, *_ = load_source(model)
        ids = build_calibration(tok, calib, nsamples=nsamples, seqlen=seqlen, model=m,
                                model_max_length=getattr(m.config, "max_position_embeddings", None)).input_ids
        spec = KVCacheSpec.calibrate(m, ids, dtype="int8", margin=margin)
    path = save_spec(spec, out_path)
    _console().print(f"KV-cache spec ({dtype}): {path}")
