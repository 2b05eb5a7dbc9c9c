"""COUNTDOWN quality: teacher-forced perplexity, KL and top-1 agreement of the filtered
model (or an exported graph) against the same model unfiltered."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .reference import apply_reference


@torch.no_grad()
def evaluate(model, tokenizer, spec, text=None, *, seqlen: int = 512,
             nwindows: Optional[int] = 40, progress: bool = False) -> dict:
    """Teacher-forced quality of the filtered model vs the same model unfiltered.

    Same protocol as :func:`edgeprune.evaluate.fidelity` (WikiText-2 style: no BOS,
    non-overlapping windows of ``seqlen``), with the filter applied at every position.

    Returns:
        ``{"ppl_dense", "ppl", "ppl_increase_pct", "kl", "top1_agree",
        "realised_sparsity", "recall_top", "protocol"}``; KL(dense || filtered) in
        nats/token, realised sparsity = fraction of coefficients skipped over all scored
        positions and layers; ``recall_top`` = fraction of each token's truly largest
        ``1 - act_sparsity`` coefficients ``|c|`` that were kept (None for s = 0 or a
        ``logits_fns`` backend).
    """
    return evaluate_many(model, tokenizer, [spec], text, seqlen=seqlen, nwindows=nwindows,
                         progress=progress)[0]


@torch.no_grad()
def evaluate_many(model, tokenizer, specs, text=None, *, seqlen: int = 512,
                  nwindows: Optional[int] = 40, progress: bool = False,
                  logits_fns: Optional[dict] = None) -> list:
    """:func:`evaluate` for several specs, computing the dense logits once per window.

    Args:
        logits_fns: optional ``{index: fn(ids [1,S]) -> logits}`` replacing the PyTorch
            reference of ``specs[index]`` (e.g. an always-sparse ONNX session), so the
            exported graph is scored under the same protocol.
    """
    from ..evaluate import eval_windows

    windows, proto = eval_windows(tokenizer, text, seqlen=seqlen, nwindows=nwindows)
    n = len(specs)
    acc = [dict(kl=0.0, agree=0.0, nll=0.0, kept=0, total=0, hit=0, top=0) for _ in range(n)]
    nll_d = 0.0
    it = windows
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(windows, desc="countdown eval", unit="win", leave=False)
    for w in it:
        ids = w[None]
        ld = F.log_softmax(model(ids, use_cache=False).logits[0, :-1].float(), -1)
        nll_d += F.nll_loss(ld, w[1:], reduction="sum").item()
        pd = ld.exp()
        for j, spec in enumerate(specs):
            counters: list = []
            rec: list = []
            if logits_fns and j in logits_fns:
                lo = logits_fns[j](ids)
                lo = lo if isinstance(lo, torch.Tensor) else torch.from_numpy(lo)
            else:
                with apply_reference(model, spec, counters, rec):
                    lo = model(ids, use_cache=False).logits
            lm = F.log_softmax(lo[0, :-1].float(), -1)
            a = acc[j]
            a["kl"] += (pd * (ld - lm)).sum().item()
            a["agree"] += (ld.argmax(-1) == lm.argmax(-1)).sum().item()
            a["nll"] += F.nll_loss(lm, w[1:], reduction="sum").item()
            a["kept"] += sum(k for k, _ in counters)
            a["total"] += sum(t for _, t in counters)
            a["hit"] += sum(h for h, _ in rec)
            a["top"] += sum(t for _, t in rec)
    N = proto.ntokens_scored
    ppl_d = math.exp(nll_d / N)
    out = []
    for a in acc:
        ppl = math.exp(a["nll"] / N)
        out.append({"ppl_dense": ppl_d, "ppl": ppl, "ppl_increase_pct": 100.0 * (ppl / ppl_d - 1),
                    "kl": a["kl"] / N, "top1_agree": a["agree"] / N,
                    "realised_sparsity": (1.0 - a["kept"] / a["total"]) if a["total"] else None,
                    "recall_top": (a["hit"] / a["top"]) if a["top"] else None,
                    "protocol": proto.to_dict()})
    return out


__all__ = ["evaluate", "evaluate_many"]
