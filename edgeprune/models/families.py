"""The model families edgeprune loads, and the family-dependent views of a loaded model.

A family is named three ways: its edgeprune name (``gemma3``), the ``model_type`` of its
Hugging Face config (``gemma3_text``) and the ``general.architecture`` of its GGUF files
(``gemma3``). Loading accepts exactly the families of :data:`FAMILIES`; anything else is
refused before any weights are read, naming them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class Family:
    """One supported decoder family.

    Attributes:
        name: edgeprune's name for it (``llama``, ``qwen2``, ``gemma3``).
        model_type: ``config.json``'s ``model_type`` of its text-only causal LM.
        gguf_architecture: ``general.architecture`` in its GGUF files.
        exportable: whether ``exporters.export_onnx`` builds it yet.
    """

    name: str
    model_type: str
    gguf_architecture: str
    exportable: bool = True


#: The families load_model accepts, by edgeprune name.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "llama", "llama"),
    Family("qwen2", "qwen2", "qwen2"),
    Family("gemma3", "gemma3_text", "gemma3"),
)}

#: model_type values (``config.json``) that load_model accepts.
SUPPORTED_ARCHITECTURES = tuple(f.model_type for f in FAMILIES.values())

#: model_types refused with a reason of their own (a near miss of a supported family).
_REFUSED = {
    "gemma3": ("a multimodal Gemma 3 (vision tower + language model, Gemma3ForConditionalGeneration)",
               "use a text-only Gemma 3 (model_type gemma3_text: gemma-3-270m, gemma-3-1b), or the "
               "gemma3-270m alias"),
}


def _supported() -> str:
    return ", ".join(f.name if f.name == f.model_type else f"{f.name} (model_type {f.model_type})"
                     for f in FAMILIES.values())


def _family(attr: str, value: str) -> Family | None:
    return next((f for f in FAMILIES.values() if getattr(f, attr) == value), None)


def check_architecture(model_type: str, where: str) -> Family:
    """The family of a ``config.json`` ``model_type``; refuse any other.

    Raises:
        UnsupportedArchitectureError: naming the supported families.
    """
    family = _family("model_type", model_type)
    if family is None and model_type in _REFUSED:
        what, fix = _REFUSED[model_type]
        raise UnsupportedArchitectureError(f"{where} is {what}, which edgeprune does not load", fix)
    if family is None:
        raise UnsupportedArchitectureError(
            f"{where} is a {model_type!r} model, which edgeprune does not support",
            f"use a model of a supported architecture: {_supported()}")
    return family


def check_gguf_architecture(architecture: str, where: str) -> Family:
    """The family of a GGUF ``general.architecture``; refuse any other.

    Raises:
        UnsupportedArchitectureError: naming the supported families.
    """
    family = _family("gguf_architecture", architecture)
    if family is None:
        raise UnsupportedArchitectureError(
            f"{where} is a GGUF of architecture {architecture!r}, which edgeprune does not support",
            f"use a GGUF of a supported architecture: {_supported()}")
    return family


def decoder_layers(model):
    """The decoder blocks (an ``nn.ModuleList``) of a llama / qwen2 / gemma3_text causal LM:
    ``model.model.layers`` in all three.

    Raises:
        UnsupportedArchitectureError: the model has no ``model.layers``.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} has no model.layers (decoder blocks)",
            f"use a causal LM of a supported architecture: {_supported()}")
    return layers


def describe(model) -> dict[str, Any]:
    """Small JSON-able summary of a loaded model.

    Keys: ``architecture`` (model_type), ``family``, ``num_layers``, ``hidden_size``,
    ``num_heads`` / ``num_kv_heads`` (query and key/value heads), ``head_dim`` (gemma3's
    256 is not hidden / heads), ``intermediate_size``, ``vocab_size``,
    ``tie_word_embeddings``, ``sliding_window`` (tokens, ``None`` when all layers attend
    to the whole context), ``parameters`` (count, tied weights once).
    """
    cfg = model.config
    heads = cfg.num_attention_heads
    family = _family("model_type", cfg.model_type)
    return dict(architecture=cfg.model_type, family=family and family.name, num_layers=cfg.num_hidden_layers,
                hidden_size=cfg.hidden_size, num_heads=heads,
                num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                intermediate_size=getattr(cfg, "intermediate_size", None),
                vocab_size=cfg.vocab_size,
                tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                sliding_window=getattr(cfg, "sliding_window", None) if
                getattr(cfg, "use_sliding_window", True) else None,
                parameters=sum(p.numel() for p in model.parameters()))


__all__ = ["Family", "FAMILIES", "SUPPORTED_ARCHITECTURES", "check_architecture",
           "check_gguf_architecture", "decoder_layers", "describe"]
