"""``edgeprune igprune``: calibrate an IG-Pruning spec (per-prompt sub-block masks) for ``export --variant``."""

from __future__ import annotations

import click

from edgeprune_runtime.errors import ConfigError

from ._app import cli
from ._common import _check_output, _console


@cli.command("igprune")
@click.argument("model")
@click.option("--skip-ratio", type=float, required=True,
              help="Fraction of the 2L attention/MLP sub-blocks each mask skips, in (0, 1).")
@click.option("--method", type=click.Choice(["ig", "l0", "angular"]), default="ig", show_default=True,
              help="ig: one learned mask per prompt cluster, routed per prompt; l0: one learned "
                   "(Hard-Concrete) mask; angular: ShortGPT Block Influence (static).")
@click.option("--ks", default="2,3,4", show_default=True,
              help="Cluster counts K swept (chosen by silhouette; recorded in the spec).")
@click.option("--steps", type=int, default=60, show_default=True,
              help="Hard-Concrete training steps per mask.")
@click.option("--embed-layer", type=int, default=None,
              help="Decoder layers the router runs (default 2).")
@click.option("--route-tokens", type=int, default=32, show_default=True,
              help="Prompt tokens the router embeds.")
@click.option("--calib", default=None, help="Calibration text (default: embedded text).")
@click.option("--nsamples", type=int, default=32, show_default=True)
@click.option("--seqlen", type=int, default=256, show_default=True)
@click.option("--out", "out_path", required=True,
              help="Spec file to write (.safetensors: it holds the router's centroids).")
def igprune_cmd(model, skip_ratio, method, ks, steps, embed_layer, route_tokens, calib, nsamples,
                seqlen, out_path):
    """Calibrate IG-Pruning (Qiao, Zhang, Feng; EMNLP 2025) on MODEL (checkpoint, HF folder,
    .gguf or alias) and save the spec; `edgeprune export CKPT OUT --variant FILE` builds the
    graph (a plain graph with a per-request sub-block mask)."""
    from ..calibration import build_calibration
    from ..igprune import IgPruneSpec, check_skip_ratio
    from ..variants import save_spec
    from .export import load_source

    skip_ratio = check_skip_ratio(skip_ratio)
    try:
        k_list = tuple(int(k) for k in str(ks).split(",") if k.strip())
    except ValueError:
        raise ConfigError(f"--ks {ks!r} is not a comma-separated list of integers",
                          "pass e.g. --ks 2,3,4") from None
    if steps < 1:
        raise ConfigError(f"--steps {steps} is not positive", "pass e.g. --steps 60")
    if str(out_path).endswith(".json"):
        raise ConfigError(f"--out {out_path}: an IG-Pruning spec holds arrays (the router's "
                          "centroids), which JSON cannot", "write it to a .safetensors file")
    _check_output(out_path, "--out", [model])
    m, tok, *_ = load_source(model)
    ids = build_calibration(tok, calib, nsamples=nsamples, seqlen=seqlen, model=m).input_ids
    spec = IgPruneSpec.calibrate(m, ids, skip_ratio=skip_ratio, method=method, ks=k_list,
                                 steps=steps, embed_layer=embed_layer, route_tokens=route_tokens)
    path = save_spec(spec, out_path)
    _console().print(f"IG-Pruning spec ({method}), skip_ratio={skip_ratio:g}: {len(spec.masks)} "
                     f"mask(s) of {spec.num_sub_blocks} sub-blocks, {spec.stats['n_skip']} skipped "
                     f"each; router: {spec.embed_layer} layer(s), {spec.route_tokens} tokens: {path}")
