"""Integer grids shared by every quantization method (RTN, GPTQ, AWQ, SparseGPT+quant).

Conventions (the GPTQ reference code's, which ``compressed-tensors`` and ONNX Runtime's
``MatMulNBits`` also use):

* ``maxq = 2**bits - 1``; codes are unsigned integers in ``[0, maxq]``.
* asymmetric (``sym=False``): over a group, ``xmin = min(w.min(), 0)``,
  ``xmax = max(w.max(), 0)``, ``scale = (xmax - xmin) / maxq``,
  ``zero = round(-xmin / scale)`` (an integer in ``[0, maxq]``).
* symmetric (``sym=True``): ``xmax = max|w|``, ``scale = 2 * xmax / maxq``,
  ``zero = 2**(bits-1)`` (8 for int4; MatMulNBits' default zero point).
* ``scale`` is rounded to the nearest float16 (:func:`round_scale`), the dtype GGUF,
  ``compressed-tensors`` and fp16 ``MatMulNBits`` store scales in, *before* the codes and
  the zero point are computed: an export that stores 16-bit scales then computes exactly
  what the quantizer measured, at 16 scale bits per group (llama.cpp's accounting).
* ``codes = clamp(round(w / scale) + zero, 0, maxq)``;
  ``w_hat = (codes - zero) * scale``.

A quantized linear weight is a :class:`QuantizedWeight`: the *quantizer's own* codes,
scales and zero points. Exporters pack these integers as they are (never re-rounded),
and checkpoints store them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from .errors import ConfigError

SUPPORTED_BITS = (2, 3, 4, 8)
#: group size of every quantizer's default (and of exports that quantize with RTN:
#: ``exporters.int4.DEFAULT_GROUP_SIZE`` is the same 64)
DEFAULT_GROUP_SIZE = 64


def check_quant_args(bits: int, group_size: int, in_features: Optional[int] = None,
                     *, pad_groups: bool = False, name: str = "layer") -> int:
    """Validate ``bits``/``group_size`` for a layer and return the effective group size.

    Args:
        bits: 2, 3, 4 or 8.
        group_size: ``-1`` (one group per output row) or a positive integer.
        in_features: the layer's input size; when given, ``group_size`` must divide it
            unless ``pad_groups`` is set (then the last group is partial, the way
            ``MatMulNBits`` pads K to a multiple of ``block_size``).
        pad_groups: allow a partial last group.
        name: layer name used in the error message.

    Returns:
        The effective group size (``in_features`` when ``group_size == -1``).

    Raises:
        ConfigError: unsupported ``bits``, a non-positive ``group_size``, or a
            ``group_size`` that does not divide ``in_features``.
    """
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"bits={bits} is not supported",
                          f"use one of {', '.join(map(str, SUPPORTED_BITS))}")
    if group_size != -1 and group_size <= 0:
        raise ConfigError(f"group_size={group_size} must be -1 (per row) or a positive integer",
                          "use e.g. --group-size 64")
    if in_features is None:
        return group_size
    if group_size == -1:
        return in_features
    if in_features % group_size and not pad_groups:
        divisors = [g for g in (32, 64, 128, 256) if in_features % g == 0]
        raise ConfigError(
            f"group_size={group_size} does not divide the input size {in_features} of {name}",
            f"use group_size {' or '.join(map(str, divisors + [-1]))} (-1 = one group per row)")
    return group_size


def round_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` rounded to the nearest float16 value (round half to even), kept as its
    dtype; an entry that float16 cannot hold (overflow, or a positive value that rounds
    to 0) stays as it is, so an export stores that layer's scales in 32 bits instead.

    Args:
        scale: float tensor of any shape (nonzero scales; a negative scale, as in the
            full-range symmetric grid, rounds like its magnitude).

    Returns:
        A tensor of ``scale``'s shape and dtype. Differentiable (the cast's gradient).
    """
    h = scale.to(torch.float16).to(scale.dtype)
    return torch.where(torch.isfinite(h) & (h != 0), h, scale)


