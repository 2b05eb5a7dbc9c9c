"""Magnitude pruning: the data-free baseline of the pruning methods.

Score of weight ``W_ij``::

    S_ij = |W_ij|

The weights of lowest score are removed, compared across the whole layer
(unstructured; as the baseline of Wanda, Sun et al. 2024, Sec. 4) or within every
``prune_m`` consecutive input weights of a row (N:M).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerResult, LayerTask, Method, keep_mask_from_score, pattern_name
from .config import PruneOptions
from .registry import register_method


@dataclass
class MagnitudeConfig(PruneOptions):
    """Magnitude pruning (baseline): remove the smallest ``|W|`` in each layer (or N:M)."""

    method = "magnitude"


def magnitude_prune(w: torch.Tensor, sparsity: float = 0.5, prune_n: int = 0, prune_m: int = 0,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """Keep-mask of magnitude pruning.

    Args:
        w: ``[out, in]`` weight.
        sparsity: fraction removed (unstructured, per layer); ignored when ``prune_n`` set.
        prune_n, prune_m: keep ``prune_n`` of every ``prune_m`` consecutive inputs.
        mask: an earlier keep-mask; already-pruned weights score lowest.

    Returns:
        ``bool [out, in]`` keep-mask.
    """
    return keep_mask_from_score(w.abs(), sparsity, prune_n, prune_m, mask, per_row=False)


@register_method(MagnitudeConfig)
class Magnitude(Method):
    """Magnitude pruning (:class:`MagnitudeConfig`)."""

    data_free = True

    def compress_layer(self, task: LayerTask) -> LayerResult:
        c = self.config
        keep = magnitude_prune(task.weight, c.sparsity, c.prune_n, c.prune_m, task.mask)
        return LayerResult(weight=task.weight * keep, mask=keep, pattern=pattern_name(c))
