"""Decoder-only transformer -> ONNX graph, built from the weights with ``onnx.helper``.

One :class:`DecoderBuilder` writes the whole graph (embedding, layers, final norm,
``lm_head``) from four parts, one concern each: linears (``exporters.linear``), attention
(``exporters.attention``), the MLP (``exporters.mlp``), embedding and head
(``exporters.embedding``); this module holds the options, the graph's inputs and outputs,
the norms and the layer loop. Families subclass it in ``exporters.families`` and override
only what differs (``LlamaBuilder``; ``Qwen2Builder`` adds q/k/v biases;
``Gemma3Builder``: (1 + w) norms, four per layer, QK-norm, GeGLU, a scaled embedding,
sliding-window layers), the way onnxruntime-genai's builders subclass a base ``Model``
and override ``make_attention`` / ``make_mlp``. Graph variants are builder mixins
(``exporters.variants``) that override the public hooks listed in
:class:`DecoderBuilder`'s docstring: LeanK key channel pruning (``build_inputs``,
``key_head_dim``, ``build_attention``...), COUNTDOWN sparse MLP (``build_mlp``,
``build_extra_outputs``), compact 2:4 (``float_matmul``).

Two graph kinds share every block except attention and normalization:

* ``graph="fused"``: ONNX Runtime contrib ops. ``GroupQueryAttention`` with rotary inside
  (``do_rotary``, cos/sin caches sized ``max_length``) and a KV cache shared between
  ``past_key_values.*`` and ``present.*`` (one preallocated ``[B, kv_heads, max_length,
  head_dim]`` buffer per tensor, bound with IOBinding), ``SkipSimplifiedLayerNormalization``
  (residual add + RMSNorm in one op), ``MatMulNBits`` for int4/int8 weights with fused
  QKV and gate/up projections. Inputs: ``input_ids int64 [B, S]``, ``seqlens_k int32
  [B]`` (tokens in the cache after this step, minus one), ``total_sequence_length int32
  []``, ``num_logits_to_keep int64 []``.
* ``graph="plain"``: standard ONNX opset 21 only: concatenated KV cache
  (``present`` = ``past`` + new), explicit attention mask and ``position_ids``,
  int4 through blocked ``DequantizeLinear``. Inputs: ``input_ids``, ``attention_mask
  int64 [B, past+S]``, ``position_ids int64 [B, S]``, ``num_logits_to_keep``.

Sliding-window layers change their cache with ``local_kv`` (``exporters.attention``).
Output ``logits float32 [B, num_logits_to_keep, vocab]`` (the last positions).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from onnx import TensorProto

from edgeprune_runtime.errors import ExportError, UnsupportedArchitectureError

from .attention import AttentionMixin
from .embedding import EmbeddingHeadMixin
from .graph import MS_DOMAIN, GraphBuilder, onnx_dtype
from .int4 import DEFAULT_GROUP_SIZE, IntWeight
from .linear import LinearMixin, accuracy_level_for, name_ends_with
from .mlp import MlpMixin


@dataclass
class BuildOptions:
    """What the builder makes (see ``exporters.export_onnx`` for the meaning)."""

    precision: str = "fp32"            # fp32 | fp16 | int4
    graph: str = "fused"               # fused | plain
    lm_head: Optional[str] = None      # fp | q8 | int4; None: the builder's default_lm_head()
    accuracy_level: int = 4
    # per-linear overrides: {"down_proj": 0} = MatMulNBits nodes whose name ends with it
    accuracy_levels: dict = field(default_factory=dict)
    max_length: int = 2048
    group_size: int = DEFAULT_GROUP_SIZE   # RTN group size when int4 without `quantized`
    quantized: dict = field(default_factory=dict)
    #: ``{variant name: spec dict}`` read by the variant mixins (``exporters.variants``)
    variants: dict = field(default_factory=dict)
    #: an untied embedding table: ``fp`` | ``q8`` | ``int4``; None: the builder's default_embedding()
    embedding: Optional[str] = None
    #: cache of sliding-window layers: ``full`` | ``ring`` (``exporters.attention``);
    #: ``None``: ``ring`` on plain graphs, ``full`` on fused ones
    local_kv: Optional[str] = None


class DecoderBuilder(AttentionMixin, MlpMixin, EmbeddingHeadMixin, LinearMixin):
    """Builds the ONNX decoder graph of one model (base: llama-style blocks).

    Hooks a family subclass or a variant mixin (``exporters.variants``) may override,
    each calling ``super()`` for what it does not change:

    * graph: ``build_inputs()``, ``key_head_dim(i)``, ``build_layer(i, layer, h,
      residual)`` (one block), ``build_attention(i, layer, h)``, ``apply_qk_norm(i, q, k,
      name)``, ``cache_type(i)`` / ``gqa_cache_options(i)`` (the KV cache's element type and
      ``GroupQueryAttention``'s extra inputs and attributes for it, ``exporters.kvcache``), ``build_mlp(i, layer, h)``, ``mlp_activation(gate, name)``,
      ``build_embedding()``, ``build_lm_head(h)`` (returns the logits tensor before it
      is named the output), ``build_extra_outputs()`` (outputs after ``logits``),
      ``norm_weight(name)`` (a norm's stored weight), ``float_matmul(x, W, name,
      module_names)`` (how a float linear is stored);
    * config: ``check_config(cfg)``, ``read_spec(model, spec)`` (class methods run by
      :meth:`~exporters.spec.DecoderSpec.from_model`), ``sliding_window_graph``;
    * export: ``default_lm_head()``, ``io_metadata()`` (``kv_layout`` of
      ``edgeprune.json``), ``shares_kv_buffer`` (``genai_config.json``), ``genai_loadable``
      (onnxruntime-genai's inputs are added and ``genai_config.json`` written),
      ``parity_tokens(n)`` (the validation window), and the attributes
      ``logits_match_model`` (the logits stand for the given torch model; validation
      checks them; when not, ``logits_differ_because`` says why, for the summary),
      ``approximate_logits`` (they match it only up to rounding) and
      ``sparsity_info`` (the ``sparsity`` record of a verified pattern).

    Args:
        model: HF causal LM (weights already the dense equivalent of the checkpoint).
        spec: :class:`~exporters.spec.DecoderSpec` of ``model``.
        opts: :class:`BuildOptions` (``lm_head=None`` is set to :meth:`default_lm_head`,
            ``local_kv=None`` to the graph kind's default).

    Raises:
        ExportError: unknown graph, precision, lm_head or local_kv.
    """

    qkv_bias = False
    logits_match_model = True
    logits_differ_because = "the graph's logits differ by design"

    #: the graph builds sliding-window layers (else a sliding config limits max_length)
    sliding_window_graph = False
    #: a norm without residual squares with ``Pow`` (onnxruntime then fuses the pattern
    #: into one ``SimplifiedLayerNormalization``; ``x * x`` is left as 6 nodes)
    fusable_rmsnorm = False

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse a config the family's graph cannot reproduce, before any reading.

        Raises:
            UnsupportedArchitectureError: ``hidden_act`` is not SiLU (llama/qwen2 graphs
                are SiLU-gated).
        """
        act = str(getattr(cfg, "hidden_act", "silu"))
        if act not in ("silu", "swish"):
            raise UnsupportedArchitectureError(
                f"hidden_act '{act}' cannot be exported (the graph's MLP is SiLU-gated)",
                "export a model whose config has hidden_act 'silu' (llama/qwen2 as released)")

    @classmethod
    def read_spec(cls, model, spec):
        """Complete ``spec`` (a :class:`~exporters.spec.DecoderSpec` read from the
        config's common fields) with what only the family knows; returns it."""
        return spec

    def __init__(self, model, spec, opts: BuildOptions):
        if opts.graph not in ("fused", "plain"):
            raise ExportError(f"graph='{opts.graph}' is unknown", "use 'fused' or 'plain'")
        if opts.precision not in ("fp32", "fp16", "int4"):
            raise ExportError(f"precision='{opts.precision}' is unknown",
                              "use fp32, fp16 or int4")
        self.model = model
        self.spec = spec
        self.opts = opts
        if opts.lm_head is None:
            opts.lm_head = self.default_lm_head()
        if opts.lm_head not in ("fp", "q8", "int4"):
            raise ExportError(f"lm_head='{opts.lm_head}' is unknown", "use fp, q8 or int4")
        if opts.embedding not in (None, "fp", "q8", "int4"):
            raise ExportError(f"embedding='{opts.embedding}' is unknown", "use fp, q8 or int4")
        if opts.local_kv is None:
            # plain graphs run a windowed cache as they are; the fused ring needs the
            # runtime's ring bookkeeping (runtime.kv_cache.RingKVCache)
            opts.local_kv = "ring" if opts.graph == "plain" else "full"
        if opts.local_kv not in ("full", "ring"):
            raise ExportError(f"local_kv='{opts.local_kv}' is unknown", "use 'full' or 'ring'")
        self.approximate_logits = opts.precision == "fp16"
        self.sparsity_info: Optional[dict] = None
        self.fdtype = np.float16 if opts.precision == "fp16" else np.float32
        self.ftype = onnx_dtype(self.fdtype)
        self.g = GraphBuilder("decoder", self.fdtype)
        self.fused = opts.graph == "fused"
        self.modules = dict(model.named_modules())
        self.quant_summary: dict[str, str] = {}
        self._perm_cache: dict[tuple, str] = {}
        self._rope = None
        self._local = None
        self._ring = None
        self.int_weights: dict[str, IntWeight] = {}
        self.accuracy_names: set[str] = set()     # MatMulNBits nodes built (override check)


    # --------------------------------------------------------------- export
    @property
    def shares_kv_buffer(self) -> bool:
        """Whether ``past_key_values.*`` and ``present.*`` share one buffer
        (``genai_config.json``'s ``past_present_share_buffer``)."""
        return self.fused

    @property
    def genai_loadable(self) -> bool:
        """Whether onnxruntime-genai can run the graph once ``exporters.genai`` gave it the
        inputs that tool feeds: standard caches (``past_key_values.%d.*`` in,
        ``present.%d.*`` out, one length axis); not a sliding-window ring (its cache is
        the runtime's ``RingKVCache`` bookkeeping, or the last ``window`` rows only)."""
        return not any(self.ring_layer(i) for i in range(self.spec.num_layers))

    def parity_tokens(self, tokens: int) -> int:
        """Window length of the export's parity check, given the requested ``tokens``
        (a variant whose graph equals the model only on a prefix shortens it)."""
        return tokens

    # ------------------------------------------------------------------ I/O
    def kv_names(self, i: int) -> tuple[str, str, str, str]:
        """(past key, past value, present key, present value) names of layer ``i``."""
        return (f"past_key_values.{i}.key", f"past_key_values.{i}.value",
                f"present.{i}.key", f"present.{i}.value")

    def key_head_dim(self, i: int) -> int:
        """Channels per key head stored in layer ``i``'s cache (LeanK may shrink it)."""
        return self.spec.head_dim

    def build_inputs(self):
        """Declare the graph inputs (ids, positions, the per-layer KV cache)."""
        g, s = self.g, self.spec
        g.input("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
        if self.fused:
            g.input("seqlens_k", TensorProto.INT32, ["batch_size"])
            g.input("total_sequence_length", TensorProto.INT32, [])
            past = "max_length"
        else:
            g.input("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])
            g.input("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
            past = "past_sequence_length"
        g.input("num_logits_to_keep", TensorProto.INT64, [])
        pres = "max_length" if self.fused else "total_sequence_length"
        for i in range(s.num_layers):
            pk, pv, ok, ov = self.kv_names(i)
            length = self.past_length_dim(i, past)
            g.input(pk, self.cache_type(i), ["batch_size", s.num_kv_heads, length, self.key_head_dim(i)])
            g.input(pv, self.cache_type(i), ["batch_size", s.num_kv_heads, length, s.head_dim])
        self._present_shape = pres

    def io_metadata(self) -> dict:
        """Names and shapes of the graph's inputs/outputs for ``edgeprune.json``."""
        s = self.spec
        past = "max_length" if self.fused else "past_sequence_length"
        pres = self._present_shape
        return {
            "inputs": ["input_ids"] + (["seqlens_k", "total_sequence_length"] if self.fused
                                       else ["attention_mask", "position_ids"])
            + ["num_logits_to_keep"],
            "past_key": {"name": "past_key_values.%d.key",
                         "shape": ["batch_size", s.num_kv_heads, past, "key_head_dim"],
                         "key_head_dim": [self.key_head_dim(i) for i in range(s.num_layers)]},
            "past_value": {"name": "past_key_values.%d.value",
                           "shape": ["batch_size", s.num_kv_heads, past, s.head_dim]},
            "present_key": {"name": "present.%d.key",
                            "shape": ["batch_size", s.num_kv_heads, pres, "key_head_dim"]},
            "present_value": {"name": "present.%d.value",
                              "shape": ["batch_size", s.num_kv_heads, pres, s.head_dim]},
            "logits": {"name": "logits",
                       "shape": ["batch_size", "num_logits_to_keep", s.vocab_size]},
            **self._window_metadata(),
        }

    def _window_metadata(self) -> dict:
        """``{"sliding_window": {...}}`` when the model has sliding-window layers: the
        window, the layers, their cache (``opts.local_kv``) and its length axis."""
        s = self.spec
        if not s.sliding_layers:
            return {}
        ring = self.opts.local_kv == "ring"
        return {"sliding_window": {
            "window": int(s.sliding_window), "layers": s.sliding_layers, "cache": self.opts.local_kv,
            "past_length": self.past_length_dim(s.sliding_layers[0], "max_length" if self.fused
                                                else "past_sequence_length"),
            "present": ("new rows [batch, kv_heads, sequence_length, head_dim]: the runtime "
                        "writes row s of a pass into ring slot (position mod window)")
            if ring and self.fused else "the last `window` positions of past ++ new" if ring
            else "as the other layers",
        }}

    # ---------------------------------------------------------------- graph
    def norm_weight(self, name: str) -> np.ndarray:
        """The stored weight of the RMSNorm parameter ``name`` (``float32``; Gemma's
        ``(1 + w)`` norms override it)."""
        return self.param(name)

    def norm(self, x: str, residual: Optional[str], weight: np.ndarray, name: str):
        """RMSNorm of ``x + residual`` -> ``(normed, new residual)``.

        ``y = x / sqrt(mean(x^2) + eps) * weight`` (Zhang & Sennrich 2019, as in
        LlamaRMSNorm). Fused: ``SkipSimplifiedLayerNormalization`` (its 4th output is
        the sum); plain, or without ``residual``: ``Add`` + decomposed RMSNorm (squared
        with ``Pow`` when ``fusable_rmsnorm``, which onnxruntime fuses back into one op).
        """
        g = self.g
        w = g.initializer(name + ".weight", weight.astype(self.fdtype))
        eps = self.spec.rms_norm_eps
        if residual is not None:
            if self.fused:
                # the mean and inverse-deviation outputs left unnamed: the kernel then
                # neither allocates nor writes them
                out, _, _, s = g.node("SkipSimplifiedLayerNormalization", [x, residual, w], n_out=4,
                                      outputs=[g.unique(name + "/out"), "", "", g.unique(name + "/sum")],
                                      name=name, domain=MS_DOMAIN, epsilon=eps)
                return out, s
            x = g.add(x, residual, name=name + "/residual")
        xf = g.cast(x, TensorProto.FLOAT) if self.fdtype != np.float32 else x
        sq = g.node("Pow", [xf, g.const(2.0, np.float32)]) if self.fusable_rmsnorm else g.mul(xf, xf)
        var = g.node("ReduceMean", [sq, g.const([-1])], name=name + "/var", keepdims=1)
        rs = g.node("Sqrt", [g.add(var, g.const(eps, np.float32))])
        y = g.div(xf, rs, name=name + "/normalize")
        if self.fdtype != np.float32:
            y = g.cast(y, self.ftype)
        return g.mul(y, w, name=name), x

    def build(self):
        """Build the graph; returns the ``onnx.ModelProto``."""
        self.build_inputs()
        x = self.build_embedding()
        h, residual = self.norm(x, None, self.norm_weight("model.layers.0.input_layernorm.weight"),
                                "layers.0.input_norm")
        for i, layer in enumerate(self.model.model.layers):
            h, residual = self.build_layer(i, layer, h, residual)
        self._output_logits(self.build_lm_head(h))
        self.build_extra_outputs()
        return self.g.model()

    def build_layer(self, i: int, layer, h: str, residual: str) -> tuple[str, str]:
        """Decoder block ``i`` on its normed input ``h`` (and the residual stream) ->
        ``(the next block's normed input, the residual)``: attention, add + norm, MLP,
        add + the next norm (llama: ``post_attention_layernorm`` is the MLP's input norm)."""
        attn = self.build_attention(i, layer, h)
        h, residual = self.norm(attn, residual,
                                self.norm_weight(f"model.layers.{i}.post_attention_layernorm.weight"),
                                f"layers.{i}.post_attention_norm")
        return self.next_norm(i, self.build_mlp(i, layer, h), residual)

    def next_norm(self, i: int, x: str, residual: str) -> tuple[str, str]:
        """``x + residual`` through layer ``i + 1``'s input norm (the final norm after the
        last layer)."""
        last = i + 1 == self.spec.num_layers
        w = self.norm_weight("model.norm.weight" if last else
                             f"model.layers.{i + 1}.input_layernorm.weight")
        return self.norm(x, residual, w, "final_norm" if last else f"layers.{i + 1}.input_norm")

    @contextlib.contextmanager
    def building_into(self, sub: GraphBuilder):
        """Within the block, the builder's helpers (``linear``, ``int_matmul``...) add
        their nodes to ``sub`` (e.g. an ``If`` branch) instead of the main graph."""
        saved, self.g = self.g, sub
        try:
            yield sub
        finally:
            self.g = saved

    def build_extra_outputs(self) -> None:
        """Graph outputs after ``logits`` (none in the base graph)."""



__all__ = ["BuildOptions", "DecoderBuilder", "accuracy_level_for", "name_ends_with"]
