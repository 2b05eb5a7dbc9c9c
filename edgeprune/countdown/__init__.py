"""COUNTDOWN: contextual sparse-activation filtering of the MLP down projection.

COUNTDOWN (Cheon et al., EMNLP 2025) reads a gated MLP
``y = W_down (act(W_gate x) ⊙ W_up x)`` as a linear combination of the *columns* of
``W_down`` weighted by the coefficients ``c = act(W_gate x) ⊙ W_up x`` (``[I]`` per
token). For a given token most coefficients are negligible; skipping coefficient ``j``
skips reading row ``j`` of ``W_gate`` (and of ``W_up``) and column ``j`` of ``W_down``.

Two variants, both implemented here as an *exact* PyTorch reference (every position of a
teacher-forced window is filtered the way a decoded token would be):

* **M-COUNTDOWN** thresholds the *indirect* coefficient ``u = W_up x`` (computed in full),
  no predictor. The paper keeps ``|u_j| > τ_l``; our default refinement keeps
  ``|u_j f_j| > τ_l`` with a static per-channel scale ``f_j = E|act(gate_j(x))| *
  ||W_down[:, j]||`` (calibration mean; ``channel_scale="none"`` is the paper's rule):
  ``|u_j| f_j`` is the expected size of term ``j`` of the down projection given ``u_j``.
  Measured on SmolLM2-135M at 50%: +16.0% WikiText-2 ppl (40 windows) vs +31% for ``|u|``
  (``bench/countdown_study.py``; README "COUNTDOWN").
* **D-COUNTDOWN** predicts the *direct* coefficient from the block input and thresholds
  it, so up and gate rows and down columns are all skipped. Default predictor
  (``predictor="q4"``, our design): a 4-bit RTN copy (asym, blocks of 64 along ``H``) of
  ``W_gate`` and ``W_up``, ``ĉ = act(x Ŵ_g^T) ⊙ (x Ŵ_u^T) ⊙ ||W_down[:, j]||`` — about
  9.5% of the fp32 MLP bytes on SmolLM2-135M, the same budget as a rank-64 low-rank
  predictor, and near the oracle (recall 0.89 of the true top-30% at 70%; +3.9% / +17.4% /
  +224% ppl at 50 / 70 / 90% vs the oracle's +2.9% / +15.8% / +216%, 40 windows). ``predictor="lowrank"``: ``ĉ = act(x V_g U_g) ⊙ (x V_u U_u)``,
  ``V [H, r]``, ``U [r, I]`` initialised by reduced-rank regression (closed form: whiten
  ``x``, truncated SVD of the whitened weight) then trained (:func:`train_predictor`) to
  regress the down-column-weighted direct coefficient; it stays far from the oracle on
  this model (rank 64, 70%: +250% trained, +674% closed form). ``keep_j = |ĉ_j| > τ_l``.
  Recall of the truly large coefficients (the top ``1 - s`` of ``|c|`` per token) is
  reported on calibration data and by :func:`evaluate`.

Thresholds (``threshold_rule="pooled"``, default): ``τ_l`` is the ``s``-quantile of all
calibration scores of layer ``l``, so the mean token skips ``s`` and each token's count
follows its context (an oracle keeping the true top ``|c| ||W_down col||`` this way beat a
fixed per-token count: +16% vs +24% at 70%). ``"median"``: the median over tokens of each
token's ``k``-th smallest score (first implementation). Per-layer sparsity is uniform by
default: the greedy allocation (``allocation="greedy"``) keeps the mean but *hurt* every
variant tried (oracle at 50%: +13% greedy vs +2.6% uniform).

Oracle bound on SmolLM2-135M (true top ``|c|`` per token, ``bench/countdown_study.py``):
+2.9% at 50%, +15.8% at 70%, +216% at 90% (40 windows) — so +10% at 70% is out of reach of any
per-token coefficient filter on this model.

Act-sparsity ``s = 0`` keeps every coefficient (threshold ``-1``): the output equals the
dense model exactly.

Public API::

    spec = calibrate(model, calib_ids, act_sparsity=0.5, mode="m")   # -> CountdownSpec
    with apply_reference(model, spec):                               # filtered forward
        logits = model(ids).logits
    res = evaluate(model, tok, spec, text)                           # ppl / KL / top-1
    spec.save("cd.safetensors")                                      # edgeprune countdown
    exporters.export_onnx(model, tok, out_dir, variants=[spec])      # ONNX (sparse decode)

Modules: ``config`` (modes, defaults, checks), ``spec`` (:class:`CountdownSpec`, the
registered ``"countdown"`` variant spec, :func:`calibrate`, :func:`calibrate_many`),
``reference`` (the exact filtered MLP in torch), ``calibration`` (thresholds and
predictors), ``evaluation``. The graph is ``exporters.countdown``; the runtime session
``runtime.countdown``.
"""

from __future__ import annotations

from .calibration import (_greedy_allocation, collect_mlp_inputs, lowrank_factors,  # noqa: F401
                          per_token_threshold, pooled_threshold, predictor_bytes, q4_predictor,
                          train_predictor)
from .config import (DEFAULT_PREDICTOR, DEFAULT_RANK, DEFAULT_TRAIN_EPOCHS, MODES, PREDICTORS,
                     Q4_GROUP, check_act_sparsity, check_graph_mode, check_mode, gated_mlps)
from .evaluation import evaluate, evaluate_many
from .reference import apply_reference, filtered_mlp, keep_mask, m_score, predictor_score, q4_dequantize
from .spec import CountdownSpec, calibrate, calibrate_many

__all__ = ["q4_predictor", "q4_dequantize", "predictor_bytes", "train_predictor",
           "pooled_threshold", "m_score", "CountdownSpec", "calibrate", "calibrate_many",
           "evaluate_many", "apply_reference", "evaluate", "filtered_mlp", "keep_mask",
           "predictor_score", "lowrank_factors", "per_token_threshold", "collect_mlp_inputs",
           "gated_mlps", "check_act_sparsity", "check_mode", "check_graph_mode", "MODES",
           "PREDICTORS", "DEFAULT_PREDICTOR", "DEFAULT_RANK", "DEFAULT_TRAIN_EPOCHS", "Q4_GROUP"]
