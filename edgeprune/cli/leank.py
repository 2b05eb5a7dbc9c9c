"""``edgeprune leank``: learn a LeanK key-channel mask (the spec ``export --variant`` takes)."""

from __future__ import annotations

import click

from ._app import cli
from ._common import _check_output, _console

@cli.command("leank")
@click.argument("model")
@click.option("--k-keep", type=float, required=True, help="Fraction of key channels kept, in (0, 1].")
@click.option("--method", type=click.Choice(["learned", "magnitude"]), default="learned", show_default=True)
@click.option("--calib", default=None, help="Calibration text (default: embedded text).")
@click.option("--nsamples", type=int, default=4, show_default=True)
@click.option("--seqlen", type=int, default=2048, show_default=True,
              help="Calibration window; longer than sink + window so training meets far keys.")
@click.option("--sink", type=int, default=None,
              help="First tokens keeping full keys, in training and in the export (default 64).")
@click.option("--window", type=int, default=None,
              help="Recent tokens keeping full keys, in training and in the export (default 448).")
@click.option("--alignment", type=int, default=None,
              help="Every head keeps a multiple of this many channels (default 8).")
@click.option("--min-per-head", type=int, default=None,
              help="Channels every head keeps at least (default: one alignment block; 0 allows dead heads).")
@click.option("--out", "out_path", required=True, help="Mask JSON to write.")
def leank_cmd(model, k_keep, method, calib, nsamples, seqlen, sink, window, alignment, min_per_head,
              out_path):
    """Learn a LeanK key-channel mask for MODEL (checkpoint, HF folder, .gguf or alias; LeanK,
    EMNLP 2025) and save it as JSON; `edgeprune export CKPT OUT --variant FILE` builds the
    graph."""
    from .. import leank as lk
    from ..calibration import build_calibration
    from ..variants import save_spec
    from .export import load_source

    lk.check_leank_args(k_keep=k_keep, alignment=alignment, sink=sink, window=window)
    _check_output(out_path, "--out", [model])
    m, tok, *_ = load_source(model)
    ids = build_calibration(tok, calib, nsamples=nsamples, seqlen=seqlen, model=m,
                            model_max_length=getattr(m.config, "max_position_embeddings", None)).input_ids
    extra = {k: v for k, v in (("alignment", alignment), ("min_per_head", min_per_head)) if v is not None}
    mask = lk.LeanKMask.calibrate(m, ids, k_keep=k_keep, method=method, sink=sink, window=window,
                                  **extra)
    path = save_spec(mask, out_path)
    _console().print(f"LeanK {method} mask, k_keep={k_keep}: {path}")
