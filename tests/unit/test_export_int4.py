"""One RTN grid and one 4-bit packer: numpy's ``exporters.int4.rtn_int`` (the export's RTN)
equals torch's ``edgeprune.quantize.rtn_quantize`` bit for bit, and every 4-bit layout the
exporter writes goes through ``pack_uint4``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeprune import quantize as q
from edgeprune_exporters import int4


def _weights(rows: int, cols: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    w[1] = np.abs(w[1])          # all positive: xmin clamps to 0
    w[2] = -np.abs(w[2])         # all negative: xmax clamps to 0
    w[3] = 0.0                   # an all-zero row: scale 1, zero point by convention
    w[4, ::3] *= 40.0            # outliers
    return w


def _torch_grid(w: np.ndarray, bits: int, group_size: int, sym: bool):
    """``(codes, scales, zeros)`` of torch's RTN: ``rtn_quantize`` for the bit widths it
    accepts, else the same per-group ``qparams`` / ``quantize_codes`` it is made of."""
    t = torch.from_numpy(w)
    if bits in q.SUPPORTED_BITS:
        r = q.rtn_quantize(t, bits, group_size, sym, pad_groups=True)
        return r.codes.numpy(), r.scales.numpy(), r.zeros.numpy()
    gs = w.shape[1] if group_size == -1 else group_size
    codes, scales, zeros = [], [], []
    for g in range(0, w.shape[1], gs):
        s, z = q.qparams(t[:, g:g + gs], bits, sym)
        codes.append(q.quantize_codes(t[:, g:g + gs], s, z, bits).to(torch.uint8).numpy())
        scales.append(s.numpy())
        zeros.append(z.to(torch.uint8).numpy())
    return np.concatenate(codes, 1), np.concatenate(scales, 1), np.concatenate(zeros, 1)


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("cols", [256, 80])          # 80: a partial last group
def test_numpy_and_torch_rtn_agree_bit_for_bit(sym, bits, group_size, cols):
    w = _weights(6, cols, seed=bits * 7 + cols)
    codes, scales, zeros = _torch_grid(w, bits, group_size, sym)
    iw = int4.rtn_int(w, bits, group_size, sym)
    np.testing.assert_array_equal(iw.codes, codes)
    assert iw.scales.dtype == scales.dtype == np.float32
    np.testing.assert_array_equal(iw.scales.view(np.uint32), scales.view(np.uint32))
    np.testing.assert_array_equal(iw.zeros, zeros)
    assert iw.block_size == (cols if group_size == -1 else group_size)


def test_one_default_group_size():
    """The export's RTN, the build options, export_onnx, the torch quantizer: 64."""
    import inspect

    import edgeprune_exporters as exporters
    from edgeprune_exporters.decoder import BuildOptions

    assert int4.DEFAULT_GROUP_SIZE == q.DEFAULT_GROUP_SIZE == 64
    assert BuildOptions().group_size == 64
    for fn in (int4.rtn_int, q.rtn_quantize, exporters.export_onnx, exporters.check_export_args):
        assert inspect.signature(fn).parameters["group_size"].default == 64, fn


@pytest.mark.parametrize("shape", [(7,), (3, 8), (3, 9), (2, 5, 4)])
def test_pack_uint4_low_nibble_first_padded(shape):
    a = np.random.default_rng(0).integers(0, 16, size=shape, dtype=np.uint8)
    p = int4.pack_uint4(a)
    n = shape[-1]
    assert p.shape == shape[:-1] + ((n + 1) // 2,) and p.dtype == np.uint8
    lo, hi = p & 15, p >> 4
    back = np.stack([lo, hi], -1).reshape(shape[:-1] + (-1,))
    np.testing.assert_array_equal(back[..., :n], a)
    if n % 2:
        assert not hi[..., -1].any()            # the padding code is 0


def test_matmulnbits_packing_uses_the_packer():
    """``pack_matmulnbits``'s codes and zero points are ``pack_uint4`` of the padded blocks."""
    w = int4.rtn_int(_weights(5, 80, seed=3), 4, 32)
    B, sc, zp = int4.pack_matmulnbits(w)
    full = np.repeat(w.zeros, 32, axis=1)[:, :96].copy()
    full[:, :80] = w.codes
    np.testing.assert_array_equal(B, int4.pack_uint4(full.reshape(5, 3, 32)))
    np.testing.assert_array_equal(zp, int4.pack_uint4(w.zeros).reshape(-1))
    np.testing.assert_array_equal(sc, w.scales.reshape(-1))


@pytest.mark.parametrize("sym", [False, True])
def test_scales_are_float16_values(sym):
    """Every quantizer's grid rounds its scales to float16 before the codes: the scales
    survive a float16 round trip unchanged, and the codes are those of the rounded scale."""
    w = torch.from_numpy(_weights(6, 128, seed=11))
    r = q.rtn_quantize(w, 4, 64, sym)
    s = r.scales
    assert torch.equal(s.half().float(), s)
    assert int4.fp16_exact(int4.rtn_int(w.numpy(), 4, 64, sym).scales)
    # the codes follow the rounded scale: recomputing with it changes nothing
    z = r.zeros.float()
    for g in range(2):
        wg = w[:, g * 64:(g + 1) * 64]
        want = q.quantize_codes(wg, s[:, g:g + 1], z[:, g:g + 1], 4).to(torch.uint8)
        assert torch.equal(r.codes[:, g * 64:(g + 1) * 64], want)


def test_round_scale_keeps_what_float16_cannot_hold():
    """Overflow (> 65504) and values that round to 0 keep their float32 value (the export
    then stores that layer's scales in 32 bits); others round half to even."""
    s = torch.tensor([1e5, 1e-9, 0.1, 3.0, 1.0 + 2 ** -12])
    out = q.round_scale(s)
    assert out[0] == 1e5 and out[1] == torch.tensor(1e-9)
    assert out[2] == torch.tensor(0.1).half().float() and out[3] == 3.0
    assert out[4] == 1.0                                   # a tie: to even
    np.testing.assert_array_equal(int4.round_scale(s.numpy()), out.numpy())
    assert not int4.fp16_exact(np.array([0.1], np.float32)) and int4.fp16_exact(np.array([0.5], np.float32))
