"""Decoder-only transformer -> ONNX graph, built from the weights with ``onnx.helper``.

One :class:`DecoderBuilder` writes the whole graph (embedding, layers, final norm,
``lm_head``); architectures subclass it and override only what differs
(:class:`LlamaBuilder`, :class:`Qwen2Builder` adds q/k/v biases). Graph variants are
builder mixins (``exporters.variants``) that override the public hooks listed in
:class:`DecoderBuilder`'s docstring (the way onnxruntime-genai's builders subclass a base
``Model`` and override ``make_attention`` / ``make_mlp``): LeanK key channel pruning
(``build_inputs``, ``key_head_dim``, ``build_attention``...), COUNTDOWN sparse MLP
(``build_mlp``, ``build_extra_outputs``), compact 2:4 (``float_matmul``).

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

Output ``logits float32 [B, num_logits_to_keep, vocab]`` (the last positions).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from onnx import TensorProto

from runtime.errors import ExportError, UnsupportedArchitectureError

from .graph import MS_DOMAIN, GraphBuilder, onnx_dtype
from .int4 import (DEFAULT_GROUP_SIZE, IntWeight, can_fuse, concat_n, default_zero_points,
                   from_quantized, pack_matmulnbits, pack_uint4, q8_head_block, rtn_int)


def _t2np(t) -> np.ndarray:
    return t.detach().cpu().float().numpy()


@dataclass
class DecoderSpec:
    """Shapes and settings of a decoder read from an HF model's config."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    inv_freq: np.ndarray = field(repr=False, default=None)
    attention_scaling: float = 1.0
    rope_scaling: Optional[dict] = None
    #: ``(positions, why)``: the graph (static rotary tables, full attention) equals the
    #: model only up to that many positions; ``None``: no such limit
    exact_positions: Optional[tuple] = None

    @classmethod
    def from_model(cls, model) -> "DecoderSpec":
        """Read the spec from a transformers ``*ForCausalLM`` model.

        Raises:
            UnsupportedArchitectureError: not a llama/qwen2-style decoder.
        """
        cfg = model.config
        arch = getattr(cfg, "model_type", "?")
        if arch not in BUILDERS:
            raise UnsupportedArchitectureError(
                f"architecture '{arch}' cannot be exported",
                f"supported: {', '.join(sorted(BUILDERS))}")
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
            raise UnsupportedArchitectureError(f"model of type {type(model).__name__} has no "
                                               "model.layers / model.embed_tokens",
                                               "pass a *ForCausalLM decoder")
        act = str(getattr(cfg, "hidden_act", "silu"))
        if act not in ("silu", "swish"):
            raise UnsupportedArchitectureError(
                f"hidden_act '{act}' cannot be exported (the graph's MLP is SiLU-gated)",
                "export a model whose config has hidden_act 'silu' (llama/qwen2 as released)")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rot = getattr(inner, "rotary_emb", None)
        if rot is not None and hasattr(rot, "inv_freq"):
            inv_freq = _t2np(rot.inv_freq).astype(np.float64)
            scaling = float(getattr(rot, "attention_scaling", 1.0))
        else:
            theta = float(getattr(cfg, "rope_theta", 10000.0))
            inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
            scaling = 1.0
        rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) or 10000.0)
        mpe = int(getattr(cfg, "max_position_embeddings", 2048))
        # static tables are exact only while the model's own attention is: rope types whose
        # frequencies change with the sequence length, and sliding-window layers
        exact = []
        rtype = rp.get("rope_type", rp.get("type"))
        if rtype in ("dynamic", "longrope"):
            orig = rp.get("original_max_position_embeddings") or \
                getattr(cfg, "original_max_position_embeddings", None) or mpe
            exact.append((int(orig), f"rope_type '{rtype}' changes its frequencies past {int(orig)} "
                                     "positions"))
        types = getattr(cfg, "layer_types", None) or []
        window = getattr(cfg, "sliding_window", None)
        if window and ("sliding_attention" in types or (not types and getattr(cfg, "use_sliding_window", False))):
            exact.append((int(window), f"sliding-window attention (sliding_window={int(window)}) "
                                       "differs from full attention past the window"))
        return cls(architecture=arch, num_layers=cfg.num_hidden_layers,
                   hidden_size=cfg.hidden_size, num_heads=heads,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=head_dim, intermediate_size=cfg.intermediate_size,
                   vocab_size=cfg.vocab_size, rms_norm_eps=float(cfg.rms_norm_eps),
                   rope_theta=theta,
                   max_position_embeddings=mpe,
                   tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                   attention_bias=bool(getattr(cfg, "attention_bias", False)) or arch == "qwen2",
                   inv_freq=inv_freq, attention_scaling=scaling,
                   rope_scaling=dict(rp) if rp else None,
                   exact_positions=min(exact) if exact else None)


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


