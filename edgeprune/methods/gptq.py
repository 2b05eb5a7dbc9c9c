"""GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers
(Frantar, Ashkboos, Hoefler & Alistarh, ICLR 2023).

GPTQ quantizes a layer's weight ``W [out, in]`` one input column at a time and spreads
each column's rounding error over the not-yet-quantized columns with the inverse
Hessian of the layer-wise loss ``||W X - W_hat X||^2`` (``H = 2 X^T X``). Algorithm 1
of the paper, as implemented by :func:`gptq_quantize`:

1. ``H <- H + damp * I`` with ``damp = damp_percent * mean(diag(H))``; dead input
   channels (``H_jj = 0``) get ``H_jj = 1``.
2. ``U = Cholesky(H^-1)^T`` (upper): row ``j`` of ``U`` holds the OBS update
   coefficients for column ``j`` given that columns ``< j`` are already fixed.
3. For each block of ``blocksize`` columns ("lazy batch updates"), for each column ``j``:
   ``q_j = quant(w_j)``; ``e_j = (w_j - q_j) / U_jj``; ``W[:, j:] -= e_j U[j, j:]``
   inside the block; after the block, ``W[:, block_end:] -= E U[block, block_end:]``.
4. Group-wise grids: the scale/zero of a group of ``group_size`` columns are computed
   when the quantizer reaches the group's first column (from the error-updated
   weights), as in the reference code.

``clip_search`` (off by default) picks each group's grid by AWQ's clipping search instead
of its min/max: the range shrink ``c in {1, 1-1/n_grid, ..., 1-max_shrink}`` minimizing
``dw H_gg dw^T``, the group's share of the layer loss with ``H`` restricted to its columns
(Lin et al. 2024, AWQ's ``auto_clip``; the reference GPTQ code's ``--mse`` grid search
minimizes the unweighted error instead). It applies to static grids (from the original
weights), per-row grids, and dynamic grids (from the error-updated weights when the
quantizer reaches the group).

``refit_scales`` (off by default) adds rounds of scale refit after the sweep: with the codes
fixed, every group's scale is the least-squares minimizer of the layer loss
(:func:`~edgeprune.quantize.refit_scales`, one small ``G x G`` system per row); each round
after the first first re-runs the sweep on the refitted grids, so the codes follow the
scales. The grids stay static for those sweeps (on the returned ``g_idx``).

``act_order`` ("desc_act") quantizes columns in order of decreasing ``H_jj``. With
dynamic groups the groups are then contiguous *in that order*, so a column's group is
``g_idx[j] = position_of_j // group_size`` (non-monotone); with ``static_groups`` the
grids are computed up front on the original column order, so ``g_idx`` is the default
``j // group_size`` and the exporter needs no ``g_idx``. In both cases the returned
codes are in the ORIGINAL column order.

Composition with pruning: when the layer already carries a keep-mask (e.g. SparseGPT
2:4 before), every pruned weight is quantized to exactly zero inside the column loop
(its value, moved by earlier error feedback, is treated as rounding error and
compensated), so the mask survives.

Fallback: when ``H + damp I`` is not positive definite the damping is multiplied by 10
(up to 4 tries); if it still fails, the layer is quantized by round-to-nearest and the
fallback is reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError
from ..quantize import QuantizedWeight, check_quant_args, qparams, refit_scales, rtn_quantize, search_clip
from .base import LayerResult, LayerTask, Method
from .config import QuantOptions, check_clip_grid, check_sweep
from .obs import (OBSSweep, StackedGroup, damped_cholesky_inverse, damping_note, fix_dead_channels,
                  split_rows, usable_hessian)
from .registry import register_method


@dataclass
class GPTQConfig(QuantOptions):
    """GPTQ settings (``bits``, ``group_size``, ``sym`` from :class:`QuantOptions`).

    ``act_order`` / ``static_groups``: see the module docstring. ``damp_percent``: the
    damping as a fraction of ``mean(diag(H))``. ``blocksize``: lazy-batch block width.

    ``clip_search``: choose each group's grid by the clipping search (module docstring),
    over ``n_grid`` steps down to ``1 - max_shrink``.

    ``refit_scales``: rounds of scale refit (0: off). Each round re-fits every group's scale
    by least squares with the codes fixed (:func:`~edgeprune.quantize.refit_scales`); a
    round after the first first re-runs the GPTQ sweep on the refitted grids. The export
    format and bits per weight are unchanged.

    ``true_sequential`` (default on, the reference code's ``--true-sequential``): within a
    block the linears are quantized in forward order, group by group (``[q,k,v]``, ``[o]``,
    ``[gate,up]``, ``[down]``), each group's Hessian gathered from the outputs of the
    already-quantized groups before it; off: every linear of the block from one pass over
    the block's inputs (llm-compressor's behaviour).
    """

    act_order: bool = False
    static_groups: bool = False
    damp_percent: float = 0.01
    blocksize: int = 128
    true_sequential: bool = True
    clip_search: bool = False
    n_grid: int = 100
    max_shrink: float = 0.2
    refit_scales: int = 0
    method = "gptq"

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a bad grid, damping, block size, clipping search
        or refit rounds."""
        super().validate()
        check_sweep(self, "damp_percent")
        check_clip_grid(self)
        r = self.refit_scales
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(f"refit_scales={r!r} must be a whole number of rounds >= 0",
                              "use 0 (off) or e.g. 3")


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, *, bits: int = 4, group_size: int = 64,
                  sym: bool = False, act_order: bool = False, static_groups: bool = False,
                  damp_percent: float = 0.01, blocksize: int = 128,
                  mask: Optional[torch.Tensor] = None, tries: int = 4, name: str = "layer",
                  clip_search: bool = False, n_grid: int = 100, max_shrink: float = 0.2,
                  refit: int = 0) -> tuple[Optional[QuantizedWeight], dict]:
    """Quantize ``W`` with GPTQ (Algorithm 1 of Frantar et al. 2023).

    Args:
        W: ``[out, in]`` weight (any float dtype; computed in float32).
        H: ``[in, in]`` Hessian ``X^T X / n`` of the layer input (the factor 2 cancels).
        bits: 2, 3, 4 or 8. group_size: -1 (per row) or a divisor of ``in``.
        sym: symmetric grid. act_order: quantize columns by decreasing ``H_jj``.
        static_groups: with ``act_order``, fix group grids before reordering.
        damp_percent: damping as a fraction of ``mean(diag(H))``.
        blocksize: lazy-batch block width (columns).
        mask: optional ``bool [out, in]`` keep-mask; pruned weights stay exactly zero.
        tries: damping attempts (x10 each) before giving up.
        clip_search: choose each group's grid by the clipping search over ``n_grid``
            steps down to ``1 - max_shrink`` (module docstring) instead of min/max.
        refit: after the sweep, re-fit every group's scale by least squares with the codes
            fixed (:func:`~edgeprune.quantize.refit_scales`, the module docstring).

    Returns:
        ``(qweight, info)``: :class:`QuantizedWeight` with codes in the original column
        order (``None`` when the Hessian stayed singular: the caller falls back to RTN),
        and ``info = {"damp": float, "attempts": int}`` (with ``refit``: the layer loss
        before and after the refit, ``refit_loss``).

    Raises:
        ConfigError: unsupported ``bits``/``group_size`` for this layer.
    """
    out, cols = W.shape
    gs = check_quant_args(bits, group_size, cols, name=name)
    n_groups = cols // gs
    maxq = 2 ** bits - 1
    W = W.detach().float().clone()
    dev = W.device
    if mask is not None:
        mask = mask.to(device=dev, dtype=torch.bool)
        W = W * mask
    H = fix_dead_channels(H.detach().float().to(dev))
    W0, H0 = W, H           # neither is changed in place below (the sweep copies W)

    def grid(w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero ``[out, 1]`` of one group ``w [out, k]`` (``h``: its ``[k, k]`` block of H)."""
        if not clip_search:
            return qparams(w, bits, sym)
        c = search_clip(w, h, bits=bits, group_size=-1, sym=sym, n_grid=n_grid, max_shrink=max_shrink)
        return qparams(w, bits, sym, clip=c)

    static_s = static_z = None
    if static_groups and gs < cols:     # every group's grid at once (one clipping search)
        c = (search_clip(W, H, bits=bits, group_size=gs, sym=sym, n_grid=n_grid,
                         max_shrink=max_shrink).reshape(-1, 1) if clip_search else 1.0)
        s, z = qparams(W.reshape(out * n_groups, gs), bits, sym, clip=c)
        static_s, static_z = s.reshape(out, n_groups), z.reshape(out, n_groups)

    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        W = W[:, perm]
        H = H[perm][:, perm]
        if mask is not None:
            mask = mask[:, perm]

    U, damp, attempts = damped_cholesky_inverse(H, damp_percent, tries=tries)
    info = {"damp": damp, "attempts": attempts}
    if U is None:
        return None, info

    maskt = None if mask is None else mask.t().contiguous()

    def one_sweep(static_s, static_z, group_of):
        """Codes (original order), scales, zeros and g_idx of one GPTQ sweep over the
        permuted ``W``; ``static_s``/``static_z`` ``[out, n_groups]``: fixed grids, the
        group of original column ``j`` being ``group_of[j]``."""
        codes = torch.zeros(cols, out, device=dev)  # transposed: one row per input column
        scales = torch.zeros(out, n_groups, device=dev)
        zeros = torch.zeros(out, n_groups, device=dev)
        cur = {}
        if gs == cols and static_s is None:  # one group per row: grid from the whole row
            s, z = grid(W, H)
            scales[:, 0], zeros[:, 0] = s[:, 0], z[:, 0]
            cur["s"], cur["z"] = s[:, 0], z[:, 0]
        sweep = OBSSweep(W, U, blocksize=blocksize)

        def step(col: int, w: torch.Tensor) -> torch.Tensor:
            if static_s is not None:
                g = int(group_of[int(perm[col]) if perm is not None else col])
                cur["s"], cur["z"] = static_s[:, g], static_z[:, g]
            elif gs < cols and col % gs == 0:
                g = col // gs
                seg = sweep.fresh(col, col + gs)
                if mask is not None:
                    seg = seg * mask[:, col:col + gs]
                s2, z2 = grid(seg, H[col:col + gs, col:col + gs])
                cur["s"], cur["z"] = s2[:, 0], z2[:, 0]
                scales[:, g], zeros[:, g] = cur["s"], cur["z"]
            s, z = cur["s"], cur["z"]
            c = torch.clamp(torch.round(w / s) + z, 0, maxq)
            if maskt is not None:
                c = torch.where(maskt[col], c, z)
            codes[col] = c
            return (c - z) * s

        sweep.run(step)
        codes = codes.t()
        g_idx = None
        if perm is not None:
            inv = torch.argsort(perm)
            codes = codes[:, inv]
            if static_s is None and gs < cols:
                g_idx = (torch.arange(cols, device=dev) // gs)[inv].to(torch.int32).cpu()
        if static_s is not None:
            scales, zeros = static_s, static_z
        return codes, scales, zeros, g_idx

    meta = {"method": "gptq", "damp": damp, "act_order": act_order, "static_groups": bool(static_groups),
            "clip_search": bool(clip_search)}
    group_of = torch.arange(cols, device=dev) // gs
    codes, scales, zeros, g_idx = one_sweep(static_s, static_z, group_of)
    qw = QuantizedWeight(codes=codes.to(torch.uint8).cpu(), scales=scales.float().cpu(),
                         zeros=zeros.to(torch.uint8).cpu(), bits=bits, group_size=gs, sym=sym, g_idx=g_idx,
                         meta=dict(meta))
    for r in range(refit):
        if r:      # codes re-chosen by GPTQ on the refitted grids
            gi = qw.group_index().to(dev)
            codes, _, _, _ = one_sweep(qw.scales.float().to(dev), qw.zeros.float().to(dev), gi)
            qw = QuantizedWeight(codes=codes.to(torch.uint8).cpu(), scales=qw.scales, zeros=qw.zeros, bits=bits,
                                 group_size=gs, sym=sym, g_idx=qw.g_idx, meta=dict(meta))
        qw, rr = refit_scales(qw, W0, H0)
        info.setdefault("refit_loss", []).append((rr["loss_before"], rr["loss_after"]))
    return qw, info


@register_method(GPTQConfig)
class GPTQ(Method):
    """GPTQ quantization (:class:`GPTQConfig`).

    Layers that share one input (q/k/v_proj, gate/up_proj) share one Hessian; since
    GPTQ treats rows independently given ``H``, their rows are stacked and quantized in
    one pass (:class:`~edgeprune.methods.obs.StackedGroup`).
    """

    needs_hessian = True

    def compress_group(self, tasks: list[LayerTask]) -> list[LayerResult]:
        c = self.config
        g = StackedGroup.of(tasks)
        names, W = g.names, g.weight
        notes = []
        qw = None
        if not usable_hessian(g.stats):
            notes.append(f"{names}: no usable calibration activations -> RTN")
        else:
            qw, info = gptq_quantize(W, g.stats.hessian, bits=c.bits, group_size=c.group_size, sym=c.sym,
                                     act_order=c.act_order, static_groups=c.static_groups,
                                     damp_percent=c.damp_percent, blocksize=c.blocksize, mask=g.mask,
                                     name=tasks[0].name, clip_search=c.clip_search, n_grid=c.n_grid,
                                     max_shrink=c.max_shrink, refit=c.refit_scales)
            note = damping_note(names, info["attempts"], qw is None, "RTN")
            if note:
                notes.append(note)
            if qw is not None and not bool(torch.isfinite(qw.scales).all()):
                notes.append(f"{names}: non-finite GPTQ result -> RTN")
                qw = None
        results = []
        if qw is None:
            for t in tasks:
                q = rtn_quantize((t.weight * (t.mask if t.mask is not None else 1)).cpu(), c.bits, c.group_size,
                                 c.sym, name=t.name)
                q.meta.update(method="gptq", fallback="rtn")
                results.append(LayerResult(weight=q.dequantize().to(W.device), quantized=q))
            if results:
                results[0].notes = notes
            return results
        for t, q in zip(tasks, split_rows(qw, g.sizes)):
            results.append(LayerResult(weight=q.dequantize().to(W.device), quantized=q))
        results[0].notes = notes
        return results
