"""Magnitude pruning: the data-free baseline of the pruning methods.

Removes the weights of smallest ``|W_ij|``, compared across the whole layer
(unstructured; as the baseline of Wanda, Sun et al. 2024, Sec. 4) or within every
``prune_m`` consecutive input weights of a row (N:M).
"""

from __future__ import annotations

import torch

from .base import LayerResult, LayerTask, Method, keep_mask_from_score, pattern_name


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


class Magnitude(Method):
    """Magnitude pruning (:class:`~edgeprune.recipe.MagnitudeConfig`)."""

    name = "magnitude"
    kind = "prune"
    data_free = True

    def compress_layer(self, task: LayerTask) -> LayerResult:
        c = self.config
        keep = magnitude_prune(task.weight, c.sparsity, c.prune_n, c.prune_m, task.mask)
        return LayerResult(weight=task.weight * keep, mask=keep, pattern=pattern_name(c))
