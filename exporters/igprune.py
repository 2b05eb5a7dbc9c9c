"""IG-Pruning in ONNX: one graph whose attention and MLP sub-blocks are bypassed per request.

IG-Pruning (Qiao, Zhang, Feng; EMNLP 2025) runs, per input, a mask over the ``2L``
sub-blocks (``2i``: layer ``i``'s attention, ``2i + 1``: its MLP) picked by a router.
This module turns a spec (``edgeprune.igprune.IgPruneSpec`` as a dict: ``masks``,
``skip_ratio``, ``embed_layer``, ``route_tokens``, ``fingerprint``, and under ``"arrays"``
the router's ``centroids`` / ``center`` / ``scale``) into the decoder graph: the builder
mixin :class:`IgPruneMixin`, registered as the graph variant ``"igprune"``::

    exporters.export_onnx(model, tok, out, variants=[spec])

The graph (always a *plain* graph: ``graph="fused"`` is switched to ``"plain"`` and
recorded) takes one more input, ``igprune_mask bool [2L]``, and wraps every sub-block in
an ``If`` on its entry::

    then:  r' = r + f_j(norm(r))        (attention: present = past ++ new K/V)
    else:  r' = r                       (attention: present = past, passed through)

With the concatenated cache a bypassed attention layer's past stays ``[B, KV, 0, D]``
for the whole generation (the runtime starts every cache empty): it writes no KV entries
and holds no KV memory. A second output, ``igprune_embedding float32 [B, H]``, is the mean
over the pass's positions of the residual stream after ``embed_layer`` layers: the
runtime's router runs the first ``route_tokens`` prompt tokens with the mask that keeps
only those layers and reads it (``runtime.igprune``).

Why one gated graph, not one graph per mask: K graphs would store (and map) the weights K
times (or need a shared external-data layout the exporter does not write), while an
``If`` costs a few microseconds per sub-block per pass (measured with
``bench/igpruning.py``'s all-ones row against the dense export; see docs/igpruning.md).

int4 (``precision="int4"``): the linears inside the branches are ``MatMulNBits`` nodes, as
in a fused int4 export (:meth:`IgPruneMixin.int_matmul`), at the export's accuracy level.
"""

from __future__ import annotations

import hashlib

import numpy as np
from onnx import TensorProto, helper

from edgeprune_runtime.errors import ExportError, UnsupportedArchitectureError

from .countdown import _sub_builder
from .variants import VariantMixin, register_export_variant

MASK_INPUT = "igprune_mask"
EMBEDDING_OUTPUT = "igprune_embedding"
_CONFIG_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "vocab_size")


