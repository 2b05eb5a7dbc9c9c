"""``edgeprune countdown``: calibrate a COUNTDOWN spec (sparse decode MLP) for ``export --variant``."""

from __future__ import annotations

import click

from edgeprune_runtime.errors import ConfigError

from ._app import cli
from ._common import _check_output, _console, threads_option


@cli.command("countdown")
@click.argument("model")
@click.option("--act-sparsity", type=float, required=True,
              help="Fraction of MLP coefficients skipped per decode token, in [0, 1).")
@click.option("--mode", type=click.Choice(["m", "d"]), default="d", show_default=True,
              help="m: threshold |up(x)| times a static channel scale (no predictor); d: predict "
                   "act(gate(x))*up(x) with a 4-bit copy of gate/up.")
@click.option("--graph-mode", type=click.Choice(["if", "sparse", "dense"]), default="if",
              show_default=True,
              help="Exported graph: if = sparse decode, dense prefill; sparse = every position "
                   "filtered; dense = never filtered (same weight layout).")
@click.option("--calib", default=None, help="Calibration text (default: embedded text).")
@click.option("--nsamples", type=int, default=16, show_default=True)
@click.option("--seqlen", type=int, default=512, show_default=True)
@threads_option(help="CPU threads for torch (default: all cores).")
@click.option("--out", "out_path", required=True,
              help="Spec file to write: .safetensors (predictors / channel scales; JSON only "
                   "at --act-sparsity 0).")
def countdown_cmd(model, act_sparsity, mode, graph_mode, calib, nsamples, seqlen, threads, out_path):
    """Calibrate COUNTDOWN (Cheon et al., EMNLP 2025) on MODEL (checkpoint, HF folder, .gguf
    or alias) and save the spec; `edgeprune export CKPT OUT --variant FILE` builds the graph."""
    from .. import countdown as cd
    from ..calibration import build_calibration
    from ..variants import save_spec
    from .export import load_source

    act_sparsity = cd.check_act_sparsity(act_sparsity)
    _check_output(out_path, "--out", [model])
    if act_sparsity > 0 and str(out_path).endswith(".json"):
        raise ConfigError(f"--out {out_path}: a COUNTDOWN spec holds arrays (predictors or channel "
                          "scales), which JSON cannot", "write it to a .safetensors file")
    m, tok, *_ = load_source(model)
    ids = build_calibration(tok, calib, nsamples=nsamples, seqlen=seqlen, model=m).input_ids
    spec = cd.CountdownSpec.calibrate(m, ids, act_sparsity=act_sparsity, mode=mode,
                                      graph_mode=graph_mode)
    path = save_spec(spec, out_path)
    _console().print(f"{mode.upper()}-COUNTDOWN spec, act_sparsity={act_sparsity:g} (realised "
                     f"{spec.stats.get('realised_sparsity_mean', 0.0):.3f} on the calibration "
                     f"tokens), graph_mode={graph_mode}: {path}")
