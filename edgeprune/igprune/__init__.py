"""IG-Pruning: input-guided dynamic depth (per-prompt attention / MLP sub-block masks).

IG-Pruning (Qiao, Zhang, Feng; EMNLP 2025, "IG-Pruning: Input-Guided Block Pruning for
Large Language Models") bypasses whole sub-blocks, but not the same ones for every input:
stage 1 clusters calibration prompts (here embedded by the model's own early layers,
:mod:`.router`) with K-means and learns one Hard-Concrete / L0 mask (Louizos et al. 2018,
:mod:`.train`) over the ``2L`` attention and MLP sub-blocks per cluster, keeping the dense
model's logits (KL) at a target skip ratio; stage 2 routes each prompt to its nearest
centroid's mask. Static baselines at the same skip ratio: ShortGPT's Block Influence
(Men et al. 2024, :mod:`.importance`) and the best single L0 mask.

Public API::

    specs = calibrate_all(model, calib_ids, 0.25)          # {"ig", "l0", "angular"}
    spec = IgPruneSpec.calibrate(model, calib_ids, skip_ratio=0.25, method="ig")
    save_spec(spec, "ig.safetensors")                      # edgeprune igprune
    with spec.reference(model):                            # routed, what the graph computes
        logits = model(ids).logits
    exporters.export_onnx(model, tok, out, variants=[spec])   # edgeprune export --variant

Modules: ``config`` (checks, defaults), ``gates`` (PyTorch sub-block gates), ``importance``
(Block Influence), ``router`` (embeddings, K-means, nearest centroid), ``train``
(Hard-Concrete masks), ``spec`` (:class:`IgPruneSpec`, :func:`calibrate_all`),
``evaluation`` (routed perplexity / KL). The graph is ``exporters.igprune``; the runtime
session ``runtime.igprune``.
"""

from __future__ import annotations

from .config import DEFAULT_KS, METHODS, check_mask, check_skip_ratio, skip_count
from .gates import gated, masked, sub_blocks
from .importance import angular_mask, block_influence
from .router import kmeans, nearest, prompt_embeddings, standardize, sweep_k
from .spec import IgPruneSpec, calibrate_all
from .train import train_mask

__all__ = ["IgPruneSpec", "calibrate_all", "train_mask", "block_influence", "angular_mask",
           "prompt_embeddings", "standardize", "nearest", "kmeans", "sweep_k", "gated", "masked",
           "sub_blocks", "check_skip_ratio", "check_mask", "skip_count", "METHODS", "DEFAULT_KS"]
