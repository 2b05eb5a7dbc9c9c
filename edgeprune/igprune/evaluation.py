"""Quality of IG-Pruning specs in PyTorch: perplexity and KL to the dense model, routed per
window exactly as the runtime routes per prompt (``IgPruneSpec.reference``)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


@torch.no_grad()
def window_metrics(model, spec, windows: torch.Tensor, dense_logp: list | None = None,
                   keep_logp: bool = False) -> dict:
    """Perplexity and KL to the dense model of ``model`` under ``spec`` on ``windows``.

    Each window (``int64 [n, seqlen]``) is one forward pass, routed by its own first
    ``spec.route_tokens`` tokens (``spec`` ``None``: the dense model).

    Args:
        dense_logp: the dense model's ``log_softmax`` per window (from a call with
            ``spec=None, keep_logp=True``), for the KL; recomputed when not given.
        keep_logp: return every window's ``log_softmax`` (``[seqlen, vocab]`` each).

    Returns:
        ``{"ppl", "nll", "kl_nats" (mean over positions of KL(dense || pruned)), "tokens",
        "routes" (mask index per window; None for the dense model), "logp" (per window
        with ``keep_logp``, else None)}``.
    """
    nll, kl, n, routes, logps = 0.0, 0.0, 0, [], []
    for k, w in enumerate(windows):
        ids = w[None].long()
        if spec is None:
            lg = model(ids, use_cache=False).logits[0].float()
        else:
            routes.append(int(spec.route(model, ids)[0]))
            with spec.reference(model, mask=routes[-1]):
                lg = model(ids, use_cache=False).logits[0].float()
        logp = torch.log_softmax(lg, -1)
        if keep_logp:
            logps.append(logp)
        nll += float(F.nll_loss(logp[:-1], ids[0, 1:], reduction="sum"))
        n += ids.shape[1] - 1
        ref = logp if spec is None else (dense_logp[k] if dense_logp is not None else
                                         torch.log_softmax(model(ids, use_cache=False).logits[0].float(), -1))
        kl += float((ref.exp() * (ref - logp)).sum(-1).sum())
    return {"ppl": float(np.exp(nll / max(n, 1))), "nll": nll / max(n, 1),
            "kl_nats": kl / max(len(windows) * windows.shape[1], 1), "tokens": n,
            "routes": routes if spec is not None else None, "logp": logps if keep_logp else None}


__all__ = ["window_metrics"]
