"""Loading a Hugging Face model folder (``config.json`` + safetensors + tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelLoadError
from .cache import TOKENIZER_FILES


def read_model_type(config_path: Path) -> str:
    """``model_type`` of a ``config.json``.

    Raises:
        ModelLoadError: unreadable, or no ``model_type``.
    """
    try:
        return json.loads(config_path.read_text())["model_type"]
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{config_path} is unreadable or has no model_type ({exc})",
                             "point to a Hugging Face model folder with a valid config.json") from None


def load_folder(path: Path | str, dtype, trust_remote_code: bool = False):
    """``(model, tokenizer)`` from a Hugging Face folder (a :class:`~pathlib.Path`) or a hub
    id (a ``str``), model in eval mode.

    Raises:
        ModelLoadError: no tokenizer file, or transformers cannot load it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(path, Path) and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(f"the model folder {path} has no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)})",
                             "copy the model's tokenizer files into the folder (e.g. "
                             "AutoTokenizer.from_pretrained(<original>).save_pretrained(folder))")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"could not load the model folder {path}: {type(exc).__name__}: {exc}",
                             "check that it holds config.json, weights (safetensors) and a tokenizer") from None
    return model.eval(), tok


__all__ = ["load_folder", "read_model_type"]
