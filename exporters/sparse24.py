"""2:4 semi-structured sparsity in exports: verification, metadata and a compact form.

2:4 ("N:M" with ``prune_n=2, prune_m=4``; SparseGPT, Frantar & Alistarh 2023; Wanda,
Sun et al. 2024) keeps at most 2 non-zeros in every group of 4 consecutive input
channels of a linear weight ``W [out, in]``. The dense export keeps the zeros exactly
(the graph is an ordinary dense graph; metadata records the pattern).

Compact on-disk form (the graph variant ``"compact24"``, :class:`Compact24Mixin`:
``export_onnx(..., variants=["compact24"])``): each 2:4 weight is stored as
``values float16 [out, in/2]`` (the kept entries, in column order) and
``positions uint8 [out, in/8]`` (the 2-bit position 0..3 of each kept entry inside its
group, four per byte, low bits first). The graph expands them with standard ops
(``BitShift``/``BitwiseAnd`` -> ``ScatterElements`` into zeros -> ``Transpose``); all inputs
are initializers, so ONNX Runtime's constant folding rebuilds the dense weight once at
session load: the folder is smaller on disk, the loaded session is the ordinary dense
one. Storage: 2 bytes x in/2 + 2 bits x in/2 per row = 1.125 bytes per weight vs 2 for
fp16 dense. No 2:4 speed-up is claimed (CPU kernels are dense); TensorRT's sparsity flag
is set by the runtime when that execution provider is used.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from edgeprune_runtime.errors import ExportError

from .variants import VariantMixin, register_export_variant

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_24(w: np.ndarray) -> tuple[bool, int]:
    """Whether ``w [out, in]`` has at most 2 non-zeros per group of 4 input channels.

    Returns ``(ok, bad_groups)``.
    """
    out, inp = w.shape
    if inp % 4:
        return False, -1
    nz = (w.reshape(out, inp // 4, 4) != 0).sum(-1)
    bad = int((nz > 2).sum())
    return bad == 0, bad


def check_24(model) -> dict:
    """Verify every decoder linear of ``model`` is exactly 2:4 and summarise.

    Returns:
        ``{"pattern": "2:4", "prune_n": 2, "prune_m": 4, "layers": int, "sparsity": float}``.

    Raises:
        ExportError: a layer breaks the pattern (named, with its count of bad groups).
    """
    n_layers, zeros, total = 0, 0, 0
    for name, mod in model.named_modules():
        if name.split(".")[-1] not in LINEARS or not hasattr(mod, "weight"):
            continue
        w = mod.weight.detach().cpu().float().numpy()
        ok, bad = is_24(w)
        if not ok:
            raise ExportError(f"{name} is not 2:4 sparse ({bad} groups of 4 have more than "
                              "2 non-zeros)" if bad >= 0 else f"{name}: in_features "
                              f"{w.shape[1]} is not a multiple of 4",
                              "prune with prune_n=2, prune_m=4, or export without --sparse-24")
        n_layers += 1
        zeros += int((w == 0).sum())
        total += w.size
    return {"pattern": "2:4", "prune_n": 2, "prune_m": 4, "layers": n_layers,
            "sparsity": zeros / max(total, 1)}


def compress_24(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [out, in]`` (2:4) -> ``(values float16 [out, in/2], positions uint8 [out, in/8])``.

    Groups with fewer than 2 non-zeros store explicit zeros at unused positions.
    """
    out, inp = w.shape
    g = w.reshape(out, inp // 4, 4)
    # two positions per group: non-zeros first (stable), in increasing column order
    order = np.argsort(g == 0, axis=-1, kind="stable")[..., :2]
    order = np.sort(order, axis=-1)
    vals = np.take_along_axis(g, order, axis=-1).reshape(out, inp // 2).astype(np.float16)
    pos = order.reshape(out, inp // 2).astype(np.uint8)
    if pos.shape[1] % 4:
        pos = np.concatenate([pos, np.zeros((out, 4 - pos.shape[1] % 4), np.uint8)], 1)
    p = pos.reshape(out, -1, 4)
    packed = (p[..., 0] | (p[..., 1] << 2) | (p[..., 2] << 4) | (p[..., 3] << 6)).astype(np.uint8)
    return vals, packed


def expand_24(values: np.ndarray, packed: np.ndarray, inp: int) -> np.ndarray:
    """Inverse of :func:`compress_24` in numpy (reference for the graph expansion)."""
    out = values.shape[0]
    pos = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], -1).reshape(out, -1)[:, :inp // 2]
    cols = (np.arange(inp // 2) // 2) * 4 + pos
    w = np.zeros((out, inp), np.float32)
    np.put_along_axis(w, cols.astype(np.int64), values.astype(np.float32), axis=1)
    return w


@register_export_variant("compact24")
class Compact24Mixin(VariantMixin):
    """Builder mixin: float 2:4 linears stored in the compact form (no spec; its dict is
    empty). Every decoder linear must be exactly 2:4 (checked, recorded as ``sparsity``);
    the 8-bit ``lm_head`` is the default (small-model quality). A weight that is 2:4
    becomes ``values``/``positions`` initializers plus the expansion subgraph
    (constant-folded by ONNX Runtime at load); other weights are unchanged.

    Raises:
        ExportError: a linear that is not 2:4 (:func:`check_24`).
    """

    def __init__(self, model, spec, opts):
        super().__init__(model, spec, opts)
        self.sparsity_info = check_24(model)
        self.approximate_logits = True        # fp16 values: logits match up to rounding
        self.compact_24_layers: list[str] = []

    def default_lm_head(self) -> str:
        return "q8"

    def variant_record(self) -> dict:
        return {"format": "values float16 [out, in/2] + 2-bit positions uint8 [out, in/8], "
                          "expanded by constant folding at load",
                "layers": len(self.compact_24_layers)}

    def float_matmul(self, x: str, W: np.ndarray, name: str, module_names: list[str]) -> str:
        """``x @ W^T`` with a 2:4 ``W`` stored compact (others: the base storage)."""
        ok, _ = is_24(W)
        if not ok:
            return super().float_matmul(x, W, name, module_names)
        g = self.g
        row = 0
        for m in module_names:
            self.quant_summary[m] = "2:4 compact fp16"
            n_out = self.modules[m].weight.shape[0]
            # validation compares against the torch model with these fp16-rounded values
            self.int_weights[m] = Fp16Weight(W[row:row + n_out])
            row += n_out
        self.compact_24_layers.append(name)
        N, K = W.shape
        vals, packed = compress_24(W)
        v = g.initializer(name + ".values_24", vals)
        p = g.initializer(name + ".positions_24", packed)
        parts = [g.node("BitwiseAnd", [g.node("BitShift", [p, g.const(s, np.uint8)],
                                              direction="RIGHT", name=name + "/unpack"),
                                       g.const(3, np.uint8)]) for s in (0, 2, 4, 6)]
        st = g.concat([g.unsqueeze(q, [-1]) for q in parts], axis=-1, name=name + "/stack")
        pos = g.reshape(st, [N, -1])
        if (K // 2) % 4:
            pos = g.slice(pos, [0], [K // 2], [1])
        cols = g.add(g.cast(pos, TensorProto.INT64),
                     g.const((np.arange(K // 2) // 2) * 4, np.int64, name="group_base"))
        zeros = g.node("ConstantOfShape", [g.const([N, K])], name=name + "/zeros",
                       value=_zero_tensor(self.ftype))
        dense = g.node("ScatterElements", [zeros, cols, g.cast(v, self.ftype)],
                       name=name + "/expand", axis=1)
        return g.matmul(x, g.transpose(dense, [1, 0], name=name + "/wT"), name=name)


class Fp16Weight:
    """A float weight as stored by the compact form (values rounded to float16); the
    ``dequantize`` interface of :class:`exporters.int4.IntWeight` for validation."""

    bits = 16

    def __init__(self, w: np.ndarray):
        self.w = w

    def dequantize(self, original_order: bool = True) -> np.ndarray:
        return self.w.astype(np.float16).astype(np.float32)


def _zero_tensor(elem_type):
    from onnx import helper
    return helper.make_tensor("zero", elem_type, [1], [0])


__all__ = ["check_24", "is_24", "compress_24", "expand_24", "Compact24Mixin", "LINEARS"]
