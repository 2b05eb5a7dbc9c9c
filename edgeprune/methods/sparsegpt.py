"""SparseGPT: Massive Language Models Can Be Accurately Pruned in One-Shot
(Frantar & Alistarh, ICML 2023).

SparseGPT prunes a layer's weight ``W [out, in]`` column by column, and after each
column compensates the removed (and, with joint quantization, rounded) weights by an
Optimal Brain Surgeon update of the remaining columns, using the upper Cholesky factor
``U`` of the damped inverse Hessian ``(X^T X + damp I)^-1`` (Algorithm 1 of the paper),
as implemented by :func:`sparsegpt_prune`:

* Columns are processed in blocks of ``blocksize`` (128). Unstructured: at the start of
  each block the mask is chosen *adaptively* from the error-updated weights with the OBS
  saliency ``w_ij^2 / [H^-1]_jj^2`` (``= (w / U_jj)^2``), removing the lowest-saliency
  fraction ``sparsity`` of the block (per-block counts rounded cumulatively, so the
  layer's count is exact: ``round(sparsity x rows x in)``).
  N:M: at every ``prune_m``-th column, the ``prune_m - prune_n`` lowest-saliency weights of
  the next ``prune_m`` columns of each row are removed. Weights an earlier mask pruned
  stay pruned in both modes (a group may then hold fewer than ``prune_n``).
* For each column ``j``: ``q_j = w_j`` with pruned entries set to 0 (and rounded to the
  quantization grid when ``bits`` is set, joint sparsification + quantization, Sec. 3.5);
  ``e_j = (w_j - q_j) / U_jj``; ``W[:, j:] -= e_j U[j, j:]``; lazy update of the columns
  after the block with the block's errors.
* ``damp = percdamp * mean(diag(H))``; dead input channels get ``H_jj = 1``.

Fallback: when ``H + damp I`` stays singular after 4 tries (damping x10 each), the layer
is pruned by magnitude (and RTN-quantized when ``bits`` is set); the fallback is reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..quantize import QuantizedWeight, check_quant_args, qparams, rtn_quantize
from .base import LayerResult, LayerTask, Method, pattern_name
from .config import PruneOptions, check_bits, check_sweep
from .magnitude import magnitude_prune
from .obs import (OBSSweep, StackedGroup, damped_cholesky_inverse, damping_note, fix_dead_channels,
                  split_rows, usable_hessian)
from .registry import register_method


@dataclass
class SparseGPTConfig(PruneOptions):
    """SparseGPT settings (``sparsity``, ``prune_n``, ``prune_m`` from :class:`PruneOptions`).

    ``blocksize``: columns per mask-selection / lazy-update block. ``percdamp``: damping as
    a fraction of ``mean(diag(H))``. ``bits`` (``None``: no quantization), ``group_size``,
    ``sym``: the grid of the joint quantization (Sec. 3.5); the stage then also quantizes
    (:attr:`quantizes`).

    ``true_sequential`` (default on): within a block the linears are pruned in forward
    order, group by group (``[q,k,v]``, ``[o]``, ``[gate,up]``, ``[down]``), each group's
    Hessian gathered from the outputs of the already-pruned groups before it (as GPTQ's
    reference code does); off: every linear of the block from one pass of dense inputs
    (the SparseGPT reference code and llm-compressor).
    """

    blocksize: int = 128
    percdamp: float = 0.01
    bits: Optional[int] = None
    group_size: int = 64
    sym: bool = False
    true_sequential: bool = True
    method = "sparsegpt"

    def validate(self) -> None:
        """Raises :class:`ConfigError` on bad sparsity, damping, block size or grid."""
        super().validate()
        check_sweep(self, "percdamp")
        if self.bits is not None:
            check_bits(self.bits, self.group_size, self.sym)

    @property
    def quantizes(self) -> bool:
        """Joint quantization: only with ``bits`` set."""
        return self.bits is not None


def sparsegpt_prune(W: torch.Tensor, H: torch.Tensor, *, sparsity: float = 0.5, prune_n: int = 0,
                    prune_m: int = 0, blocksize: int = 128, percdamp: float = 0.01,
                    bits: Optional[int] = None, group_size: int = 64, sym: bool = False,
                    mask: Optional[torch.Tensor] = None, row_splits: Optional[list[int]] = None,
                    tries: int = 4, name: str = "layer"
                    ) -> Optional[tuple[torch.Tensor, torch.Tensor, Optional[QuantizedWeight], dict]]:
    """Prune (and optionally quantize) ``W`` with SparseGPT.

    Args:
        W: ``[out, in]`` weight; H: ``[in, in]`` ``X^T X / n``.
        sparsity: fraction removed (unstructured); ignored when ``prune_n`` is set.
        prune_n, prune_m: keep at most ``prune_n`` of every ``prune_m`` consecutive inputs.
        blocksize: columns per mask-selection / lazy-update block.
        percdamp: damping as a fraction of ``mean(diag(H))``.
        bits, group_size, sym: joint quantization grid (``bits=None``: no quantization).
        mask: earlier keep-mask; those weights stay pruned.
        row_splits: row counts of layers stacked in ``W`` (q/k/v sharing ``H``); the
            unstructured count is taken per layer so the result equals one call per layer.

    Returns:
        ``(W_new [out, in] float32, keep bool [out, in], qweight or None, info)``, or
        ``None`` when the Hessian stayed singular (the caller falls back to magnitude).
    """
    out, cols = W.shape
    W = W.detach().float().clone()
    dev = W.device
    prev_keep = None if mask is None else mask.to(device=dev, dtype=torch.bool)
    if prev_keep is not None:
        W = W * prev_keep
    H = fix_dead_channels(H.detach().float().to(dev))
    U, damp, attempts = damped_cholesky_inverse(H, percdamp, tries=tries)
    info = {"damp": damp, "attempts": attempts}
    if U is None:
        return None
    splits = row_splits or [out]
    bounds = [(sum(splits[:k]), sum(splits[:k + 1])) for k in range(len(splits))]
    quant = bits is not None
    if quant:
        gs = check_quant_args(bits, group_size, cols, name=name)
        maxq = 2 ** bits - 1
        n_groups = cols // gs
        codes = torch.zeros(out, cols, device=dev)
        scales = torch.zeros(out, n_groups, device=dev)
        zeros = torch.zeros(out, n_groups, device=dev)
    pruned = torch.zeros(out, cols, dtype=torch.bool, device=dev)
    diagU = torch.diagonal(U)
    cur = {}
    sweep = OBSSweep(W, U, blocksize=blocksize)

    def step(col: int, w: torch.Tensor) -> torch.Tensor:
        if not prune_n and col == sweep.i1:  # adaptive mask of the next block of columns
            i1, i2 = sweep.i1, sweep.i2
            sal = (sweep.fresh(i1, i2) / diagU[None, i1:i2]) ** 2
            if prev_keep is not None:
                sal = torch.where(prev_keep[:, i1:i2], sal, torch.full_like(sal, -1.0))
            for r0, r1 in bounds:
                seg = sal[r0:r1]
                # cumulative rounding: the block counts add up to the layer's exact count
                k = int(round((r1 - r0) * i2 * sparsity)) - int(round((r1 - r0) * i1 * sparsity))
                if prev_keep is not None:
                    k = max(k, int((~prev_keep[r0:r1, i1:i2]).sum()))
                if k:
                    idx = torch.argsort(seg.flatten(), stable=True)[:k]
                    flat = torch.zeros(seg.numel(), dtype=torch.bool, device=dev)
                    flat[idx] = True
                    pruned[r0:r1, i1:i2] = flat.reshape(seg.shape)
        if prune_n and col % prune_m == 0:
            sal = (sweep.fresh(col, col + prune_m) / diagU[None, col:col + prune_m]) ** 2
            if prev_keep is not None:
                sal = torch.where(prev_keep[:, col:col + prune_m], sal, torch.full_like(sal, -1.0))
            idx = torch.topk(sal, prune_m - prune_n, dim=1, largest=False).indices
            pruned[:, col:col + prune_m].scatter_(1, idx, True)
            if prev_keep is not None:   # more than m - n pruned before: all stay pruned
                pruned[:, col:col + prune_m] |= ~prev_keep[:, col:col + prune_m]
        p_col = pruned[:, col]
        q = torch.where(p_col, torch.zeros_like(w), w)
        if quant:
            if col % gs == 0:
                g = col // gs
                seg = sweep.fresh(col, col + gs)
                # weights already known to be pruned do not widen the grid
                seg = torch.where(pruned[:, col:col + gs], torch.zeros_like(seg), seg)
                s2, z2 = qparams(seg, bits, sym)
                cur["s"], cur["z"] = s2[:, 0], z2[:, 0]
                scales[:, g], zeros[:, g] = cur["s"], cur["z"]
            s, z = cur["s"], cur["z"]
            c = torch.clamp(torch.round(q / s) + z, 0, maxq)
            c = torch.where(p_col, z, c)
            codes[:, col] = c
            q = (c - z) * s
        return q

    W = sweep.run(step)

    keep = ~pruned
    W = W * keep
    qw = None
    if quant:
        qw = QuantizedWeight(codes=codes.to(torch.uint8).cpu(), scales=scales.cpu(), zeros=zeros.to(torch.uint8).cpu(),
                             bits=bits, group_size=gs, sym=sym, meta={"method": "sparsegpt", "damp": damp})
        W = qw.dequantize().to(dev) * keep
    return W, keep, qw, info


@register_method(SparseGPTConfig)
class SparseGPT(Method):
    """SparseGPT pruning, optionally with joint quantization (:class:`SparseGPTConfig`).

    Layers sharing one input (q/k/v, gate/up) are stacked and processed in one pass with
    per-layer mask counts (identical to one pass per layer).
    """

    needs_hessian = True

    def compress_group(self, tasks: list[LayerTask]) -> list[LayerResult]:
        c = self.config
        g = StackedGroup.of(tasks)
        names, sizes = g.names, g.sizes
        pat = pattern_name(c)
        res = None
        notes = []
        if not usable_hessian(g.stats):
            notes.append(f"{names}: no usable calibration activations -> magnitude"
                         + (" + RTN" if c.bits else ""))
        else:
            res = sparsegpt_prune(g.weight, g.stats.hessian, sparsity=c.sparsity, prune_n=c.prune_n,
                                  prune_m=c.prune_m, blocksize=c.blocksize, percdamp=c.percdamp,
                                  bits=c.bits, group_size=c.group_size, sym=c.sym, mask=g.mask,
                                  row_splits=sizes, name=tasks[0].name)
            note = damping_note(names, 4 if res is None else res[3]["attempts"], res is None,
                                "magnitude" + (" + RTN" if c.bits else ""))
            if note:
                notes.append(note)
        out = []
        if res is None:
            for t in tasks:
                keep = magnitude_prune(t.weight, c.sparsity, c.prune_n, c.prune_m, t.mask)
                w = t.weight * keep
                q = None
                if c.bits:
                    q = rtn_quantize(w.cpu(), c.bits, c.group_size, c.sym, name=t.name)
                    q.meta.update(method="sparsegpt", fallback="rtn")
                    w = q.dequantize().to(w.device) * keep
                out.append(LayerResult(weight=w, mask=keep, pattern=pat, quantized=q))
            out[0].notes = notes
            return out
        Wn, keep, qw, _ = res
        qs = split_rows(qw, sizes) if qw is not None else [None] * len(tasks)
        r0 = 0
        for t, n, q in zip(tasks, sizes, qs):
            out.append(LayerResult(weight=Wn[r0:r0 + n].clone(), mask=keep[r0:r0 + n].clone(), pattern=pat,
                                   quantized=q))
            r0 += n
        out[0].notes = notes
        return out
