"""Hard-Concrete / L0 sub-block masks trained to keep the dense model's output.

Hard Concrete (Louizos, Welling, Kingma, ICLR 2018, "Learning Sparse Neural Networks
through L0 Regularization"): gate ``z = min(1, max(0, s (zeta - gamma) + gamma))`` with
``s = sigmoid((log u - log(1 - u) + log_alpha) / beta)``, ``u ~ U(0, 1)``; the expected
number of open gates is ``sum_j sigmoid(log_alpha_j - beta log(-gamma / zeta))``
(differentiable in ``log_alpha``). As in IG-Pruning (Qiao, Zhang, Feng; EMNLP 2025),
one gate per sub-block (``2L``: attention and MLP of every layer); the loss is the KL of
the dense model's next-token distribution to the gated one's, plus
``lambda (E[kept] / 2L - (1 - skip_ratio))^2``. Only ``log_alpha`` is trained (the
model is frozen). The final mask keeps the ``2L - n_skip`` sub-blocks of largest
``log_alpha``, so every mask hits the target skip count exactly.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .config import DEFAULT_BATCH, DEFAULT_LR, DEFAULT_SPARSITY_WEIGHT, DEFAULT_STEPS
from .gates import gated

BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1


def hard_concrete_sample(log_alpha: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One Hard-Concrete sample ``z in [0, 1]`` per entry of ``log_alpha``."""
    u = torch.rand(log_alpha.shape, generator=gen).clamp(1e-6, 1 - 1e-6)
    s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / BETA)
    return (s * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)


def expected_open(log_alpha: torch.Tensor) -> torch.Tensor:
    """``P(z_j > 0)`` per gate (the L0 norm's expectation, summed by the caller)."""
    return torch.sigmoid(log_alpha - BETA * math.log(-GAMMA / ZETA))


def top_mask(scores, n_skip: int) -> list:
    """Keep all but the ``n_skip`` lowest ``scores`` (ties: the later sub-block skipped)."""
    order = sorted(range(len(scores)), key=lambda j: (float(scores[j]), -j))
    skip = set(order[:n_skip])
    return [0 if j in skip else 1 for j in range(len(scores))]


def kl_to_dense(logits: torch.Tensor, dense_logp: torch.Tensor) -> torch.Tensor:
    """Mean over positions of ``KL(p_dense || p_gated)`` (nats)."""
    logp = torch.log_softmax(logits.float(), -1)
    return (dense_logp.exp() * (dense_logp - logp)).sum(-1).mean()


def train_mask(model, calib_ids: torch.Tensor, n_skip: int, *, init: Optional[np.ndarray] = None,
               log_alpha0=None, steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR,
               batch: int = DEFAULT_BATCH, sparsity_weight: float = DEFAULT_SPARSITY_WEIGHT,
               seed: int = 0) -> dict:
    """Learn one Hard-Concrete mask over the ``2L`` sub-blocks on ``calib_ids``.

    Args:
        model: llama-style HF causal LM (frozen; its ``requires_grad`` flags are restored).
        calib_ids: ``int64 [n, seqlen]`` windows (one cluster's, or all for the single
            static L0 mask).
        n_skip: sub-blocks the final mask skips.
        init: ``[2L]`` initial scores (e.g. Block Influence); ``log_alpha`` starts at
            ``1.5 * standardised(init) + 2`` (all ``2`` without it).
        log_alpha0: ``[2L]`` starting ``log_alpha`` (e.g. the single mask's, to refine it
            on one cluster); overrides ``init``.
        steps, lr, batch: Adam steps on ``log_alpha``, its learning rate, windows per step.
        sparsity_weight: ``lambda`` of the sparsity penalty.
        seed: seed of the window order and the gate noise.

    Returns:
        ``{"mask": [2L] ints, "log_alpha": [2L] floats, "kl_first", "kl_last",
        "expected_kept"}`` (KL of the sampled gates, nats per token).
    """
    n = 2 * model.config.num_hidden_layers
    target = 1.0 - n_skip / n
    la0 = np.full(n, 2.0)
    if init is not None:
        v = np.asarray(init, np.float64)
        la0 = 2.0 + 1.5 * (v - v.mean()) / max(v.std(), 1e-12)
    if log_alpha0 is not None:
        la0 = np.asarray(log_alpha0, np.float64).reshape(n)
    log_alpha = torch.nn.Parameter(torch.tensor(la0, dtype=torch.float32))
    opt = torch.optim.Adam([log_alpha], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    z: dict = {}
    kls = []
    try:
        with gated(model, lambda j: z["z"][j]):
            for step in range(steps):
                idx = torch.randint(len(calib_ids), (min(batch, len(calib_ids)),), generator=gen)
                ids = calib_ids[idx]
                with torch.no_grad():
                    z["z"] = torch.ones(n)
                    dense = torch.log_softmax(model(ids).logits.float(), -1)
                z["z"] = hard_concrete_sample(log_alpha, gen)
                kl = kl_to_dense(model(ids).logits, dense)
                gap = expected_open(log_alpha).mean() - target
                loss = kl + sparsity_weight * gap * gap
                opt.zero_grad()
                loss.backward()
                opt.step()
                kls.append(float(kl.detach()))
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
    la = log_alpha.detach().numpy().astype(np.float64)
    return {"mask": top_mask(la, n_skip), "log_alpha": [float(v) for v in la],
            "kl_first": kls[0] if kls else None, "kl_last": float(np.mean(kls[-5:])) if kls else None,
            "expected_kept": float(expected_open(log_alpha.detach()).sum())}


@torch.no_grad()
def mask_kl(model, calib_ids: torch.Tensor, masks: list, batch: int = DEFAULT_BATCH) -> list:
    """Mean ``KL(p_dense || p_masked)`` (nats per position) of each 0/1 mask of ``masks``
    (``[2L]`` lists) on ``calib_ids`` (``int64 [n, seqlen]``); one dense pass per batch
    is shared by the masks."""
    from .gates import masked

    sums = [0.0] * len(masks)
    for s in range(0, len(calib_ids), batch):
        ids = calib_ids[s:s + batch]
        dense = torch.log_softmax(model(ids).logits.float(), -1)
        for k, m in enumerate(masks):
            with masked(model, torch.tensor(m)):
                sums[k] += float(kl_to_dense(model(ids).logits, dense)) * len(ids)
    return [v / max(len(calib_ids), 1) for v in sums]


__all__ = ["train_mask", "mask_kl", "hard_concrete_sample", "expected_open", "top_mask", "kl_to_dense"]
