"""Gemma 3 text decoders (``model_type`` ``gemma3_text``: Gemma 3 270M, 1B).

What differs from the llama blocks (transformers' ``Gemma3DecoderLayer``,
``Gemma3RMSNorm``, ``Gemma3TextScaledWordEmbedding``, ``Gemma3Attention``):

* RMSNorm scales by ``(1 + w)`` (computed in float32): the stored weight is ``1 + w`` in
  float32, cast to the graph's dtype afterwards;
* four norms per layer: ``input_layernorm`` (attention input), ``post_attention_layernorm``
  (attention output, before the residual add), ``pre_feedforward_layernorm`` (MLP input),
  ``post_feedforward_layernorm`` (MLP output, before the residual add);
* QK-norm: RMSNorm over ``head_dim`` on every query and key head, before rotary;
* GeGLU MLP: ``down(gelu_tanh(gate) * up)`` (``hidden_activation = gelu_pytorch_tanh``);
* the embedding is multiplied by ``sqrt(hidden_size)``, rounded to the embedding's dtype
  as the model does (``embed_scale.to(weight.dtype)``), the head stays the plain table;
* attention scale ``query_pre_attn_scalar ** -0.5``; the final logits soft-capped when the
  config says so (``final_logit_softcapping``); ``attn_logit_softcapping`` is ignored, as
  transformers' ``Gemma3Attention`` ignores it (Gemma 2 applied it; the attention module
  can, through ``spec.attn_softcap``);
* local sliding-window layers (``layer_types``, ``sliding_window``; 512 on 270M) with
  their own rotary base (``rope_parameters["sliding_attention"]``) beside global layers
  (``rope_parameters["full_attention"]``, with its scaling): the attention module builds
  both (``exporters.attention``), and the local layers' cache per ``local_kv``.
"""

from __future__ import annotations

import numpy as np

from edgeprune_runtime.errors import ExportError, UnsupportedArchitectureError

from ..decoder import DecoderBuilder
from ..attention import rope_limit
from ..linear import t2np

#: graph variants whose hooks know Gemma's blocks (LeanK's attention has no QK-norm or
#: window; COUNTDOWN's MLP is SiLU-gated)
GEMMA_VARIANTS = ("compact24",)


