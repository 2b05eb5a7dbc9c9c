"""Wanda: Pruning by Weights and activations (Sun et al., ICLR 2024).

Score of weight ``W_ij`` (output ``i``, input ``j``), Eq. (1) of the paper::

    S_ij = |W_ij| * ||X_j||_2

where ``||X_j||_2`` is the L2 norm of input channel ``j`` over all calibration tokens.
Weights are compared *within each output row* (the paper's per-output comparison group)
and the lowest scores are removed; N:M keeps the ``prune_n`` highest scores of every
``prune_m`` consecutive inputs of a row. No weight update.

Fallback: a layer whose input norms are all zero (no information) is pruned by
magnitude within rows, and the layer is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerResult, LayerTask, Method, keep_mask_from_score, pattern_name
from .config import PruneOptions
from .registry import register_method


@dataclass
class WandaConfig(PruneOptions):
    """Wanda (Sun et al. 2024): prune by ``|W_ij| * ||X_j||_2`` within each output row."""

    method = "wanda"


def wanda_prune(w: torch.Tensor, act_norm: torch.Tensor, sparsity: float = 0.5,
                prune_n: int = 0, prune_m: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Keep-mask of Wanda.

    Args:
        w: ``[out, in]`` weight.
        act_norm: ``[in]`` ``||X_j||_2`` over the calibration tokens.
        sparsity: fraction removed per row (the layer total is exact, see
            :func:`~edgeprune.methods.base.row_keep_mask`); ignored with N:M.
        prune_n, prune_m: N:M pattern.
        mask: earlier keep-mask; already-pruned weights score lowest.

    Returns:
        ``bool [out, in]`` keep-mask.
    """
    score = w.abs().float() * act_norm.float().reshape(1, -1)
    return keep_mask_from_score(score, sparsity, prune_n, prune_m, mask, per_row=True)


@register_method(WandaConfig)
class Wanda(Method):
    """Wanda pruning (:class:`WandaConfig`)."""

    def compress_layer(self, task: LayerTask) -> LayerResult:
        c = self.config
        norm = task.stats.act_norm
        notes = []
        if not bool((norm > 0).any()) or not bool(torch.isfinite(norm).all()):
            notes.append(f"{task.name}: no usable calibration activations -> magnitude within rows")
            norm = torch.ones_like(norm)
        keep = wanda_prune(task.weight, norm, c.sparsity, c.prune_n, c.prune_m, task.mask)
        return LayerResult(weight=task.weight * keep, mask=keep, pattern=pattern_name(c), notes=notes)
