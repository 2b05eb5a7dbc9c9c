"""Sub-block gates in PyTorch: bypass (or scale) attention / MLP sub-blocks of a decoder.

A decoder layer computes ``r = r + attn(norm(r))`` then ``r = r + mlp(norm(r))``. Gating
sub-block ``j`` by ``z_j`` multiplies its output: ``r = r + z_j f_j(norm(r))``. ``z_j = 0``
bypasses it exactly (``r + 0 == r``), ``z_j = 1`` is the dense model bit for bit
(``x * 1 == x``); a Hard-Concrete sample ``z_j in [0, 1]`` (:mod:`.train`) is the relaxed
gate of IG-Pruning's mask search (Qiao, Zhang, Feng; EMNLP 2025).

Sub-block ``2i`` is layer ``i``'s attention (``self_attn``), ``2i + 1`` its MLP (``mlp``).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..errors import UnsupportedArchitectureError


def decoder_layers(model) -> list:
    """The decoder layers of a HF causal LM (``model.model.layers``).

    Raises:
        UnsupportedArchitectureError: a model without ``model.layers`` whose layers hold
            ``self_attn`` and ``mlp``.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(lay, "self_attn") and hasattr(lay, "mlp") for lay in layers):
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} has no decoder layers with self_attn and mlp",
            "IG-Pruning needs a llama-style causal LM (model.model.layers[i].self_attn / .mlp)")
    return list(layers)


def sub_blocks(model) -> list:
    """The ``2L`` gated modules in sub-block order: ``[attn_0, mlp_0, attn_1, mlp_1, ...]``."""
    return [m for lay in decoder_layers(model) for m in (lay.self_attn, lay.mlp)]


def _scaled(out, z: torch.Tensor):
    """A sub-block's output (a tensor, or a tuple whose first item is it) times ``z``
    (a scalar, or ``[B]`` one gate per batch row)."""
    x = out[0] if isinstance(out, tuple) else out
    if z.dim() == 1:
        z = z.view(-1, *([1] * (x.dim() - 1)))
    y = x * z.to(x.dtype)
    return (y, *out[1:]) if isinstance(out, tuple) else y


@contextlib.contextmanager
def gated(model, gates: Callable[[int], torch.Tensor | None]):
    """Context manager: inside it, sub-block ``j``'s output is multiplied by ``gates(j)``
    (read at every forward: a scalar, or ``[B]`` per batch row; ``None`` leaves it as is).

    Args:
        model: llama-style HF causal LM.
        gates: ``j -> tensor or None`` for ``j`` in ``range(2L)``.
    """
    hooks = []
    try:
        for j, mod in enumerate(sub_blocks(model)):
            def hook(module, args, out, j=j):
                z = gates(j)
                return out if z is None else _scaled(out, z)
            hooks.append(mod.register_forward_hook(hook))
        yield model
    finally:
        for h in hooks:
            h.remove()


def masked(model, masks: torch.Tensor):
    """:func:`gated` by a 0/1 mask: ``masks`` int/bool ``[2L]`` (every row) or ``[B, 2L]``
    (one mask per batch row). Kept sub-blocks get no hook (the dense computation as is)."""
    m = torch.as_tensor(masks)
    if m.dim() == 1:
        return gated(model, lambda j: None if bool(m[j]) else torch.zeros(()))
    m = m.float()
    return gated(model, lambda j: None if bool(m[:, j].all()) else m[:, j])


__all__ = ["decoder_layers", "sub_blocks", "gated", "masked"]