class Gemma3Builder(DecoderBuilder):
    """Gemma 3 text decoder (see the module docstring).

    Raises:
        ExportError: a graph variant that does not know Gemma's blocks.
    """

    has_qk_norm = True
    sliding_window_graph = True
    head_policy = ("int4 exports: one 8-bit table (RTN asym block 128) shared by the head and the "
                   "embedding (fused graphs gather its rows). Measured on Gemma 3 270M, WikiText-2 "
                   "test 8 x 512, no BOS, float32 body (ppl 68.075): shared 8-bit table -0.10 % "
                   "(166 MiB), shared 4-bit table (block 32) +16.7 % (103 MiB), float 640 MiB. "
                   "Float exports keep the float table, shared")
    fusable_rmsnorm = True        # 4 norms of 5 per layer have no residual (QK-norm too)

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse what the graph cannot reproduce.

        Raises:
            UnsupportedArchitectureError: an activation other than GELU-tanh, or
                bidirectional attention.
        """
        act = str(getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "?"))
        if act != "gelu_pytorch_tanh":
            raise UnsupportedArchitectureError(
                f"hidden_activation '{act}' cannot be exported (the Gemma 3 graph's MLP is "
                "GELU-tanh gated)", "export a Gemma 3 model as released (gelu_pytorch_tanh)")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedArchitectureError(
                "use_bidirectional_attention=True cannot be exported (the graph is causal)",
                "export a causal Gemma 3 text model")

    @classmethod
    def read_spec(cls, model, spec):
        """Layer types, the window, both rotary tables (with their scaling), the attention
        scale and the final soft-cap, read from the config and the model's rotary module."""
        cfg = model.config
        rot = model.model.rotary_emb
        rp = getattr(cfg, "rope_parameters", None) or {}
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        mpe = spec.max_position_embeddings
        spec.hidden_act = "gelu_pytorch_tanh"
        spec.layer_types = list(getattr(cfg, "layer_types", None) or
                                ["full_attention"] * spec.num_layers)
        if "sliding_attention" in spec.layer_types:
            spec.sliding_window = int(cfg.sliding_window)
            spec.local_inv_freq = t2np(rot.sliding_attention_inv_freq).astype(np.float64)
            spec.local_attention_scaling = float(rot.sliding_attention_attention_scaling)
            spec.local_rope_theta = float(local.get("rope_theta", 10000.0))
        if "full_attention" in spec.layer_types:
            spec.inv_freq = t2np(rot.full_attention_inv_freq).astype(np.float64)
            spec.attention_scaling = float(rot.full_attention_attention_scaling)
        spec.rope_theta = float(full.get("rope_theta", spec.rope_theta))
        spec.rope_scaling = {k: dict(v) for k, v in rp.items() if v} or None
        spec.attn_scale = float(cfg.query_pre_attn_scalar) ** -0.5
        spec.final_softcap = getattr(cfg, "final_logit_softcapping", None) or None
        limits = [lim for lim in (rope_limit(full, cfg, mpe), rope_limit(local, cfg, mpe)) if lim]
        spec.exact_positions = min(limits) if limits else None
        return spec

    def __init__(self, model, spec, opts):
        other = [n for n in opts.variants if n not in GEMMA_VARIANTS]
        if other:
            raise ExportError(f"graph variant {other[0]!r} cannot be applied to a Gemma 3 export: "
                              "its graph does not reproduce Gemma's QK-norm, GeGLU and "
                              "sliding-window layers",
                              f"export without it (variants available for gemma3: "
                              f"{', '.join(GEMMA_VARIANTS)})")
        super().__init__(model, spec, opts)
        emb = model.model.embed_tokens
        self.embed_scale = float(emb.embed_scale.to(emb.weight.dtype))

    # ------------------------------------------------------------------ hooks
    def norm_weight(self, name: str) -> np.ndarray:
        """``1 + w`` in float32 (``Gemma3RMSNorm`` scales by ``1 + w``)."""
        return (1.0 + self.param(name)).astype(np.float32)

    def build_embedding(self) -> str:
        """The base embedding (or the shared quantized table) times ``sqrt(hidden)``."""
        x = super().build_embedding()
        return self.g.mul(x, self.g.const(self.embed_scale, self.fdtype), name="embed_tokens/scale")

    def apply_qk_norm(self, i: int, q: str, k: str, name: str) -> tuple[str, str]:
        """RMSNorm over ``head_dim`` of every query and key head (``q_norm``, ``k_norm``)."""
        g, s = self.g, self.spec
        pre = f"model.layers.{i}.self_attn"
        out = []
        for x, heads, which in ((q, s.num_heads, "q_norm"), (k, s.num_kv_heads, "k_norm")):
            per_head = g.reshape(x, [0, 0, heads, s.head_dim], name=f"{name}/{which}_heads")
            normed, _ = self.norm(per_head, None, self.norm_weight(f"{pre}.{which}.weight"),
                                  f"{name}.{which}")
            out.append(g.reshape(normed, [0, 0, heads * s.head_dim]))
        return out[0], out[1]

    def mlp_activation(self, gate: str, name: str) -> str:
        """``gelu_pytorch_tanh``: ONNX ``Gelu`` with ``approximate="tanh"``."""
        return self.g.node("Gelu", [gate], name=name + "/gelu", approximate="tanh")

    def build_layer(self, i: int, layer, h: str, residual: str) -> tuple[str, str]:
        """Gemma 3 block: ``r += post_attn_norm(attn(h))``, ``r += post_ff_norm(mlp(
        pre_ff_norm(r)))``, then the next input norm of ``r``."""
        pre, name = f"model.layers.{i}.", f"layers.{i}."
        attn = self.build_attention(i, layer, h)
        attn, _ = self.norm(attn, None, self.norm_weight(pre + "post_attention_layernorm.weight"),
                            name + "post_attention_norm")
        h, residual = self.norm(attn, residual,
                                self.norm_weight(pre + "pre_feedforward_layernorm.weight"),
                                name + "pre_feedforward_norm")
        mlp = self.build_mlp(i, layer, h)
        mlp, _ = self.norm(mlp, None, self.norm_weight(pre + "post_feedforward_layernorm.weight"),
                           name + "post_feedforward_norm")
        return self.next_norm(i, mlp, residual)

    def build_lm_head(self, h: str) -> str:
        """The base head, then ``cap * tanh(logits / cap)`` when the config soft-caps."""
        logits = super().build_lm_head(h)
        cap = self.spec.final_softcap
        if cap:
            g = self.g
            t = g.node("Tanh", [g.mul(logits, g.const(1.0 / cap, self.fdtype))], name="logits/softcap")
            logits = g.mul(t, g.const(cap, self.fdtype), name="logits/softcap_scale")
        return logits


__all__ = ["Gemma3Builder", "GEMMA_VARIANTS"]
