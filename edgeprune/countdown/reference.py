"""The COUNTDOWN reference (torch): the exact filtered MLP the exported graph computes.

The spec is duck-typed (``mode``, ``act_sparsity``, ``thresholds``, ``predictors``,
``num_layers``: :class:`edgeprune.countdown.CountdownSpec`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .config import gated_mlps


def _act(mlp, x):
    return mlp.act_fn(x)


def q4_dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """``(code - zero) * scale`` per block of ``block_size`` input columns:
    ``uint8 [N, K]`` codes, ``[N, nb]`` scales/zeros -> float32 ``[N, K]`` (the values
    ONNX Runtime's ``MatMulNBits`` multiplies by)."""
    g = torch.arange(codes.shape[1]) // int(block_size)
    return (codes.float() - zeros.float()[:, g]) * scales.float()[:, g]


def predictor_score(pred: dict, x: torch.Tensor, act=F.silu) -> torch.Tensor:
    """D-COUNTDOWN predicted direct coefficient ``[..., H] -> [..., I]``.

    Low-rank: ``ĉ = act(x V_g U_g) ⊙ (x V_u U_u)``. q4: ``ĉ = act(x Ŵ_g^T) ⊙ (x Ŵ_u^T) ⊙ f``
    with ``Ŵ`` the 4-bit copies (:func:`q4_dequantize`) and ``f = ||W_down[:, j]||``."""
    if "gate_codes" in pred:
        bs = int(pred["block_size"].reshape(-1)[0])
        wg = q4_dequantize(pred["gate_codes"], pred["gate_scales"], pred["gate_zeros"], bs)
        wu = q4_dequantize(pred["up_codes"], pred["up_scales"], pred["up_zeros"], bs)
        c = act(x @ wg.T.to(x.dtype)) * (x @ wu.T.to(x.dtype))
        return c * pred["channel_scale"].to(x.dtype)
    g = (x @ pred["v_gate"].to(x.dtype)) @ pred["u_gate"].to(x.dtype)
    u = (x @ pred["v_up"].to(x.dtype)) @ pred["u_up"].to(x.dtype)
    return act(g) * u


def m_score(u: torch.Tensor, pred: Optional[dict] = None) -> torch.Tensor:
    """M-COUNTDOWN score ``|up(x) ⊙ f|`` (``f = pred["channel_scale"] [I]``, positive) or
    the paper's ``|up(x)|`` when there is no channel scale: ``[..., I] -> [..., I]``.

    The product is taken before ``Abs`` (same order as the ONNX graph, so both select
    the same coefficients bit for bit)."""
    if pred and "channel_scale" in pred:
        u = u * pred["channel_scale"].to(u.dtype)
    return u.abs()


def keep_mask(mlp, x: torch.Tensor, mode: str, tau: float, pred: Optional[dict] = None,
              up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which coefficients of ``x [..., H]`` are kept: bool ``[..., I]``.

    M: ``|up(x) ⊙ f| > τ`` (:func:`m_score`; ``f`` the static channel scale, absent = 1);
    D: ``|ĉ(x)| > τ`` (:func:`predictor_score`). ``τ < 0`` keeps all.
    """
    if tau < 0:
        ref = mlp.up_proj(x) if up is None else up
        return torch.ones_like(ref, dtype=torch.bool)
    if mode == "m":
        u = mlp.up_proj(x) if up is None else up
        return m_score(u, pred) > tau
    return predictor_score(pred, x, lambda t: _act(mlp, t)).abs() > tau


def filtered_mlp(mlp, x: torch.Tensor, mode: str, tau: float, pred: Optional[dict] = None,
                 counter: Optional[list] = None, recall: Optional[list] = None,
                 recall_s: float = 0.0) -> torch.Tensor:
    """Exact COUNTDOWN MLP: ``down((act(gate(x)) ⊙ up(x)) ⊙ keep)``, ``[..., H] -> [..., H]``.

    Computed densely then masked (the reference; the ONNX graph computes only the kept
    rows/columns, with the same result). ``counter`` (``[kept, total]``) accumulates counts;
    ``recall`` (``[hits, top]``) accumulates how many of each token's truly largest
    ``round((1 - recall_s) I)`` coefficients ``|c_j|`` were kept.
    """
    u = mlp.up_proj(x)
    keep = keep_mask(mlp, x, mode, tau, pred, up=u)
    if counter is not None:
        counter[0] += int(keep.sum())
        counter[1] += keep.numel()
    c = _act(mlp, mlp.gate_proj(x)) * u
    if recall is not None and recall_s > 0:
        nk = c.shape[-1] - int(round(recall_s * c.shape[-1]))
        top = c.abs().topk(nk, dim=-1).indices
        recall[0] += int(keep.gather(-1, top).sum())
        recall[1] += top.numel()
    return mlp.down_proj(c * keep.to(c.dtype))


@contextlib.contextmanager
def apply_reference(model, spec, counters: Optional[list] = None,
                    recall: Optional[list] = None):
    """Patch every MLP of ``model`` with the exact COUNTDOWN filter (context manager).

    Inside the ``with`` block every position of every forward pass is filtered (the
    teacher-forced view of what each decoded token sees). The original ``forward`` is
    restored on exit, even on error.

    Args:
        model: llama/qwen2 causal LM (checked by :func:`gated_mlps`).
        spec: :class:`~edgeprune.countdown.CountdownSpec` with one threshold per layer.
        counters: optional list, filled with one ``[kept, total]`` pair per layer.
        recall: optional list, filled with one ``[hits, top]`` pair per layer: of each
            token's truly largest ``1 - act_sparsity`` coefficients ``|c|``, how many
            were kept (recall of the large coefficients, :func:`filtered_mlp`).

    Raises:
        UnsupportedArchitectureError: non-gated MLP.
        ConfigError: the spec's layer count differs from the model's.
    """
    mlps = gated_mlps(model)
    if len(mlps) != spec.num_layers:
        raise ConfigError(f"the COUNTDOWN spec has {spec.num_layers} layers, the model "
                          f"{len(mlps)}", "calibrate the spec on this model")
    if spec.mode == "d" and spec.act_sparsity > 0 and not spec.predictors:
        raise ConfigError("D-COUNTDOWN spec without predictors", "calibrate with mode='d'")
    if counters is not None:
        counters.clear()
        counters.extend([0, 0] for _ in mlps)
    if recall is not None:
        recall.clear()
        recall.extend([0, 0] for _ in mlps)
    saved = []
    try:
        for i, mlp in enumerate(mlps):
            saved.append((mlp, mlp.__dict__.get("forward")))
            pred = spec.predictors[i] if spec.predictors else None
            cnt = counters[i] if counters is not None else None
            rc = recall[i] if recall is not None else None

            def fwd(x, _m=mlp, _t=float(spec.thresholds[i]), _p=pred, _c=cnt, _r=rc):
                return filtered_mlp(_m, x, spec.mode, _t, _p, _c, _r, spec.act_sparsity)

            mlp.forward = fwd
        yield model
    finally:
        for mlp, old in saved:
            if old is None:
                mlp.__dict__.pop("forward", None)
            else:
                mlp.forward = old


__all__ = ["apply_reference", "filtered_mlp", "keep_mask", "predictor_score", "m_score",
           "q4_dequantize"]
