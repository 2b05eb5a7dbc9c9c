"""GGUF files to float PyTorch models, through the float cache (:mod:`.cache`).

transformers' GGUF reader (package ``gguf``) dequantizes every tensor in Python and
converts the file's vocabulary to a ``tokenizers`` tokenizer: seconds for SmolLM2-135M,
minutes for Gemma 3 270M. Both results are saved into a cache entry and read from there
afterwards (``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(entry)``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable, Union

from ..errors import ModelLoadError
from .cache import discard, entry_problem, write_entry
from .families import Family, check_architecture, check_gguf_architecture
from .folder import load_folder, read_model_type
from .gguf_header import GGUFHeaderError, read_gguf_metadata


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file, read from its header alone.

    Raises:
        ModelLoadError: the file is not a readable GGUF file.
    """
    try:
        return read_gguf_metadata(path, ["general.architecture"])["general.architecture"]
    except (OSError, GGUFHeaderError, KeyError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})",
                             "check the path, or re-download the file") from None


def _from_cache(entry: Path, dtype):
    """``(model, tokenizer, family)`` from a complete entry, ``None`` to convert afresh
    (no entry, or a damaged one now moved away).

    Raises:
        ModelLoadError: a damaged entry that cannot be removed, or one that looks
            complete but does not load; naming the folder to delete.
    """
    if not entry.exists():
        return None
    problem = entry_problem(entry)
    fix = f"delete the folder {entry} (it is rebuilt on the next load)"
    if problem is not None:
        if not discard(entry):
            raise ModelLoadError(f"the cached conversion {entry} is damaged ({problem})", fix)
        warnings.warn(f"the cached conversion {entry} was damaged ({problem}): converting again",
                      stacklevel=3)
        return None
    try:
        family = check_architecture(read_model_type(entry / "config.json"), str(entry))
        model, tok = load_folder(entry, dtype)
    except ModelLoadError as exc:  # UnsupportedArchitectureError too: the entry is not ours
        raise ModelLoadError(f"the cached conversion {entry} cannot be loaded ({exc.message})",
                             fix) from None
    return model, tok, family


def _convert(path: Path):
    """Dequantize ``path`` (float32) and convert its tokenizer, as transformers does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a bad GGUF
        raise ModelLoadError(f"could not load GGUF file {path}: {type(exc).__name__}: {exc}",
                             "check the file is a complete GGUF of a supported architecture") from None
    # The weights are now plain floats: drop the GGUF marker so saves are ordinary folders.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if attr in model.__dict__:
            del model.__dict__[attr]
    model.config.name_or_path = str(path)
    return model, tok


def load_gguf(gguf: Union[Path, Callable[[], Path]], entry: Path, dtype, use_cache: bool = True
              ) -> tuple:
    """``(model, tokenizer, family)`` of a GGUF file, from its cache entry when complete.

    Args:
        gguf: the file, or a function giving it (called only when a conversion is needed:
            a split alias is assembled only then).
        entry: its cache entry (:func:`.cache.entry_for_file`, :func:`.cache.entry_for_digest`).
        dtype: torch dtype of the returned weights.
        use_cache: read and write the entry; ``False`` always converts.

    Returns:
        the model (eval mode), the tokenizer (reloaded from the entry when it was written,
        so a first and a later load give the same tokenizer) and the :class:`Family`.

    Raises:
        ModelLoadError: unreadable or incomplete file; a damaged entry (naming it).
        UnsupportedArchitectureError: the file's architecture is not a supported family.
    """
    from transformers import AutoTokenizer

    if use_cache and (hit := _from_cache(entry, dtype)) is not None:
        return hit
    path = gguf() if callable(gguf) else gguf
    family: Family = check_gguf_architecture(gguf_architecture(path), str(path))
    model, tok = _convert(path)
    if use_cache and write_entry(entry, model, tok):
        tok = AutoTokenizer.from_pretrained(str(entry))
    return model.to(dtype).eval(), tok, family


__all__ = ["gguf_architecture", "load_gguf"]
