"""LeanK: static key-channel pruning of the KV cache (Zhang et al., "LeanK: Learnable K
Cache Channel Pruning for Efficient Decoding", EMNLP 2025).

What is pruned
    Per layer and KV head, a static mask over the ``head_dim`` channels of the keys
    *after* rotary embedding. Queries are rotated in full; only their kept channels meet
    the kept key channels. With GQA the query heads of a group share their KV head's
    mask. The first ``sink`` tokens (attention sinks) and the most recent ``window``
    tokens keep full keys; only the middle of the cache is pruned. A KV head whose
    channels all go ("dead" head) attends only to its sink + window tokens, so its middle
    V cache is dropped too. Attention scores keep the ``1/sqrt(head_dim)`` scale.

    For a query at position ``p`` and a key at position ``j <= p`` of KV head ``h``::

        score = q_p . k_j / sqrt(D)                     if j < sink or j > p - window
        score = (q_p * s_h)[kept_h] . k_j[kept_h] / sqrt(D)   otherwise (-inf if h is dead)

    where ``s_h`` are the per-channel scales learned in stage 2 (1 for the magnitude mask).
    This per-query rule is exactly what a decoder sees token after token, so prefill
    perplexity under the rule equals the perplexity of decoding with a LeanK cache.

Defaults (:data:`DEFAULT_SINK` = 64, :data:`DEFAULT_WINDOW` = 448): sink + window = 512
    tokens, as the issue's protocol asks (at 512-token windows nothing is pruned; at 2,048
    the last query sees 1,536 pruned middle tokens). LeanK itself keeps a few sink tokens
    and a recent window of a few hundred tokens; a 135M model with 64-dim heads has little
    key redundancy to spare, so a wide window protects local syntax, which is what
    perplexity mostly measures; the middle is where long contexts spend their bytes.

How the mask is chosen (:func:`learn_mask`)
    * ``method="learned"`` (LeanK's two stages): stage 1 (:func:`learn_scales`) trains
      per-channel scales ``alpha in [0, 1]`` (init 1) applied to the pruned-region query
      channels, with the model frozen, by distillation plus ``l1 * mean(alpha)`` (L1
      ramped from 0); the importance of a channel is its mean ``alpha`` over the ramp.
      Stage 2 keeps the ``k_keep`` fraction of channels with the largest importance
      (global quantile over all layers and heads, in blocks of ``alignment`` channels so
      every head keeps a multiple of ``alignment``), then fine-tunes the kept scales from 1
      for a few steps with the binary mask fixed (no L1; :func:`finetune_scales`).
      Training regime: calibration windows of 2,048 tokens (:data:`DEFAULT_CALIB_SEQLEN`)
      with the deployment sink / window, so the pruned keys are as far from the queries
      as at inference (channel importance depends on that distance through the rotary
      frequencies); the loss covers ``train_queries`` query positions per window.
      Deviation from the paper: the distillation target is each layer's attention output
      (after ``o_proj``) from the dense model's inputs to that layer, not the model's
      output (no backward pass through the network, ~10 min on one CPU thread).
    * ``method="magnitude"`` (training-free baseline): importance of channel ``c`` of KV
      head ``h`` is ``||q_c|| * ||k_c||`` over calibration tokens (q aggregated over the
      group's query heads), normalised to each head's total, then the same global aligned
      selection; kept scales are 1.

    Measured (SmolLM2-135M-Instruct, keep 0.3, sink 64 / window 448, WikiText-2 2,048-token
    windows 1-3, dense 23.06; masks learned on C4, 4 x 2,048 tokens): the old regime (2 x 256 tokens, train window 32) 24.39
    (+5.7%); the 2,048-token regime with stage 2 started from the stage-1 importances
    23.90 (+3.6%); binary mask, no stage 2: 23.32 (+1.1%); stage 2 from 1 (default):
    23.37 (+1.3%); magnitude (2 x 256 tokens) 26.43 (+14.6%). See README (LeanK) for the 10-window figures.

Evaluation: :func:`long_perplexity` (2,048-token windows) and :func:`retrieval_eval`
(a key-value fact at depths 0..100% of ~2,000 tokens of real text, asked at the end).

Modules: ``config`` (defaults, checks), ``spec`` (:class:`LeanKMask`, the registered
``"leank"`` variant spec, and :func:`learn_mask`), ``reference`` (the torch attention the
export computes), ``train`` (selection, magnitude baseline, two-stage training),
``evaluation``. The graph is ``exporters.leank``; the runtime session ``runtime.leank``.
"""

from __future__ import annotations

from .config import (DEFAULT_ALIGNMENT, DEFAULT_CALIB_NSAMPLES, DEFAULT_CALIB_SEQLEN, DEFAULT_SINK,
                     DEFAULT_WINDOW, check_leank_args, kv_geometry)
from .evaluation import long_perplexity, retrieval_eval, retrieval_prompts
from .reference import apply_reference
from .spec import LeanKMask, learn_mask
from .train import finetune_scales, learn_scales, magnitude_scores, select_channels

__all__ = ["LeanKMask", "learn_mask", "learn_scales", "magnitude_scores", "select_channels",
           "finetune_scales", "apply_reference", "long_perplexity", "retrieval_eval",
           "retrieval_prompts", "check_leank_args", "kv_geometry", "DEFAULT_SINK",
           "DEFAULT_WINDOW", "DEFAULT_ALIGNMENT", "DEFAULT_CALIB_NSAMPLES", "DEFAULT_CALIB_SEQLEN"]
