"""Qwen2-family decoders: llama blocks plus biases on the q/k/v projections."""

from __future__ import annotations

from edgeprune_runtime.errors import ExportError

from ..decoder import DecoderBuilder


class Qwen2Builder(DecoderBuilder):
    """Qwen2: llama blocks plus biases on q/k/v projections (read from the modules).

    Raises:
        ExportError: a qwen2 model whose ``q_proj`` has no bias.
    """

    qkv_bias = True
    head_policy = ("int4 exports: an 8-bit head (RTN block 128) and a 4-bit embedding table (RTN "
                   "asym block 32, rows gathered and dequantized). Measured on Qwen2.5-Coder-0.5B, "
                   "WikiText-2 test 8 x 512, no BOS, float32 body (ppl 47.499): 8-bit head "
                   "+0.019 % (135 MiB), 4-bit head +2.88 % (83 MiB); embedding 8-bit +0.015 %, "
                   "4-bit -0.33 % (within noise; 519 -> 85 MiB). Float exports, and a float head asked for, "
                   "keep both tables float")

    def default_embedding(self) -> str:
        """``int4`` for int4 exports of an untied model whose head is quantized too (the
        measured cost is nil: see :attr:`head_policy`), ``fp`` otherwise (a float head
        asked for keeps a float embedding)."""
        quantized = self.opts.precision == "int4" and self.opts.lm_head != "fp"
        return "int4" if quantized and not self.spec.tie_word_embeddings else "fp"

    def __init__(self, model, spec, opts):
        super().__init__(model, spec, opts)
        attn = model.model.layers[0].self_attn
        if attn.q_proj.bias is None:
            raise ExportError("qwen2 model without q_proj.bias", "check the checkpoint")


__all__ = ["Qwen2Builder"]
