"""What the graph builder needs to know about a decoder, read from its transformers config.

:class:`DecoderSpec` holds the shapes and settings every family shares (layers, heads,
head_dim, vocabulary, RMSNorm epsilon, rotary frequencies...) plus the per-layer attention
settings some families add (``layer_types`` with a ``sliding_window``, a second rotary base
for the local layers, the attention scale and the logit soft-caps of Gemma). The family's
builder class (``exporters.families.BUILDERS[model_type]``) reads what only it knows
(:meth:`~exporters.decoder.DecoderBuilder.read_spec`) and says which limits its graph has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from edgeprune_runtime.errors import UnsupportedArchitectureError

from .attention import rope_limit
from .families import BUILDERS
from .linear import t2np


@dataclass
class DecoderSpec:
    """Shapes and settings of a decoder read from an HF model's config.

    The per-layer attention fields are ``None`` for llama/qwen2-style models (every layer
    full attention with one rotary table); ``layer_types[i]`` is ``"full_attention"`` or
    ``"sliding_attention"`` (a causal window of ``sliding_window`` tokens, the query's own
    included, rotary frequencies ``local_inv_freq``).
    """

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
    hidden_act: str = "silu"
    layer_types: Optional[list] = None
    sliding_window: Optional[int] = None
    local_inv_freq: Optional[np.ndarray] = field(repr=False, default=None)
    local_attention_scaling: float = 1.0
    local_rope_theta: Optional[float] = None
    #: softmax scale of the attention scores (``None``: ``1 / sqrt(head_dim)``)
    attn_scale: Optional[float] = None
    #: ``cap * tanh(x / cap)`` on the attention scores / on the final logits (Gemma 2/3)
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None

    def is_sliding(self, i: int) -> bool:
        """Whether layer ``i`` attends through a sliding window."""
        return bool(self.layer_types) and self.layer_types[i] == "sliding_attention" \
            and self.sliding_window is not None

    @property
    def sliding_layers(self) -> list[int]:
        """The sliding-window layers, in order."""
        return [i for i in range(self.num_layers) if self.is_sliding(i)]

    @classmethod
    def from_model(cls, model) -> "DecoderSpec":
        """Read the spec from a transformers ``*ForCausalLM`` model (the family's builder
        class completes it: :meth:`~exporters.decoder.DecoderBuilder.read_spec`).

        Raises:
            UnsupportedArchitectureError: a ``model_type`` without a builder, no
                ``model.layers`` / ``model.embed_tokens``, or a config feature the
                family's graph cannot reproduce (its activation, say).
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
        family = BUILDERS[arch]
        family.check_config(cfg)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rot = getattr(inner, "rotary_emb", None)
        if rot is not None and hasattr(rot, "inv_freq"):
            inv_freq = t2np(rot.inv_freq).astype(np.float64)
            scaling = float(getattr(rot, "attention_scaling", 1.0))
        else:
            theta = float(getattr(cfg, "rope_theta", 10000.0))
            inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
            scaling = 1.0
        rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) or 10000.0)
        mpe = int(getattr(cfg, "max_position_embeddings", 2048))
        # static tables are exact only while the model's own attention is: rope types whose
        # frequencies change with the sequence length, and sliding-window layers (unless
        # the family's graph has them)
        exact = [lim for lim in (rope_limit(rp, cfg, mpe),) if lim is not None]
        types = getattr(cfg, "layer_types", None) or []
        window = getattr(cfg, "sliding_window", None)
        if window and not family.sliding_window_graph and \
                ("sliding_attention" in types or (not types and getattr(cfg, "use_sliding_window", False))):
            exact.append((int(window), f"sliding-window attention (sliding_window={int(window)}) "
                                       "differs from full attention past the window"))
        spec = cls(architecture=arch, num_layers=cfg.num_hidden_layers,
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
        return family.read_spec(model, spec)


__all__ = ["DecoderSpec"]
