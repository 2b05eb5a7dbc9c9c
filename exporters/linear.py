"""Linear projections of the decoder graph: float ``MatMul``, ``MatMulNBits``, ``DequantizeLinear``.

:class:`LinearMixin` is the part of :class:`~exporters.decoder.DecoderBuilder` that turns
an ``nn.Linear`` (or several fused along the output axis: q/k/v, gate/up) into graph
nodes: float weights as ``[K, N]`` initializers, integer codes (the quantizer's own, or RTN
at export) as ``MatMulNBits`` (fused graphs) or blocked ``DequantizeLinear`` + ``MatMul``
(plain graphs), with per-projection ``MatMulNBits`` accuracy levels.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from onnx import TensorProto

from edgeprune_runtime.errors import ExportError, UnsupportedArchitectureError

from .graph import MS_DOMAIN
from .int4 import (IntWeight, can_fuse, concat_n, default_zero_points, from_quantized,
                   pack_matmulnbits, pack_uint4, rtn_int)


def t2np(t) -> np.ndarray:
    """A torch tensor as ``float32`` numpy (detached, on the CPU)."""
    return t.detach().cpu().float().numpy()


def name_ends_with(name: str, suffix: str) -> bool:
    """Whether ``suffix`` ends ``name`` on a name-segment boundary (``.`` or ``/``):
    ``down_proj`` ends ``layers.0.mlp.down_proj``, but ``v_proj`` does not end the fused
    ``layers.0.attn.qkv_proj`` nor ``up_proj`` the fused ``gate_up_proj``."""
    if not name.endswith(suffix):
        return False
    return len(name) == len(suffix) or suffix[0] in "./" or name[-len(suffix) - 1] in "./"


def accuracy_level_for(name: str, default: int, overrides: Optional[dict],
                       node: Optional[str] = None) -> int:
    """``MatMulNBits`` accuracy level of the projection ``name`` (a module name such as
    ``model.layers.0.self_attn.v_proj``, or ``lm_head``) computed in the node ``node``:
    the first ``overrides`` suffix that ends either name on a segment boundary
    (``{"down_proj": 0}``, ``{"qkv_proj": 0}`` for a fused q/k/v node), else ``default``."""
    for suffix, lvl in (overrides or {}).items():
        if name_ends_with(name, suffix) or (node is not None and name_ends_with(node, suffix)):
            return int(lvl)
    return default


class LinearMixin:
    """Projections of :class:`~exporters.decoder.DecoderBuilder` (reads ``self.g``,
    ``self.opts``, ``self.model``, ``self.modules``; fills ``self.int_weights``,
    ``self.quant_summary``, ``self.accuracy_names``)."""

    def param(self, name: str) -> np.ndarray:
        """Parameter ``name`` of the model as ``float32`` numpy."""
        return t2np(self.model.get_parameter(name))

    def weight_int(self, module_name: str) -> Optional[IntWeight]:
        """The integer form of a linear layer, or ``None`` when it stays float."""
        q = self.opts.quantized.get(module_name)
        w = None
        if q is not None:
            w = from_quantized(q, module_name)
        elif self.opts.precision == "int4":
            w = rtn_int(self.param(module_name + ".weight"), 4, self.opts.group_size)
        if w is not None:
            self.int_weights[module_name] = w
        return w

    def has_bias(self, module_name: str) -> bool:
        return getattr(self.modules.get(module_name), "bias", None) is not None

    def linear(self, x: str, module_names: list[str], name: str, bias: Optional[bool] = None,
               levels: Optional[list[int]] = None) -> str:
        """``x @ concat(W_i)^T (+ b)`` for modules fused along the output axis.

        int weights -> ``MatMulNBits`` (fused graph) or ``DequantizeLinear`` + ``MatMul``
        (plain graph); float weights -> ``MatMul`` with a ``[K, N]`` initializer.
        Parts that cannot be fused exactly, or that were given different accuracy levels
        (``accuracy_levels={"v_proj": 0}`` keeps q/k at the default), are computed
        separately and concatenated. ``levels``: the parts' accuracy levels (computed
        here from the module names and ``name`` when not given).
        """
        for m in module_names:
            mod = self.modules.get(m)
            if mod is None or not hasattr(mod, "weight"):
                raise ExportError(f"module '{m}' is missing from the model",
                                  "export a complete llama/qwen2 checkpoint")
            if type(mod).__name__ != "Linear":
                raise UnsupportedArchitectureError(
                    f"layer '{m}' is a {type(mod).__name__}, not a Linear",
                    "only nn.Linear projections can be exported")
        if bias is None:
            bias = any(self.has_bias(m) for m in module_names)
        ints = [self.weight_int(m) for m in module_names]
        if levels is None:
            levels = [self._accuracy_level(m, node=name) if w is not None and self.fused else None
                      for m, w in zip(module_names, ints)]
        out = None
        if all(w is not None for w in ints) and can_fuse(ints) and len(set(levels)) == 1:
            out = self.int_matmul(x, concat_n(ints), name, level=levels[0])
            for m, w in zip(module_names, ints):
                self.quant_summary[m] = f"int{w.bits} block {w.block_size}"
        elif all(w is None for w in ints):
            W = np.concatenate([self.param(m + ".weight") for m in module_names], 0)
            out = self.float_matmul(x, W, name, module_names)
        else:
            # mixed parts (e.g. best-w4's 8-bit v_proj beside 4-bit q/k): fuse each maximal
            # run of neighbours that can share one node, concatenate the runs
            runs = [[0]]
            for j in range(1, len(module_names)):
                prev = [ints[k] for k in runs[-1]]
                if (ints[j] is None) == (prev[0] is None) and \
                        (ints[j] is None or (can_fuse(prev + [ints[j]]) and
                                             levels[j] == levels[runs[-1][0]])):
                    runs[-1].append(j)
                else:
                    runs.append([j])
            outs = [self.linear(x, [module_names[k] for k in r],
                                f"{name}_" + "_".join(module_names[k].split(".")[-1] for k in r),
                                levels=[levels[k] for k in r])
                    for r in runs]
            return self.g.concat(outs, axis=-1, name=name + "/concat")
        if bias:
            out = self._add_bias(out, module_names, name)
        return out

    def _add_bias(self, x, module_names, name):
        b = np.concatenate([self.param(m + ".bias") if self.has_bias(m) else
                            np.zeros(self.modules[m].weight.shape[0], np.float32)
                            for m in module_names]).astype(self.fdtype)
        return self.g.add(x, self.g.initializer(name + ".bias", b), name=name + "/bias")

    def float_matmul(self, x: str, W: np.ndarray, name: str, module_names: list[str]) -> str:
        """``x @ W^T`` for a float weight ``W [N, K]`` (the fused parts ``module_names``),
        stored as a ``[K, N]`` initializer in the model's float dtype."""
        for m in module_names:
            self.quant_summary[m] = self.opts.precision if self.opts.precision != "int4" else "fp32"
        return self.g.matmul(x, self.g.initializer(name + ".weight",
                                                   np.ascontiguousarray(W.T.astype(self.fdtype))),
                             name=name)

    def _permuted(self, x, perm):
        key = (x, perm.tobytes())
        if key not in self._perm_cache:
            idx = self.g.initializer("act_order_perm", perm.astype(np.int64))
            self._perm_cache[key] = self.g.gather(x, idx, axis=-1, name="act_order")
        return self._perm_cache[key]

    def _accuracy_level(self, name: str, node: Optional[str] = None,
                        default: Optional[int] = None) -> int:
        """:func:`accuracy_level_for` with this build's options (``default``: the
        export's level); the names are kept for the check that every override matched
        something."""
        self.accuracy_names.update(n for n in (name, node) if n is not None)
        return accuracy_level_for(name, self.opts.accuracy_level if default is None else default,
                                  self.opts.accuracy_levels, node)

    def int_matmul(self, x: str, w: IntWeight, name: str, level: Optional[int] = None) -> str:
        """``x @ dequant(w)^T``: ``MatMulNBits`` (fused graph, at ``level`` or the
        export's accuracy level) or blocked ``DequantizeLinear`` + ``MatMul`` (plain)."""
        g = self.g
        if w.perm is not None:
            x = self._permuted(x, w.perm)
        if self.fused:
            B, sc, zp = pack_matmulnbits(w)
            ins = [x, g.initializer(name + ".qweight", B),
                   g.scales(name + ".scales", sc, self.fdtype)]
            if not default_zero_points(w):     # symmetric grids use the op's default
                ins.append(g.initializer(name + ".qzeros", zp))
            return g.node("MatMulNBits", ins,
                          name=name, domain=MS_DOMAIN, K=w.K, N=w.N, bits=w.bits,
                          block_size=w.block_size,
                          accuracy_level=self._accuracy_level(name) if level is None else level)
        return g.matmul(x, self._dequant_linear(w, name), name=name)

    def _dequant_linear(self, w: IntWeight, name: str) -> str:
        """Plain path: blocked ``DequantizeLinear`` (opset 21) -> ``W^T float [K, N]``."""
        from onnx import helper, numpy_helper
        g = self.g
        nb, bs = w.n_blocks, w.block_size
        elem = TensorProto.UINT4 if w.bits == 4 else TensorProto.UINT8
        codes_t = np.ascontiguousarray(w.codes.T)          # [K, N]
        zeros_t = np.ascontiguousarray(w.zeros.T)          # [nb, N]
        qname = g.unique(name + ".qweight")
        zname = g.unique(name + ".qzeros")
        if w.bits == 4:
            g.initializers.append(helper.make_tensor(qname, elem, codes_t.shape,
                                                     pack_uint4(codes_t.reshape(-1)).tobytes(),
                                                     raw=True))
            g.initializers.append(helper.make_tensor(zname, elem, zeros_t.shape,
                                                     pack_uint4(zeros_t.reshape(-1)).tobytes(),
                                                     raw=True))
        else:
            g.initializers.append(numpy_helper.from_array(codes_t, qname))
            g.initializers.append(numpy_helper.from_array(zeros_t, zname))
        sname = g.initializer(name + ".scales", np.ascontiguousarray(w.scales.T.astype(self.fdtype)))
        return g.node("DequantizeLinear", [qname, sname, zname], name=name + "/dq",
                      axis=0, block_size=bs)


__all__ = ["LinearMixin", "name_ends_with", "accuracy_level_for", "t2np"]