def qparams(w: torch.Tensor, bits: int, sym: bool, clip: float | torch.Tensor = 1.0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero point of each row of ``w`` (one group per row).

    Args:
        w: float tensor ``[rows, cols]``; each row is one quantization group.
        bits: bit width.
        sym: symmetric grid (zero fixed at ``2**(bits-1)``) or asymmetric.
        clip: factor in ``(0, 1]`` (scalar or ``[rows, 1]``) that shrinks the range,
            as in AWQ's clipping search.

    Returns:
        ``(scale [rows, 1] float32, zero [rows, 1] float32 holding integers)``; the scale
        float16-representable (:func:`round_scale`). A row of zeros gets scale 1 so
        nothing divides by zero.
    """
    maxq = 2 ** bits - 1
    w = w.float()
    if sym:
        scale = round_scale(w.abs().amax(dim=1, keepdim=True).mul_(clip).mul_(2).div_(maxq))
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
    else:
        xmin, xmax = torch.aminmax(w, dim=1, keepdim=True)  # one pass over the weights
        xmin = xmin.clamp_(max=0).mul_(clip)
        scale = round_scale(xmax.clamp_(min=0).mul_(clip).sub_(xmin).div_(maxq))
        zero = torch.round(-xmin / torch.where(scale > 0, scale, torch.ones_like(scale)))
    bad = ~(scale > 0) | ~torch.isfinite(scale)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    zero = torch.where(bad, torch.full_like(zero, float(2 ** (bits - 1)) if sym else 0.0), zero)
    return scale, zero.clamp(0, maxq)


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes ``clamp(round(w/scale) + zero, 0, 2**bits-1)`` (float tensor of integers)."""
    return torch.round(w / scale).add_(zero).clamp_(0, 2 ** bits - 1)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Round ``w`` to the grid and back: ``(codes - zero) * scale`` (same shape as ``w``)."""
    return quantize_codes(w, scale, zero, bits).sub_(zero).mul_(scale)



def fake_quant_groups(W: torch.Tensor, bits: int, gs: int, sym: bool,
                       clip: float | torch.Tensor = 1.0) -> torch.Tensor:
    """RTN fake-quantization of ``W [out, in]`` in groups of ``gs`` columns (the AWQ
    searches' inner loop): :func:`qparams` grid, one group per row."""
    out, inp = W.shape
    Wg = W.reshape(out * (inp // gs), gs)
    c = clip.reshape(-1, 1) if isinstance(clip, torch.Tensor) else clip
    return fake_quantize(Wg, *qparams(Wg, bits, sym, c), bits).reshape(out, inp)


def search_clip(W: torch.Tensor, H: torch.Tensor, *, bits: int, group_size: int, sym: bool,
                n_grid: int = 20, max_shrink: float = 0.5) -> torch.Tensor:
    """Per (row, group) clip ratio ``[out, n_groups]`` minimizing ``dw H_gg dw^T`` (AWQ's
    auto-clip, Lin et al. 2024): ratios ``1, 1 - 1/n_grid, ...`` down to ``1 - max_shrink``,
    ``W [out, in]``, ``H [in, in]`` the layer's calibration Hessian, ``dw`` the group's
    rounding error at that ratio. Used by AWQ and by GPTQ's ``clip_search``."""
    out, inp = W.shape
    gs = inp if group_size == -1 else group_size
    G = inp // gs
    W = W.float()
    Hb = torch.stack([H[g * gs:(g + 1) * gs, g * gs:(g + 1) * gs] for g in range(G)])  # [G, gs, gs]
    best = torch.ones(out, G, device=W.device)
    best_err = torch.full((out, G), float("inf"), device=W.device)
    for i in range(max(1, int(max_shrink * n_grid))):
        c = 1.0 - i / n_grid
        d = (W - fake_quant_groups(W, bits, gs, sym, c)).reshape(out, G, gs)
        err = torch.einsum("rgi,gij,rgj->rg", d, Hb, d)
        better = err < best_err
        best = torch.where(better, torch.full_like(best, c), best)
        best_err = torch.where(better, err, best_err)
    return best


@dataclass
class QuantizedWeight:
    """The integer form of one linear layer's weight ``W [out_features, in_features]``.

    Attributes:
        codes: ``uint8 [out, in]``, values in ``[0, 2**bits-1]``, in the layer's
            original input-channel order (an ``act_order`` permutation is undone;
            see ``g_idx``).
        scales: ``float32 [out, n_groups]``.
        zeros: ``uint8 [out, n_groups]`` integer zero points (``2**(bits-1)`` when sym).
        bits: bit width (2, 3, 4, 8).
        group_size: input channels per group (``in_features`` for per-row).
        sym: symmetric grid.
        g_idx: optional ``int32 [in]``: the group of each input column. ``None`` means
            the default ``g_idx[i] = i // group_size``; GPTQ with ``act_order`` and
            dynamic groups produces a non-monotone ``g_idx``.
        meta: free-form provenance (method name, clip ratios...).

    ``n_groups = ceil(in / group_size)`` (a partial last group exists only when the
    caller allowed ``pad_groups``).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    sym: bool
    g_idx: Optional[torch.Tensor] = None
    meta: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    def group_index(self) -> torch.Tensor:
        """``int64 [in]``: the group of every input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.codes.shape[1]) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W_hat [out, in] = (codes - zeros[:, g]) * scales[:, g]``."""
        out, inp = self.codes.shape
        n = self.scales.shape[1]
        if self.g_idx is None and inp == n * self.group_size:    # whole groups, default order
            c = self.codes.float().reshape(out, n, self.group_size)
            w = (c - self.zeros.float()[:, :, None]) * self.scales.float()[:, :, None]
            return w.reshape(out, inp).to(dtype)
        g = self.group_index()
        return ((self.codes.float() - self.zeros.float()[:, g]) * self.scales.float()[:, g]).to(dtype)

    def has_default_order(self) -> bool:
        """True when ``g_idx`` is absent or equals ``i // group_size``."""
        if self.g_idx is None:
            return True
        return bool(torch.equal(self.g_idx.long(), torch.arange(self.codes.shape[1]) // self.group_size))

    def bits_per_weight(self) -> float:
        """Average storage bits per weight, scales (16-bit) and zero points included."""
        out, inp = self.shape
        extra = self.n_groups * out * (16 + (0 if self.sym else self.bits))
        return (out * inp * self.bits + extra) / (out * inp)


def refit_scales(qw: "QuantizedWeight", W: torch.Tensor, H: torch.Tensor, *, chunk: int = 1024
                 ) -> tuple["QuantizedWeight", dict]:
    """Each group's scale re-fitted by least squares with the integer codes held fixed.

    With codes ``q`` and zero points ``z`` fixed, ``W_hat[r] = A_r s_r`` is linear in the
    row's group scales ``s_r [G]`` (``A_r [in, G]`` holds ``q - z`` in its group's column),
    so the layer loss ``(W[r] - A_r s_r) H (W[r] - A_r s_r)^T`` of GPTQ's objective
    (Frantar et al. 2023, Eq. 1) has the closed-form minimizer
    ``s_r = (A_r^T H A_r)^-1 A_r^T H W[r]^T``: one ``G x G`` system per row. The codes
    a rounding method chose are kept, so an export's packed integers are unchanged and
    only the scales move (as the scale refinement of OmniQuant-style methods, here solved
    exactly instead of by gradient steps). A row keeps its old scales where the solution
    is not finite, not positive, or does not lower that row's loss; new scales are
    rounded to float16 (:func:`round_scale`).

    Args:
        qw: the quantized layer (any ``g_idx``; every group ``group_size`` columns).
        W: ``[out, in]`` the weight the codes approximate (the original, before any error
            feedback), pruned entries zero.
        H: ``[in, in]`` the layer input's Hessian ``X^T X / n``.
        chunk: rows solved at once (bounds memory: ``chunk * in * G`` floats).

    Returns:
        ``(QuantizedWeight with new scales, info)``; ``info``: ``loss_before``,
        ``loss_after`` (summed over rows, in ``H``'s units) and ``rows_kept``
        (rows whose old scales stayed).

    Raises:
        ConfigError: shapes that do not match, or a partial last group.
    """
    out, inp = qw.shape
    gs = qw.group_size
    G = qw.n_groups
    if tuple(W.shape) != (out, inp) or tuple(H.shape) != (inp, inp) or G * gs != inp:
        raise ConfigError(f"refit_scales: weight {tuple(W.shape)}, Hessian {tuple(H.shape)} and codes "
                          f"{(out, inp)} in groups of {gs} do not fit together",
                          "pass the layer's own weight and Hessian, with whole groups")
    dev = W.device
    g = qw.group_index().to(dev)
    order = torch.argsort(g, stable=True)             # groups contiguous
    Wp = W.detach().float()[:, order]
    Hp = H.detach().float().to(dev)[order][:, order]
    D = (qw.codes.float().to(dev) - qw.zeros.float().to(dev)[:, g])[:, order]   # q - z  [out, in]
    old = qw.scales.float().to(dev)
    new = old.clone()
    kept = 0
    for r0 in range(0, out, chunk):
        d = D[r0:r0 + chunk]
        n = d.shape[0]
        # E[r, i, h] = sum_{j in group h} H[i, j] d[r, j]
        E = torch.stack([d[:, h * gs:(h + 1) * gs] @ Hp[h * gs:(h + 1) * gs] for h in range(G)], -1)
        M = torch.einsum("rgi,rgih->rgh", d.reshape(n, G, gs), E.reshape(n, G, gs, G))
        b = (d * (Wp[r0:r0 + chunk] @ Hp)).reshape(n, G, gs).sum(-1)
        M, b = M.double(), b.double()
        ridge = 1e-9 * torch.diagonal(M, dim1=1, dim2=2).mean(-1).clamp_min(1e-30)
        s = round_scale(torch.linalg.solve(M + ridge[:, None, None] * torch.eye(G, device=dev, dtype=M.dtype),
                                           b[..., None])[..., 0].float())

        def loss(x):       # row loss up to the constant w H w^T
            x = x.double()
            return torch.einsum("rg,rgh,rh->r", x, M, x) - 2 * (b * x).sum(-1)

        s_old = old[r0:r0 + chunk]
        ok = torch.isfinite(s).all(-1) & (s > 0).all(-1) & (loss(s) < loss(s_old))
        new[r0:r0 + chunk] = torch.where(ok[:, None], s, s_old)
        kept += int((~ok).sum())

    def layer_loss(scales):
        dw = (Wp - D * torch.repeat_interleave(scales, gs, dim=1)).double()
        return float(torch.einsum("ri,ij,rj->", dw, Hp.double(), dw))

    before, after = layer_loss(old), layer_loss(new)
    out_qw = QuantizedWeight(codes=qw.codes, scales=new.to(qw.scales.dtype).cpu(), zeros=qw.zeros, bits=qw.bits,
                             group_size=gs, sym=qw.sym, g_idx=qw.g_idx, meta=dict(qw.meta, refit_scales=True))
    return out_qw, {"loss_before": before, "loss_after": after, "rows_kept": kept}


def rtn_quantize(w: torch.Tensor, bits: int = 4, group_size: int = DEFAULT_GROUP_SIZE, sym: bool = False,
                 clip: float | torch.Tensor = 1.0, *, pad_groups: bool = False,
                 name: str = "layer") -> QuantizedWeight:
    """Round-to-nearest group-wise quantization of ``w [out, in]``.

    Args:
        w: float weight ``[out, in]``.
        bits, group_size, sym: grid settings (see module docstring).
        clip: range shrink factor, scalar or ``[out, n_groups]`` (AWQ clipping).
        pad_groups: allow a partial last group when ``group_size`` does not divide ``in``.

    Returns:
        :class:`QuantizedWeight` with codes in the original column order. With
        ``clip=1`` the codes, scales and zero points equal numpy's
        ``exporters.int4.rtn_int`` bit for bit (the export's RTN; a unit test checks it).

    Raises:
        ConfigError: bad ``bits``/``group_size`` (see :func:`check_quant_args`).
    """
    out, inp = w.shape
    gs = check_quant_args(bits, group_size, inp, pad_groups=pad_groups, name=name)
    n_groups = math.ceil(inp / gs)
    wf = w.detach().float()
    if inp == n_groups * gs:       # whole groups: every group one row of a [out*n_groups, gs] view
        c = clip.reshape(-1, 1) if isinstance(clip, torch.Tensor) and clip.dim() == 2 else clip
        wg = wf.reshape(out * n_groups, gs)
        s, z = qparams(wg, bits, sym, c)
        return QuantizedWeight(codes=quantize_codes(wg, s, z, bits).to(torch.uint8).reshape(out, inp),
                               scales=s.reshape(out, n_groups), zeros=z.to(torch.uint8).reshape(out, n_groups),
                               bits=bits, group_size=gs, sym=sym)
    codes = torch.empty(out, inp, dtype=torch.uint8)
    scales = torch.empty(out, n_groups, dtype=torch.float32)
    zeros = torch.empty(out, n_groups, dtype=torch.uint8)
    for g in range(n_groups):
        sl = slice(g * gs, min((g + 1) * gs, inp))
        c = clip[:, g:g + 1] if isinstance(clip, torch.Tensor) and clip.dim() == 2 else clip
        s, z = qparams(wf[:, sl], bits, sym, c)
        codes[:, sl] = quantize_codes(wf[:, sl], s, z, bits).to(torch.uint8)
        scales[:, g] = s[:, 0]
        zeros[:, g] = z[:, 0].to(torch.uint8)
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros, bits=bits,
                           group_size=gs, sym=sym)


__all__ = ["QuantizedWeight", "check_quant_args", "qparams", "round_scale", "quantize_codes",
           "fake_quant_groups", "search_clip", "refit_scales", "fake_quantize", "rtn_quantize", "SUPPORTED_BITS", "DEFAULT_GROUP_SIZE"]
