"""Qwen2-family decoders: llama blocks plus biases on the q/k/v projections."""

from __future__ import annotations

from runtime.errors import ExportError

from ..decoder import DecoderBuilder


class Qwen2Builder(DecoderBuilder):
    """Qwen2: llama blocks plus biases on q/k/v projections (read from the modules).

    Raises:
        ExportError: a qwen2 model whose ``q_proj`` has no bias.
    """

    qkv_bias = True

    def __init__(self, model, spec, opts):
        super().__init__(model, spec, opts)
        attn = model.model.layers[0].self_attn
        if attn.q_proj.bias is None:
            raise ExportError("qwen2 model without q_proj.bias", "check the checkpoint")


__all__ = ["Qwen2Builder"]