def model_fingerprint(model) -> str:
    """A sha256 (hex) of what identifies a model for IG-Pruning and survives weight
    quantization and pruning: the config's shape fields, every RMSNorm weight and the
    first 16 rows of the token embedding (neither is quantized by edgeprune's methods)."""
    h = hashlib.sha256()
    cfg = model.config
    h.update(repr([getattr(cfg, k, None) for k in _CONFIG_KEYS]).encode())
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
    emb = model.get_input_embeddings().weight
    h.update(emb[:16].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def check_spec(spec: dict, model) -> dict:
    """Validate an IG-Pruning spec dict against ``model``; returns it with ``masks`` as a
    ``bool [K, 2L]`` array under ``"mask_array"``.

    Raises:
        ExportError: a missing field, masks of another length than ``2L``, a mask that
            skips every sub-block, router arrays that do not fit, or a spec calibrated on
            another model (fingerprint).
    """
    for a in ("masks", "skip_ratio", "embed_layer", "route_tokens", "fingerprint"):
        if a not in spec:
            raise ExportError(f"igprune spec lacks '{a}'",
                              "pass edgeprune.igprune.IgPruneSpec.calibrate(...)'s spec, or a file "
                              "from `edgeprune igprune`")
    L = model.config.num_hidden_layers
    m = np.asarray(spec["masks"])
    if m.ndim != 2 or m.shape[1] != 2 * L or not np.isin(m, (0, 1)).all():
        raise ExportError(f"igprune masks have shape {m.shape}, the model {2 * L} sub-blocks",
                          "calibrate the spec on this model")
    if not m.any(axis=1).all():
        raise ExportError("an igprune mask skips every sub-block",
                          "keep at least one sub-block per mask (lower skip_ratio, recalibrate)")
    if spec["fingerprint"] != model_fingerprint(model):
        raise ExportError("this igprune spec was calibrated on another model (fingerprint differs)",
                          "calibrate a spec for this model with `edgeprune igprune`")
    arrays = spec.get("arrays") or {}
    H = model.config.hidden_size
    cents = np.asarray(arrays.get("centroids", np.zeros((0, 0))), np.float32)
    if cents.shape != (len(m), H) or np.asarray(arrays.get("center", [])).shape != (H,):
        raise ExportError(f"igprune router arrays do not fit: centroids {cents.shape}, "
                          f"expected {(len(m), H)}", "re-run `edgeprune igprune` on this model")
    e = int(spec["embed_layer"])
    if not 1 <= e <= L:
        raise ExportError(f"igprune embed_layer={e} is outside [1, {L}]", "recalibrate the spec")
    return {**spec, "mask_array": m.astype(bool)}


@register_export_variant("igprune")
class IgPruneMixin(VariantMixin):
    """Builder mixin: per-request bypass of every attention / MLP sub-block
    (``build_inputs``, ``kv_names``, ``build_layer``, ``build_extra_outputs``).

    Raises:
        ExportError: see :func:`check_spec`.
        UnsupportedArchitectureError: sliding-window layers (their windowed cache and mask
            are not built for bypassed layers).
    """

    def __init__(self, model, spec, opts):
        self.ig_requested_graph = opts.graph
        opts.graph = "plain"          # the concatenated cache lets a bypassed layer hold no KV
        super().__init__(model, spec, opts)
        self.ig = check_spec(opts.variants["igprune"], model)
        if spec.sliding_layers:
            raise UnsupportedArchitectureError("IG-Pruning graphs do not support sliding-window "
                                               "layers", "export this model without --variant")
        self.logits_match_model = False     # the logits follow the mask fed at run time
        self.logits_differ_because = "the graph bypasses the sub-blocks of the mask each prompt routes to"
        self._ig_branch = False
        self._ig_embedding = None

    # ------------------------------------------------------------------ I/O
    def build_inputs(self):
        """The plain inputs, ``igprune_mask bool [2L]``, and the shared rotary tables and
        attention mask (built here in the main graph, so every branch can read them)."""
        super().build_inputs()
        self.g.input(MASK_INPUT, TensorProto.BOOL, [2 * self.spec.num_layers])
        self._plain_rope_and_mask()

    def kv_names(self, i: int) -> tuple[str, str, str, str]:
        """Inside an attention branch the present tensors get branch-local names (the
        ``If`` node's outputs carry the graph's ``present.i.*``)."""
        pk, pv, ok, ov = super().kv_names(i)
        return (pk, pv, ok + "/kept", ov + "/kept") if self._ig_branch else (pk, pv, ok, ov)

    def int_matmul(self, x: str, w, name: str, level=None) -> str:
        """int weights as ``MatMulNBits`` in this plain graph too: onnxruntime's
        ``DequantizeLinear`` -> ``MatMulNBits`` rewrite cannot read the weights of a node
        inside an ``If`` branch (they are outer-scope initializers)."""
        saved, self.fused = self.fused, True
        try:
            return super().int_matmul(x, w, name, level)
        finally:
            self.fused = saved

    # ------------------------------------------------------------------ blocks
    def _ig_if(self, j: int, name: str, run, passthrough: list) -> list:
        """``If(igprune_mask[j])``: the then branch is ``run(sub)`` -> output names, the
        else branch passes ``passthrough`` (same count) through; returns the outputs."""
        g = self.g
        cond = g.node("Gather", [MASK_INPUT, g.const(j)], name=f"{name}/gate")
        tb, eb = _sub_builder(g), _sub_builder(g)
        with self.building_into(tb):
            outs = run(tb)
        pas = [eb.node("Identity", [p], name=f"{name}/bypass") for p in passthrough]
        if tb.uses_ms_domain:
            g.uses_ms_domain = True
        vi = lambda n: helper.make_tensor_value_info(n, self.ftype, None)  # noqa: E731
        then_g = helper.make_graph(tb.nodes, f"{name}_run", [], [vi(o) for o in outs])
        else_g = helper.make_graph(eb.nodes, f"{name}_bypass", [], [vi(o) for o in pas])
        res = g.node("If", [cond], n_out=len(outs), name=name + "/if",
                     outputs=self._ig_outputs, then_branch=then_g, else_branch=else_g)
        return res if isinstance(res, list) else [res]

    def build_layer(self, i: int, layer, h: str, residual: str) -> tuple[str, str]:
        """Layer ``i`` with its attention (sub-block ``2i``) and MLP (``2i + 1``) each
        behind an ``If``; returns the next block's normed input and the residual."""
        g, s = self.g, self.spec
        pk, pv, ok, ov = self.kv_names(i)

        def attention(sub):
            self._ig_branch = True
            try:
                attn = self.build_attention(i, layer, h)
            finally:
                self._ig_branch = False
            return [sub.add(attn, residual, name=f"layers.{i}.attn/residual"), ok + "/kept", ov + "/kept"]

        self._ig_outputs = [g.unique(f"layers.{i}.attn/out"), ok, ov]
        r, _, _ = self._ig_if(2 * i, f"layers.{i}.attn", attention, [residual, pk, pv])
        g.output(ok, self.ftype, ["batch_size", s.num_kv_heads, "total_sequence_length",
                                  self.key_head_dim(i)])
        g.output(ov, self.ftype, ["batch_size", s.num_kv_heads, "total_sequence_length", s.head_dim])
        h2, r = self.norm(r, None, self.norm_weight(f"model.layers.{i}.post_attention_layernorm.weight"),
                          f"layers.{i}.post_attention_norm")

        def mlp(sub):
            return [sub.add(self.build_mlp(i, layer, h2), r, name=f"layers.{i}.mlp/residual")]

        self._ig_outputs = [g.unique(f"layers.{i}.mlp/out")]
        (r,) = self._ig_if(2 * i + 1, f"layers.{i}.mlp", mlp, [r])
        if i + 1 == int(self.ig["embed_layer"]):
            self._ig_embedding = r
        last = i + 1 == s.num_layers
        w = self.norm_weight("model.norm.weight" if last else f"model.layers.{i + 1}.input_layernorm.weight")
        return self.norm(r, None, w, "final_norm" if last else f"layers.{i + 1}.input_norm")

    def build_extra_outputs(self) -> None:
        """``igprune_embedding float32 [B, H]``: the router's prompt embedding (after
        ``logits``)."""
        super().build_extra_outputs()
        g = self.g
        x = g.node("ReduceMean", [self._ig_embedding, g.const([1])], name="igprune/embedding",
                   keepdims=0)
        if self.fdtype != np.float32:
            x = g.cast(x, TensorProto.FLOAT)
        g.node("Identity", [x], outputs=[EMBEDDING_OUTPUT], name="igprune/embedding_out")
        g.output(EMBEDDING_OUTPUT, TensorProto.FLOAT, ["batch_size", self.spec.hidden_size])

    def variant_record(self) -> dict:
        """The ``edgeprune.json`` record: masks, the router (centroids, standardisation,
        depth, tokens) and the graph's I/O names."""
        d = self.ig
        arrays = d.get("arrays") or {}
        f = lambda k: np.asarray(arrays[k], np.float32).tolist()  # noqa: E731
        return {
            "method": d.get("method"), "paper": "IG-Pruning (Qiao, Zhang, Feng; EMNLP 2025)",
            "skip_ratio": float(d["skip_ratio"]), "masks": d["mask_array"].astype(int).tolist(),
            "sub_block_order": "2i: layer i attention, 2i+1: layer i MLP",
            "embed_layer": int(d["embed_layer"]), "route_tokens": int(d["route_tokens"]),
            "fingerprint": d["fingerprint"], "centroids": f("centroids"), "center": f("center"),
            "scale": f("scale"), "mask_input": MASK_INPUT, "embedding_output": EMBEDDING_OUTPUT,
            "graph": "plain" + (" (fused requested: switched, a bypassed layer's cache stays empty "
                                "only with the concatenated cache)"
                                if self.ig_requested_graph != "plain" else ""),
            "k": len(d["mask_array"]),
        }


__all__ = ["IgPruneMixin", "check_spec", "model_fingerprint", "MASK_INPUT", "EMBEDDING_OUTPUT"]