class DecoderBuilder:
    """Builds the ONNX decoder graph of one model (base: llama-style blocks).

    Hooks a variant mixin (``exporters.variants``) may override, each calling ``super()``
    for what it does not change:

    * graph: ``build_inputs()``, ``key_head_dim(i)``, ``build_attention(i, layer, h)``,
      ``build_mlp(i, layer, h)``, ``build_lm_head(h)`` (returns the logits tensor before
      it is named the output), ``build_extra_outputs()`` (outputs after ``logits``),
      ``float_matmul(x, W, name, module_names)`` (how a float linear is stored);
    * export: ``default_lm_head()``, ``io_metadata()`` (``kv_layout`` of
      ``edgeprune.json``), ``shares_kv_buffer`` (``genai_config.json``),
      ``parity_tokens(n)`` (the validation window), and the attributes
      ``logits_match_model`` (the logits stand for the given torch model; validation
      checks them), ``approximate_logits`` (they match it only up to rounding) and
      ``sparsity_info`` (the ``sparsity`` record of a verified pattern).

    Args:
        model: HF causal LM (weights already the dense equivalent of the checkpoint).
        spec: :class:`DecoderSpec` of ``model``.
        opts: :class:`BuildOptions` (``lm_head=None`` is set to :meth:`default_lm_head`).

    Raises:
        ExportError: unknown graph, precision or lm_head.
    """

    qkv_bias = False
    logits_match_model = True

    def __init__(self, model, spec: DecoderSpec, opts: BuildOptions):
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
        self.int_weights: dict[str, IntWeight] = {}
        self.accuracy_names: set[str] = set()     # MatMulNBits nodes built (override check)

    # --------------------------------------------------------------- export
    def default_lm_head(self) -> str:
        """The ``lm_head`` mode when the export does not name one: ``q8`` for int4
        exports (small-model quality at 8-bit cost), ``fp`` otherwise."""
        return "q8" if self.opts.precision == "int4" else "fp"

    @property
    def shares_kv_buffer(self) -> bool:
        """Whether ``past_key_values.*`` and ``present.*`` share one buffer
        (``genai_config.json``'s ``past_present_share_buffer``)."""
        return self.fused

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
            g.input(pk, self.ftype, ["batch_size", s.num_kv_heads, past, self.key_head_dim(i)])
            g.input(pv, self.ftype, ["batch_size", s.num_kv_heads, past, s.head_dim])
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
        }

    # -------------------------------------------------------------- weights
    def param(self, name: str) -> np.ndarray:
        """Parameter ``name`` of the model as ``float32`` numpy."""
        return _t2np(self.model.get_parameter(name))

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
                   g.initializer(name + ".scales", sc.astype(self.fdtype))]
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

    # ---------------------------------------------------------------- graph
    def build(self):
        """Build the graph; returns the ``onnx.ModelProto``."""
        s = self.spec
        self.build_inputs()
        x = self.build_embedding()
        layers = self.model.model.layers
        h, residual = self.norm(x, None, self.param("model.layers.0.input_layernorm.weight"),
                                "layers.0.input_norm")
        for i, layer in enumerate(layers):
            attn = self.build_attention(i, layer, h)
            h, residual = self.norm(attn, residual,
                                    self.param(f"model.layers.{i}.post_attention_layernorm.weight"),
                                    f"layers.{i}.post_attention_norm")
            mlp = self.build_mlp(i, layer, h)
            nxt = (f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < s.num_layers
                   else "model.norm.weight")
            h, residual = self.norm(mlp, residual, self.param(nxt),
                                    f"layers.{i + 1}.input_norm" if i + 1 < s.num_layers
                                    else "final_norm")
        self._output_logits(self.build_lm_head(h))
        self.build_extra_outputs()
        return self.g.model()

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

    def _output_logits(self, x: str) -> None:
        """Name ``x`` the ``logits float32 [B, num_logits_to_keep, vocab]`` output."""
        g = self.g
        if self.fdtype != np.float32:
            x = g.cast(x, TensorProto.FLOAT)
        node = next(n for n in reversed(g.nodes) if x in n.output)
        node.output[list(node.output).index(x)] = "logits"
        g.output("logits", TensorProto.FLOAT, ["batch_size", "num_logits_to_keep",
                                               self.spec.vocab_size])

    def build_embedding(self) -> str:
        """``input_ids [B,S]`` -> hidden ``[B,S,H]`` (q8 table shared with the head when tied)."""
        g, s = self.g, self.spec
        self._head_int = None
        head_mode = self.opts.lm_head
        tied = s.tie_word_embeddings
        if head_mode in ("q8", "int4"):
            q = self.opts.quantized.get("lm_head")
            if q is not None:
                self._head_int = from_quantized(q, "lm_head")
            else:
                w = self.param("lm_head.weight") if not tied else \
                    self.param("model.embed_tokens.weight")
                # 8-bit: the largest block in (128, 64, 32) dividing K (fewer scale bytes
                # read per token, no measurable quality change); int4 head: block 32.
                # Both asymmetric: a symmetric q8 head matches it in PyTorch (WikiText-2
                # 40x512, only the tied table quantized: 28.719 vs 28.718, dense 28.738)
                # and its matmul is ~5% faster, but through the int8-activation kernel it
                # cost more (compact 2:4 export +0.57% vs +0.36% over PyTorch)
                bs = q8_head_block(w.shape[1]) if head_mode == "q8" else 32
                self._head_int = rtn_int(w, 8 if head_mode == "q8" else 4, bs)
        if self._head_int is not None:
            self.int_weights["lm_head" if not tied else "model.embed_tokens"] = self._head_int
        if tied and self._head_int is not None and self._head_int.perm is None and self.fused:
            # Share the quantized table: gather rows of codes, dequantize in the graph.
            w = self._head_int
            B, sc, zp = pack_matmulnbits(w)
            self._head_tensors = (g.initializer("lm_head.qweight", B),
                                  g.initializer("lm_head.scales", sc.astype(self.fdtype)),
                                  None if default_zero_points(w) else
                                  g.initializer("lm_head.qzeros", zp))
            return self._gather_quantized(w)
        if tied and self._head_int is not None:
            # the head is quantized and tied: the embedding reads the same (dequantized)
            # table, as the model the export stands for does (plain graphs, or a table with
            # an act-order permutation; it used to be the float table beside a quantized head)
            emb = np.asarray(self._head_int.dequantize(original_order=True), np.float32).astype(self.fdtype)
        else:
            emb = self.param("model.embed_tokens.weight").astype(self.fdtype)
        self._emb_name = g.initializer("model.embed_tokens.weight", emb)
        self._head_tensors = None
        return g.gather(self._emb_name, "input_ids", name="embed_tokens")

    def _gather_quantized(self, w: IntWeight) -> str:
        """Embedding rows from the packed head table: ``(code - zero) * scale``."""
        g, s = self.g, self.spec
        qB, qs, qz = self._head_tensors
        nb, bs = w.n_blocks, w.block_size
        rows = g.gather(qB, "input_ids", name="embed_tokens")               # [B,S,nb,blob]
        if w.bits == 4:
            lo = g.node("BitwiseAnd", [rows, g.const(15, np.uint8)], name="embed_tokens/lo")
            hi = g.node("BitShift", [rows, g.const(4, np.uint8)], name="embed_tokens/hi",
                        direction="RIGHT")
            st = g.concat([g.unsqueeze(lo, [-1]), g.unsqueeze(hi, [-1])], axis=-1)
            rows = g.reshape(st, [0, 0, nb, bs])
        codes = g.cast(rows, self.ftype)
        scales = g.reshape(qs, [s.vocab_size, nb, 1])
        sc = g.gather(scales, "input_ids", name="embed_tokens/scales")      # [B,S,nb,1]
        if qz is None:                      # symmetric grid: one zero point for all
            zz = g.const(2 ** (w.bits - 1), self.fdtype)
        elif w.bits == 4:                   # packed 4-bit zero points: gather float copies
            zfull = np.ascontiguousarray(w.zeros.astype(self.fdtype)[..., None])
            zz = g.gather(g.initializer("embed_tokens.zeros", zfull), "input_ids")
        else:
            zz = g.cast(g.unsqueeze(g.gather(g.reshape(qz, [s.vocab_size, nb]), "input_ids"),
                                    [-1]), self.ftype)
        deq = g.mul(g.sub(codes, zz), sc, name="embed_tokens/dequant")
        deq = g.reshape(deq, [0, 0, nb * bs])
        if nb * bs != s.hidden_size:
            deq = g.slice(deq, [0], [s.hidden_size], [2])
        return deq

    def norm(self, x: str, residual: Optional[str], weight: np.ndarray, name: str):
        """RMSNorm of ``x + residual`` -> ``(normed, new residual)``.

        ``y = x / sqrt(mean(x^2) + eps) * weight`` (Zhang & Sennrich 2019, as in
        LlamaRMSNorm). Fused: ``SkipSimplifiedLayerNormalization`` (its 4th output is
        the sum); plain: ``Add`` + decomposed RMSNorm.
        """
        g = self.g
        w = g.initializer(name + ".weight", weight.astype(self.fdtype))
        eps = self.spec.rms_norm_eps
        if residual is not None:
            if self.fused:
                out, _, _, s = g.node("SkipSimplifiedLayerNormalization", [x, residual, w],
                                      n_out=4, name=name, domain=MS_DOMAIN, epsilon=eps)
                return out, s
            x = g.add(x, residual, name=name + "/residual")
        xf = g.cast(x, TensorProto.FLOAT) if self.fdtype != np.float32 else x
        var = g.node("ReduceMean", [g.mul(xf, xf), g.const([-1])], name=name + "/var",
                     keepdims=1)
        rs = g.node("Sqrt", [g.add(var, g.const(eps, np.float32))])
        y = g.div(xf, rs, name=name + "/normalize")
        if self.fdtype != np.float32:
            y = g.cast(y, self.ftype)
        return g.mul(y, w, name=name), x

    def rope_tables(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``cos, sin float [length, head_dim/2]`` with the model's inv_freq (+ scaling)."""
        t = np.arange(length, dtype=np.float64)[:, None] * self.spec.inv_freq[None, :]
        a = self.spec.attention_scaling
        return (np.cos(t) * a).astype(self.fdtype), (np.sin(t) * a).astype(self.fdtype)

    def build_attention(self, i: int, layer, h: str) -> str:
        """Self-attention of layer ``i`` on normed hidden ``h [B,S,H]`` -> ``[B,S,H]``."""
        pre = f"model.layers.{i}.self_attn"
        name = f"layers.{i}.attn"
        qkv = [f"{pre}.q_proj", f"{pre}.k_proj", f"{pre}.v_proj"]
        if self.fused:
            packed = self.linear(h, qkv, name + ".qkv_proj")
            attn = self.gqa(i, packed, "", "", name)
        else:
            q = self.linear(h, qkv[:1], name + ".q_proj", )
            k = self.linear(h, qkv[1:2], name + ".k_proj", )
            v = self.linear(h, qkv[2:], name + ".v_proj", )
            attn = self.plain_attention(i, q, k, v, name)
        return self.linear(attn, [f"{pre}.o_proj"], name + ".o_proj")

    def gqa(self, i: int, q: str, k: str, v: str, name: str) -> str:
        """``GroupQueryAttention`` with rotary and the shared KV buffer of layer ``i``."""
        g, s = self.g, self.spec
        if self._rope is None:
            cos, sin = self.rope_tables(self.opts.max_length)
            self._rope = (g.initializer("cos_cache", cos), g.initializer("sin_cache", sin))
        pk, pv, ok, ov = self.kv_names(i)
        out = g.node("GroupQueryAttention",
                     [q, k, v, pk, pv, "seqlens_k", "total_sequence_length", *self._rope],
                     n_out=3, name=name, domain=MS_DOMAIN,
                     outputs=[g.unique(name + "/out"), ok, ov],
                     num_heads=s.num_heads, kv_num_heads=s.num_kv_heads, do_rotary=1,
                     rotary_interleaved=0, scale=1.0 / math.sqrt(s.head_dim))
        g.output(ok, self.ftype, ["batch_size", s.num_kv_heads, "max_length", self.key_head_dim(i)])
        g.output(ov, self.ftype, ["batch_size", s.num_kv_heads, "max_length", s.head_dim])
        return out[0]

    def _plain_rope_and_mask(self):
        g, s = self.g, self.spec
        cos, sin = self.rope_tables(self.opts.max_length)
        cos = np.concatenate([cos, cos], -1)
        sin = np.concatenate([sin, sin], -1)
        c = g.gather(g.initializer("cos_cache", cos), "position_ids", name="rope/cos")
        sn = g.gather(g.initializer("sin_cache", sin), "position_ids", name="rope/sin")
        c, sn = g.unsqueeze(c, [1]), g.unsqueeze(sn, [1])                   # [B,1,S,D]
        # additive mask [B,1,S,T]: key valid and key index <= past + query index
        T = g.shape("attention_mask", 1, 2, name="mask/T")
        S = g.shape("input_ids", 1, 2, name="mask/S")
        P = g.sub(T, S, name="mask/P")
        sq = lambda t: g.squeeze(t, [0])  # noqa: E731
        qpos = g.node("Range", [sq(P), sq(T), g.const(1)], name="mask/qpos")
        kpos = g.node("Range", [g.const(0), sq(T), g.const(1)], name="mask/kpos")
        causal = g.node("LessOrEqual", [g.unsqueeze(kpos, [0]), g.unsqueeze(qpos, [1])],
                        name="mask/causal")                                 # [S,T]
        valid = g.cast(g.unsqueeze("attention_mask", [1, 2]), TensorProto.BOOL)  # [B,1,1,T]
        allowed = g.node("And", [causal, valid], name="mask/allowed")        # [B,1,S,T]
        neg = -1e4 if self.fdtype == np.float16 else -1e9
        mask = g.node("Where", [allowed, g.const(0.0, self.fdtype), g.const(neg, self.fdtype)],
                      name="mask/additive")
        self._rope = (c, sn, mask)

    def _apply_rope(self, x: str, name: str) -> str:
        g, d = self.g, self.spec.head_dim
        c, sn, _ = self._rope
        x1 = g.slice(x, [0], [d // 2], [3])
        x2 = g.slice(x, [d // 2], [d], [3])
        rot = g.concat([g.node("Neg", [x2]), x1], axis=3, name=name + "/rotate_half")
        return g.add(g.mul(x, c), g.mul(rot, sn), name=name)

    def plain_attention(self, i: int, q: str, k: str, v: str, name: str) -> str:
        """Standard-op attention with a concatenated cache (``present = past ++ new``)."""
        g, s = self.g, self.spec
        if self._rope is None:
            self._plain_rope_and_mask()
        N, KV, D = s.num_heads, s.num_kv_heads, s.head_dim
        bhsd = lambda x, n: g.transpose(g.reshape(x, [0, 0, n, D]), [0, 2, 1, 3])  # noqa: E731
        q = self._apply_rope(bhsd(q, N), name + "/q_rope")
        k = self._apply_rope(bhsd(k, KV), name + "/k_rope")
        v = bhsd(v, KV)
        pk, pv, ok, ov = self.kv_names(i)
        k_all = g.node("Concat", [pk, k], outputs=[ok], name=name + "/present_k", axis=2)
        v_all = g.node("Concat", [pv, v], outputs=[ov], name=name + "/present_v", axis=2)
        g.output(ok, self.ftype, ["batch_size", KV, "total_sequence_length", self.key_head_dim(i)])
        g.output(ov, self.ftype, ["batch_size", KV, "total_sequence_length", D])
        rep = N // KV
        if rep > 1:
            exp = g.const([1, 1, rep, 1, 1])
            k_all = g.reshape(g.node("Expand", [g.unsqueeze(k_all, [2]), exp]), [0, N, -1, D])
            v_all = g.reshape(g.node("Expand", [g.unsqueeze(v_all, [2]), exp]), [0, N, -1, D])
        scores = g.matmul(q, g.transpose(k_all, [0, 1, 3, 2]), name=name + "/qk")
        scores = g.add(g.mul(scores, g.const(1.0 / math.sqrt(D), self.fdtype)), self._rope[2])
        probs = g.node("Softmax", [scores], name=name + "/softmax", axis=-1)
        ctx = g.matmul(probs, v_all, name=name + "/pv")
        return g.reshape(g.transpose(ctx, [0, 2, 1, 3]), [0, 0, N * D], name=name + "/merge")

    def build_mlp(self, i: int, layer, h: str) -> str:
        """SwiGLU MLP ``down(silu(gate(h)) * up(h))`` of layer ``i`` (fused gate/up)."""
        g, s = self.g, self.spec
        pre = f"model.layers.{i}.mlp"
        name = f"layers.{i}.mlp"
        gu = self.linear(h, [f"{pre}.gate_proj", f"{pre}.up_proj"], name + ".gate_up_proj")
        gate, up = g.split(gu, [s.intermediate_size, s.intermediate_size], axis=-1,
                           name=name + "/split")
        act = g.mul(gate, g.node("Sigmoid", [gate]), name=name + "/silu")
        return self.linear(g.mul(act, up, name=name + "/gated"), [f"{pre}.down_proj"],
                           name + ".down_proj")

    def build_lm_head(self, h: str) -> str:
        """Keep the last ``num_logits_to_keep`` positions of ``h [B,S,H]``, project to the
        vocabulary: returns the logits tensor ``[B, keep, vocab]`` in the model's float
        dtype (``build`` then names it the ``logits`` output)."""
        g, s = self.g, self.spec
        start = g.node("Neg", [g.unsqueeze("num_logits_to_keep", [0])], name="logits/start")
        h = g.slice(h, start, [2 ** 62], [1], name="logits/keep")
        if self._head_int is not None:
            if self._head_tensors is not None:
                w = self._head_int
                qB, qs, qz = self._head_tensors
                ins = [h, qB, qs] + ([] if qz is None else [qz])
                logits = g.node("MatMulNBits", ins, name="lm_head", domain=MS_DOMAIN,
                                K=w.K, N=w.N, bits=w.bits, block_size=w.block_size,
                                accuracy_level=self._accuracy_level("lm_head"))
            else:
                logits = self.int_matmul(h, self._head_int, "lm_head")
            self.quant_summary["lm_head"] = f"int{self._head_int.bits} block {self._head_int.block_size}"
        elif s.tie_word_embeddings:
            flat = g.reshape(h, [-1, s.hidden_size])
            logits = g.node("Gemm", [flat, self._emb_name], name="lm_head", transB=1)
            shp = g.concat([g.shape(h, 0, 2), g.const([s.vocab_size])], axis=0)
            logits = g.reshape(logits, shp)
            self.quant_summary["lm_head"] = self.opts.precision if self.opts.precision != "int4" else "fp32"
        else:
            logits = self.float_matmul(h, self.param("lm_head.weight"), "lm_head", ["lm_head"])
        return logits


class LlamaBuilder(DecoderBuilder):
    """Llama / Mistral-style decoder (no q/k/v bias)."""


class Qwen2Builder(DecoderBuilder):
    """Qwen2: llama blocks plus biases on q/k/v projections (read from the modules)."""

    qkv_bias = True

    def __init__(self, model, spec, opts):
        super().__init__(model, spec, opts)
        attn = model.model.layers[0].self_attn
        if attn.q_proj.bias is None:
            raise ExportError("qwen2 model without q_proj.bias", "check the checkpoint")


BUILDERS = {"llama": LlamaBuilder, "qwen2": Qwen2Builder}

__all__ = ["DecoderSpec", "BuildOptions", "DecoderBuilder", "LlamaBuilder", "Qwen2Builder",
           "BUILDERS"]
