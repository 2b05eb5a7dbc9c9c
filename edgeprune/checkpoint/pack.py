"""compressed-tensors' bit packing: unsigned codes densely in int32 words, and pruning
masks as packed bits."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import torch

from ..errors import CheckpointError


def pack_int32(values: torch.Tensor, bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Pack unsigned integers densely into int32 words (compressed-tensors' layout).

    Args:
        values: integer tensor ``[rows, cols]`` with values in ``[0, 2**bits-1]``.
        bits: 1..8.
        packed_dim: 1 packs along columns (weights), 0 along rows (zero points).

    Returns:
        ``int32 [rows, ceil(cols*bits/32)]`` (``packed_dim=1``) or
        ``[ceil(rows*bits/32), cols]`` (``packed_dim=0``). Element ``i`` of a line occupies
        bits ``[i*bits, (i+1)*bits)`` of the line's little-endian bit stream.
    """
    if not 1 <= bits <= 8:
        raise CheckpointError(f"cannot pack {bits}-bit values", "bits must be in 1..8")
    v = values.detach().cpu().to(torch.int64).numpy()
    if packed_dim == 0:
        v = v.T
    if v.size and (v.min() < 0 or v.max() >= 2 ** bits):
        raise CheckpointError(f"values outside [0, {2 ** bits - 1}] cannot be packed in {bits} bits",
                              "quantize first; codes must be unsigned")
    rows, cols = v.shape
    n_words = math.ceil(cols * bits / 32)
    per_word = 32 // bits
    if 32 % bits == 0 and cols % per_word == 0:   # 1/2/4/8 bits, whole words: shift and add
        shifts = np.arange(per_word, dtype=np.int64) * bits
        words = (v.reshape(rows, n_words, per_word) << shifts).sum(axis=2)
        out = torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())
        return out.T.contiguous() if packed_dim == 0 else out
    # bits of every element, least significant first: [rows, cols, bits]
    bitarr = ((v[:, :, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(rows, cols * bits)
    pad = n_words * 32 - cols * bits
    if pad:
        bitarr = np.pad(bitarr, ((0, 0), (0, pad)))
    packed = np.packbits(bitarr, axis=1, bitorder="little")  # [rows, n_words*4] bytes
    words = np.ascontiguousarray(packed).view("<u4").astype(np.uint32).view(np.int32)
    out = torch.from_numpy(words.copy())
    return out.T.contiguous() if packed_dim == 0 else out


def unpack_int32(packed: torch.Tensor, bits: int, shape: Iterable[int], packed_dim: int = 1
                 ) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: ``uint8 [rows, cols]`` of ``shape`` (rows, cols)."""
    rows, cols = (int(s) for s in shape)
    p = packed.detach().cpu().to(torch.int32).numpy()
    if packed_dim == 0:
        p = p.T
        rows, cols = cols, rows
    n_words = math.ceil(cols * bits / 32)
    if p.shape != (rows, n_words):
        raise CheckpointError(
            f"packed tensor has shape {tuple(p.shape)}, expected {(rows, n_words)} for "
            f"{cols} {bits}-bit values per line", "the checkpoint is corrupt or its config "
            "does not match its tensors")
    by = np.ascontiguousarray(p.astype("<i4")).view(np.uint8)  # [rows, n_words*4]
    bitarr = np.unpackbits(by, axis=1, bitorder="little")[:, :cols * bits].reshape(rows, cols, bits)
    vals = (bitarr.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(axis=2).astype(np.uint8)
    out = torch.from_numpy(vals)
    return out.T.contiguous() if packed_dim == 0 else out


def pad_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """``packed`` (``[n, cols]``, ``n <= rows``) followed by zero rows up to ``[rows, cols]``:
    row-packed zero points in the unpacked shape plain transformers allocates for them
    (unpacking reads only the leading rows; :func:`unpad_rows` drops them).

    Raises:
        CheckpointError: ``packed`` has more than ``rows`` rows.
    """
    if packed.shape[0] > rows:
        raise CheckpointError(f"cannot pad {packed.shape[0]} packed rows to {rows}", "pass rows >= the packed rows")
    out = torch.zeros((rows, packed.shape[1]), dtype=packed.dtype)
    out[:packed.shape[0]] = packed
    return out


def unpad_rows(packed: torch.Tensor, rows: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pad_rows` for zero points of ``rows`` outputs packed in ``bits``:
    the leading ``ceil(rows*bits/32)`` rows of a ``[rows, cols]`` tensor; any other shape
    is returned as it is (unpadded, or for :func:`unpack_int32` to refuse).

    Raises:
        ValueError: the padding rows are not all zero (a damaged tensor).
    """
    n_words = math.ceil(rows * bits / 32)
    if packed.dim() != 2 or packed.shape[0] != rows or rows == n_words:
        return packed
    if bool(packed[n_words:].any()):
        raise ValueError(f"the zero-point padding rows {n_words}..{rows - 1} are not zero")
    return packed[:n_words]


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """``bool [out, in]`` mask -> ``uint8 [ceil(out*in/8)]``, little-endian bit order."""
    return torch.from_numpy(np.packbits(mask.cpu().numpy().astype(bool).reshape(-1), bitorder="little"))


def unpack_mask(packed: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: ``bool`` tensor of ``shape``."""
    n = int(np.prod(shape))
    bits = np.unpackbits(packed.numpy(), bitorder="little")[:n]
    return torch.from_numpy(bits.astype(bool).reshape(tuple(shape)))


__all__ = ["pack_int32", "unpack_int32", "pad_rows", "unpad_rows", "pack_mask", "unpack_mask"]
