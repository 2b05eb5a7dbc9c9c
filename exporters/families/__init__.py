"""Decoder-builder subclasses, one module per model family, keyed by the config's ``model_type``.

Each family overrides only what differs from :class:`~exporters.decoder.DecoderBuilder`
(llama-style blocks): ``LlamaBuilder`` (nothing), ``Qwen2Builder`` (q/k/v biases),
``Gemma3Builder`` ((1 + w) norms, four per layer, QK-norm, GeGLU, a scaled embedding,
sliding-window layers with their own rotary base, soft-caps). :data:`BUILDERS` is what
``exporters.export_onnx`` looks up; a new family is one module here and one entry there.
"""

from __future__ import annotations

from .gemma3 import Gemma3Builder
from .llama import LlamaBuilder
from .qwen2 import Qwen2Builder

#: ``model_type`` -> builder class
BUILDERS = {"llama": LlamaBuilder, "qwen2": Qwen2Builder, "gemma3_text": Gemma3Builder}

__all__ = ["BUILDERS", "LlamaBuilder", "Qwen2Builder", "Gemma3Builder"]
