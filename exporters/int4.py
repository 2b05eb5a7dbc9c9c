"""Packing a quantizer's integer codes into ONNX Runtime's ``MatMulNBits`` layout.

``MatMulNBits`` (com.microsoft) computes ``Y = A @ dequant(B)^T`` for ``B`` stored as
``uint8 [N, n_blocks, blob]`` (``blob = block_size * bits / 8``; two 4-bit codes per byte,
low nibble first), ``scales float [N * n_blocks]`` and packed zero points
``uint8 [N * ceil(n_blocks * bits / 8)]``; dequantization is
``w = (code - zero) * scale`` with one (scale, zero) per block of ``block_size`` input
channels: exactly the group-wise grid of GPTQ (Frantar et al. 2023) / AWQ
(Lin et al. 2024) with ``block_size = group_size``. ``K`` not a multiple of
``block_size`` is padded with code ``zero`` (dequantizes to 0).

The codes are packed as they are: never re-rounded. A ``QuantizedWeight``-like object
(``codes, scales, zeros, bits, group_size, sym, g_idx``) is duck-typed so this package
does not import ``edgeprune``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from edgeprune_runtime.errors import ExportError

MATMULNBITS_BLOCKS = (256, 128, 64, 32, 16)
#: RTN group size for weights quantized at export (the same 64 as
#: ``edgeprune.quantize.DEFAULT_GROUP_SIZE`` and the CLI's ``--group-size``)
DEFAULT_GROUP_SIZE = 64


def _np(t) -> Optional[np.ndarray]:
    if t is None:
        return None
    if hasattr(t, "detach"):
        t = t.detach().cpu()
        if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
            t = t.float()
        return t.numpy()
    return np.asarray(t)


@dataclass
class IntWeight:
    """Integer weight ready for packing, columns in *block order*.

    Attributes:
        codes: ``uint8 [N, K]`` (``N`` out features, ``K`` in features).
        scales: ``float32 [N, n_blocks]``.
        zeros: ``uint8 [N, n_blocks]``.
        bits: 4 or 8 (2/3 are stored as 4-bit codes, exact).
        block_size: columns per block (a power of two ``>= 16``).
        perm: ``int64 [K]`` or ``None``: the graph feeds ``A[..., perm]`` (act_order).
        sym: the source grid was symmetric (metadata only).
    """

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    bits: int
    block_size: int
    perm: Optional[np.ndarray] = None
    sym: bool = False

    @property
    def N(self) -> int:  # noqa: N802
        return self.codes.shape[0]

    @property
    def K(self) -> int:  # noqa: N802
        return self.codes.shape[1]

    @property
    def n_blocks(self) -> int:
        return math.ceil(self.K / self.block_size)

    def dequantize(self, original_order: bool = False) -> np.ndarray:
        """``float32 [N, K]``: ``(code - zero) * scale``, in block order, or in the
        layer's original column order (``perm`` undone) when ``original_order``."""
        g = np.arange(self.K) // self.block_size
        w = (self.codes.astype(np.float32) - self.zeros[:, g]) * self.scales[:, g]
        if original_order and self.perm is not None:
            out = np.empty_like(w)
            out[:, self.perm] = w
            return out
        return w


