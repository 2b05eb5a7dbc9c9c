"""ShortGPT Block Influence of the attention and MLP sub-blocks: the static angular baseline.

ShortGPT (Men et al., 2024, "ShortGPT: Layers in Large Language Models are More Redundant
Than You Expect") scores a block by its Block Influence ``BI = 1 - E_t cos(x_t, y_t)``,
``x_t`` the hidden state entering the block and ``y_t`` the one leaving it, averaged over
the calibration tokens, and removes the blocks of lowest BI. Here each layer's attention
and MLP are scored separately (``y = x + attn(norm(x))``, then ``y' = y + mlp(norm(y))``),
as IG-Pruning's static baseline over the ``2L`` sub-blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from .gates import decoder_layers


@torch.no_grad()
def block_influence(model, calib_ids: torch.Tensor, batch: int = 4) -> np.ndarray:
    """Block Influence of every sub-block on calibration windows.

    Args:
        model: llama-style HF causal LM (eval mode; not modified).
        calib_ids: ``int64 [nsamples, seqlen]``.
        batch: windows per forward pass.

    Returns:
        ``float64 [2L]``: ``1 - mean cos(input, output)`` of sub-block ``j`` (``2i``
        attention, ``2i + 1`` MLP of layer ``i``); larger = more influential.
    """
    layers = decoder_layers(model)
    sums = np.zeros(2 * len(layers))
    count = 0
    state: dict = {}
    hooks = []

    def cos_sum(a, b) -> float:
        return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).sum())

    for i, lay in enumerate(layers):
        def pre(module, args, i=i):
            state["x"] = args[0]

        def attn_out(module, args, out, i=i):
            x = state["x"]
            y = x + (out[0] if isinstance(out, tuple) else out)
            sums[2 * i] += cos_sum(x, y)
            state["y"] = y

        def mlp_out(module, args, out, i=i):
            y = state["y"]
            sums[2 * i + 1] += cos_sum(y, y + out)

        hooks += [lay.register_forward_pre_hook(pre), lay.self_attn.register_forward_hook(attn_out),
                  lay.mlp.register_forward_hook(mlp_out)]
    try:
        for s in range(0, len(calib_ids), batch):
            ids = calib_ids[s:s + batch]
            model(ids)
            count += ids.numel()
    finally:
        for h in hooks:
            h.remove()
    return 1.0 - sums / max(count, 1)


def angular_mask(influence: np.ndarray, n_skip: int) -> list:
    """The static ShortGPT mask: skip the ``n_skip`` sub-blocks of lowest Block Influence
    (ties: the later sub-block first)."""
    order = sorted(range(len(influence)), key=lambda j: (float(influence[j]), -j))
    skip = set(order[:n_skip])
    return [0 if j in skip else 1 for j in range(len(influence))]


__all__ = ["block_influence", "angular_mask"]
