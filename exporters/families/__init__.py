"""Decoder-builder subclasses, one module per model family, keyed by the config's ``model_type``.

Each family overrides only what differs from :class:`~exporters.decoder.DecoderBuilder`
(llama-style blocks): ``LlamaBuilder`` (nothing), ``Qwen2Builder`` (q/k/v biases). :data:`BUILDERS` is what
``exporters.export_onnx`` looks up; a new family is one module here and one entry there.
"""

from __future__ import annotations

from .llama import LlamaBuilder
from .qwen2 import Qwen2Builder

#: ``model_type`` -> builder class
BUILDERS = {"llama": LlamaBuilder, "qwen2": Qwen2Builder}

__all__ = ["BUILDERS", "LlamaBuilder", "Qwen2Builder"]
