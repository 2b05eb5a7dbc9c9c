"""Llama-family decoders (llama, Mistral-style configs without a sliding window): the base
builder as it is."""

from __future__ import annotations

from ..decoder import DecoderBuilder


class LlamaBuilder(DecoderBuilder):
    """Llama / Mistral-style decoder (no q/k/v bias)."""


__all__ = ["LlamaBuilder"]
