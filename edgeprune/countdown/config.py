"""COUNTDOWN settings and their checks: modes, predictor kinds, defaults, gated MLPs."""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError, UnsupportedArchitectureError

MODES = ("m", "d")
PREDICTORS = ("q4", "lowrank")
DEFAULT_PREDICTOR = "q4"
DEFAULT_RANK = 64
DEFAULT_TRAIN_EPOCHS = 4
Q4_GROUP = 64


def check_act_sparsity(act_sparsity) -> float:
    """Validate ``act_sparsity`` (fraction of coefficients skipped per token).

    Raises:
        ConfigError: not a number in ``[0, 1)``.
    """
    try:
        s = float(act_sparsity)
    except (TypeError, ValueError):
        raise ConfigError(f"act_sparsity={act_sparsity!r} is not a number",
                          "pass a fraction in [0, 1), e.g. --act-sparsity 0.5") from None
    if not (0.0 <= s < 1.0) or math.isnan(s):
        raise ConfigError(f"act_sparsity={act_sparsity} is outside [0, 1)",
                          "pass the fraction of MLP coefficients to skip, e.g. 0.5 or 0.7")
    return s


def check_mode(mode) -> str:
    """Validate ``mode`` (``"m"`` or ``"d"``); raises :class:`ConfigError`."""
    m = str(mode).lower().replace("-countdown", "")
    if m not in MODES:
        raise ConfigError(f"countdown mode {mode!r} is unknown",
                          "use 'm' (M-COUNTDOWN, threshold on |up(x)|) or 'd' "
                          "(D-COUNTDOWN, predictor of the direct coefficient)")
    return m


def gated_mlps(model) -> list:
    """The MLP modules of every decoder layer, checked to be gated (SwiGLU-style).

    Returns:
        ``[layer.mlp]`` with ``gate_proj``, ``up_proj``, ``down_proj`` (``nn.Linear``)
        and ``act_fn``.

    Raises:
        UnsupportedArchitectureError: no ``model.model.layers``, or an MLP that is not
            gated (e.g. GPT-2 style ``fc -> act -> proj``), which COUNTDOWN's
            indirect/direct coefficient split does not apply to.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} has no model.layers",
            "COUNTDOWN supports llama/qwen2-style decoders (model.model.layers[i].mlp)")
    out = []
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        ok = mlp is not None and all(
            isinstance(getattr(mlp, n, None), torch.nn.Linear)
            for n in ("gate_proj", "up_proj", "down_proj")) and hasattr(mlp, "act_fn")
        if not ok:
            raise UnsupportedArchitectureError(
                f"layer {i} MLP ({type(mlp).__name__}) is not gated: COUNTDOWN needs "
                "down(act(gate(x)) * up(x)) with gate_proj/up_proj/down_proj linears",
                "use a SwiGLU model (llama, qwen2); non-gated MLPs are not supported")
        if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj")):
            raise UnsupportedArchitectureError(
                f"layer {i} MLP has biases on gate/up projections",
                "COUNTDOWN is implemented for bias-free gated MLPs (llama, qwen2)")
        out.append(mlp)
    return out


def check_graph_mode(graph_mode) -> str:
    """Validate the exported graph's mode (``"if"``, ``"sparse"``, ``"dense"``: see
    ``exporters.countdown``); raises :class:`ConfigError`."""
    from edgeprune_exporters.countdown import GRAPH_MODES
    if graph_mode not in GRAPH_MODES:
        raise ConfigError(f"countdown graph_mode={graph_mode!r} is unknown",
                          f"use one of {', '.join(GRAPH_MODES)}")
    return graph_mode


__all__ = ["check_act_sparsity", "check_mode", "check_graph_mode", "gated_mlps", "MODES",
           "PREDICTORS", "DEFAULT_PREDICTOR", "DEFAULT_RANK", "DEFAULT_TRAIN_EPOCHS", "Q4_GROUP"]