def from_quantized(qw, name: str = "layer") -> IntWeight:
    """Convert a ``QuantizedWeight``-like object into an :class:`IntWeight`.

    Handles ``act_order``: a non-default ``g_idx`` is turned into an input permutation
    ``perm = argsort(g_idx, stable)`` so that every group becomes a contiguous block; the
    graph then gathers ``A[..., perm]`` before the matmul. A group size that is not a
    supported ``MatMulNBits`` block size but is a multiple of one (e.g. per-row groups
    of 576 = 18 x 32) is represented exactly by repeating its scale and zero point.

    Raises:
        ExportError: bits not in 2..8, codes out of range, or groups that cannot be
            made contiguous blocks of equal size.
    """
    codes = _np(qw.codes).astype(np.uint8)
    scales = _np(qw.scales).astype(np.float32)
    zeros = _np(qw.zeros).astype(np.uint8)
    bits = int(qw.bits)
    gs = int(qw.group_size)
    N, K = codes.shape
    if gs == -1:
        gs = K
    if bits > 8 or bits < 2:
        raise ExportError(f"{name}: {bits}-bit weights cannot be exported",
                          "quantize with bits 2, 3, 4 or 8")
    if int(codes.max(initial=0)) >= 2 ** bits:
        raise ExportError(f"{name}: codes exceed the {bits}-bit range",
                          "check the checkpoint's bits field")
    store_bits = 4 if bits <= 4 else 8
    g_idx = _np(getattr(qw, "g_idx", None))
    perm = None
    if g_idx is not None and not np.array_equal(g_idx.astype(np.int64), np.arange(K) // gs):
        g_idx = g_idx.astype(np.int64)
        perm = np.argsort(g_idx, kind="stable").astype(np.int64)
        counts = np.bincount(g_idx, minlength=scales.shape[1])
        if (counts[:-1] != gs).any() or counts[-1] > gs:
            raise ExportError(f"{name}: act_order groups are not all of size {gs}",
                              "re-quantize with static groups or equal-size groups")
        codes = np.ascontiguousarray(codes[:, perm])
    block = next((b for b in MATMULNBITS_BLOCKS if gs % b == 0), None)
    if block is None:
        raise ExportError(f"{name}: group_size {gs} is not a multiple of 16",
                          "use group_size 32, 64 or 128")
    rep = gs // block
    n_blocks = math.ceil(K / block)
    if rep > 1:
        scales = np.repeat(scales, rep, axis=1)[:, :n_blocks]
        zeros = np.repeat(zeros, rep, axis=1)[:, :n_blocks]
    if scales.shape[1] != n_blocks:
        raise ExportError(f"{name}: scales have {scales.shape[1]} groups, expected {n_blocks}",
                          "the checkpoint's scales do not match its group_size")
    return IntWeight(codes=codes, scales=np.ascontiguousarray(scales),
                     zeros=np.ascontiguousarray(zeros), bits=store_bits, block_size=block,
                     perm=perm, sym=bool(getattr(qw, "sym", False)))


def q8_head_block(K: int) -> int:
    """Block size of the exporter's 8-bit ``lm_head`` over ``K`` input features: the
    largest of 128 / 64 dividing ``K`` (fewer scale bytes read per token), else 32."""
    return next((b for b in (128, 64) if K % b == 0), 32)


def round_scale(scale: np.ndarray) -> np.ndarray:
    """``float32 scale`` rounded to the nearest float16 (half to even), where float16 holds
    it (finite, above 0): ``edgeprune.quantize.round_scale``, bit for bit."""
    scale = np.asarray(scale, np.float32)
    with np.errstate(over="ignore"):
        h = scale.astype(np.float16).astype(np.float32)
    return np.where(np.isfinite(h) & (h > 0), h, scale)


def fp16_exact(a: np.ndarray) -> bool:
    """True when every entry of ``a`` (float32) is a float16 value: storing it in 16 bits
    loses nothing."""
    a = np.asarray(a, np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def rtn_int(w: np.ndarray, bits: int = 4, group_size: int = DEFAULT_GROUP_SIZE,
            sym: bool = False) -> IntWeight:
    """Round-to-nearest group-wise quantization of ``w float [N, K]`` (numpy).

    The grid of ``edgeprune.quantize.rtn_quantize`` (GPTQ reference conventions), bit for
    bit (codes, scales and zero points; ``tests/unit/test_export_int4.py`` checks it):
    asym ``scale = (max(w,0) - min(w,0)) / maxq``, ``zero = round(-min/scale)``;
    sym ``scale = 2 max|w| / maxq``, ``zero = 2**(bits-1)``. ``group_size=-1``: one group
    per row. A partial last group is allowed (padded like ``MatMulNBits``). Used for
    heads/embeddings and for exports given a dense model with ``precision="int4"`` and no
    ``quantized`` dict.
    """
    w = np.asarray(w, dtype=np.float32)
    N, K = w.shape
    if group_size == -1:
        group_size = K
    maxq = 2 ** bits - 1
    nb = math.ceil(K / group_size)
    pad = np.zeros((N, nb * group_size), np.float32)
    pad[:, :K] = w
    g = pad.reshape(N, nb, group_size)
    if K % group_size:  # the padded tail must not widen the range: reuse a real value
        g[:, -1, K % group_size:] = g[:, -1, :1]
    if sym:
        scale = round_scale(2 * np.abs(g).max(-1) / maxq)
        zero = np.full_like(scale, 2 ** (bits - 1))
    else:
        xmin = np.minimum(g.min(-1), 0)
        xmax = np.maximum(g.max(-1), 0)
        scale = round_scale((xmax - xmin) / maxq)
        zero = np.round(-xmin / np.where(scale > 0, scale, 1))
    bad = ~(scale > 0)
    scale = np.where(bad, 1.0, scale).astype(np.float32)
    zero = np.clip(np.where(bad, 2 ** (bits - 1) if sym else 0, zero), 0, maxq)
    codes = np.clip(np.round(g / scale[..., None]) + zero[..., None], 0, maxq)
    codes = codes.reshape(N, -1)[:, :K].astype(np.uint8)
    return IntWeight(codes=codes, scales=scale, zeros=zero.astype(np.uint8),
                     bits=4 if bits <= 4 else 8, block_size=group_size, sym=sym)


def pack_uint4(a: np.ndarray) -> np.ndarray:
    """Two 4-bit codes per byte along the last axis, low nibble first (the layout of
    ``MatMulNBits``, ``GatherBlockQuantized`` and ONNX ``UINT4`` tensors): ``uint8 [..., n]``
    (values < 16) -> ``uint8 [..., ceil(n / 2)]``, an odd last axis padded with code 0.
    Pass ``a.reshape(-1)`` for a tensor packed as one flat stream (ONNX ``UINT4``)."""
    a = np.asarray(a).astype(np.uint8)
    if a.shape[-1] % 2:
        a = np.concatenate([a, np.zeros(a.shape[:-1] + (1,), np.uint8)], -1)
    return np.ascontiguousarray(a[..., 0::2] | (a[..., 1::2] << 4))


def pack_matmulnbits(w: IntWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(B uint8 [N, n_blocks, blob], scales float32 [N*n_blocks], zp uint8 [...])``.

    Padding columns (``K`` up to ``n_blocks * block_size``) get code = zero point, so
    they dequantize to exactly 0.
    """
    N, K, bs, nb = w.N, w.K, w.block_size, w.n_blocks
    full = np.repeat(w.zeros, bs, axis=1)[:, :nb * bs].copy()
    full[:, :K] = w.codes
    if w.bits == 4:
        B = pack_uint4(full.reshape(N, nb, bs))
        zp = pack_uint4(w.zeros).reshape(-1)
    else:
        B = full.reshape(N, nb, bs)
        zp = w.zeros.reshape(-1)
    return np.ascontiguousarray(B), w.scales.reshape(-1).astype(np.float32), np.ascontiguousarray(zp)


def default_zero_points(w: IntWeight) -> bool:
    """True when every zero point is ``2**(bits-1)`` (a symmetric grid), the value
    ``MatMulNBits`` assumes when its ``zero_points`` input is absent: the exporter then
    leaves that input out - the same dequantization, fewer bytes, and ONNX Runtime's
    symmetric kernels (on AVX2, hot ``576 x 3072`` int4 matmul 66 vs 77 us; the
    ``576 x 49152`` int8 head 2.45 vs 2.59 ms)."""
    return bool(w.zeros.size) and bool((w.zeros == 2 ** (w.bits - 1)).all())


def concat_n(parts: list[IntWeight]) -> IntWeight:
    """Stack weights with the same K/bits/block/perm along N (fused QKV, gate/up)."""
    p0 = parts[0]
    return IntWeight(codes=np.concatenate([p.codes for p in parts]),
                     scales=np.concatenate([p.scales for p in parts]),
                     zeros=np.concatenate([p.zeros for p in parts]),
                     bits=p0.bits, block_size=p0.block_size, perm=p0.perm, sym=p0.sym)


def can_fuse(parts: list[IntWeight]) -> bool:
    """Whether :func:`concat_n` is exact for these parts."""
    p0 = parts[0]
    for p in parts[1:]:
        if (p.K, p.bits, p.block_size) != (p0.K, p0.bits, p0.block_size):
            return False
        if (p.perm is None) != (p0.perm is None):
            return False
        if p.perm is not None and not np.array_equal(p.perm, p0.perm):
            return False
    return True


__all__ = ["IntWeight", "from_quantized", "rtn_int", "round_scale", "fp16_exact", "pack_uint4", "pack_matmulnbits", "concat_n",
           "can_fuse", "default_zero_points", "DEFAULT_GROUP_SIZE"]
