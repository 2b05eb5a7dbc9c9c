"""ONNX exporters: a compressed (or dense) HF decoder -> a folder the runtime loads.

Public API: :func:`export_onnx` -> :class:`ExportResult` (``exporters.export``). The graph
is built from the weights with ``onnx.helper`` (``exporters.decoder``); int4 weights are
packed from the quantizer's own integer codes (``exporters.int4``); graph variants are
builder mixins registered by name (``exporters.variants``): LeanK key pruning
(``exporters.leank``), COUNTDOWN sparse MLP (``exporters.countdown``), compact 2:4 weights
(``exporters.sparse24``, which also verifies and records 2:4 sparsity), a float16 / int8
KV cache (``exporters.kvcache``).

This package must not import ``edgeprune`` (dependencies flow edgeprune -> exporters ->
runtime); quantized weights are duck-typed ``QuantizedWeight``-like objects and variant
specs arrive as plain dicts.
"""

from __future__ import annotations

from . import countdown, igprune, kvcache, leank, sparse24  # noqa: F401  (register the built-in graph variants)
from .decoder import BuildOptions
from .export import ExportResult, check_export_args, export_onnx, make_builder
from .families import BUILDERS
from .metadata import FORMAT_VERSION
from .spec import DecoderSpec
from .variants import EXPORT_VARIANTS, register_export_variant

__all__ = ["export_onnx", "check_export_args", "make_builder", "ExportResult", "DecoderSpec",
           "BuildOptions", "BUILDERS", "EXPORT_VARIANTS", "register_export_variant",
           "FORMAT_VERSION"]
