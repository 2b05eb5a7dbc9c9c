"""The float cache of GGUF conversions: one folder per converted file.

Dequantizing a GGUF file and converting its tokenizer take from seconds (SmolLM2-135M)
to minutes (Gemma 3's 262k-entry vocabulary), so the result is saved once as an ordinary
Hugging Face folder (``config.json``, safetensors weights, the converted tokenizer's
``tokenizer.json``) under ``<cache>/models/<stem>-<key>``, and later loads read that.

The key changes when the source changes: a file's path, size and modification time, or
the pinned SHA-256 of a built-in split alias. An entry is written to a temporary folder
and renamed into place (:func:`runtime.files.atomic_folder`), so it is complete or absent; one damaged afterwards (a truncated
safetensors file) is detected from the safetensors headers and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from edgeprune_runtime.files import atomic_folder

from ..errors import ModelLoadError

#: files of which an entry must hold at least one (the converted tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def cache_dir() -> Path:
    """Root of edgeprune's cache (``$EDGEPRUNE_CACHE`` or ``~/.cache/edgeprune``)."""
    return Path(os.environ.get("EDGEPRUNE_CACHE", Path.home() / ".cache" / "edgeprune"))


def entry_for_file(path: Path) -> Path:
    """The entry of a GGUF file, keyed by its resolved path, size and mtime (seconds)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{path.stem}-{key}"


def entry_for_digest(file_name: str, sha256: str) -> Path:
    """The entry of a file known by its SHA-256 (a built-in split alias)."""
    return cache_dir() / "models" / f"{Path(file_name).stem}-sha256-{sha256[:16]}"


def _safetensors_complete(path: Path) -> bool:
    """Whether a safetensors file is as long as its header says (8-byte header length,
    JSON header, then the data up to the largest ``data_offsets`` end)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
        return path.stat().st_size == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return False


def entry_problem(entry: Path) -> str | None:
    """Why the entry cannot be used (``None`` when it looks complete).

    Checks ``config.json``, at least one safetensors file, each as long as its header
    says, and a tokenizer file. Reads headers only.
    """
    if not (entry / "config.json").is_file():
        return "it has no config.json"
    weights = sorted(entry.glob("*.safetensors"))
    if not weights:
        return "it has no safetensors weights"
    bad = [w.name for w in weights if not _safetensors_complete(w)]
    if bad:
        return f"{', '.join(bad)} is truncated or unreadable"
    if not any((entry / f).is_file() for f in TOKENIZER_FILES):
        return "it has no tokenizer"
    return None


def discard(entry: Path) -> bool:
    """Move a damaged entry out of the way (renamed, then removed) so it can be rebuilt;
    ``False`` when it cannot be (a read-only cache)."""
    try:
        aside = Path(tempfile.mkdtemp(prefix=f".damaged-{entry.name}-", dir=entry.parent))
        os.replace(entry, aside / entry.name)
    except OSError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def write_entry(entry: Path, model, tokenizer) -> bool:
    """Save ``model`` and ``tokenizer`` as the entry, atomically
    (:func:`runtime.files.atomic_folder`: a temporary sibling renamed into place). An
    entry another process is writing, or wrote first, is left to it.

    Returns:
        whether a complete entry now exists; a cache that cannot be written only costs
        speed.
    """
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with atomic_folder(entry, error=ModelLoadError, label="cache entry") as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    except (OSError, ModelLoadError):  # read-only cache, another writer, written meanwhile
        pass
    return entry_problem(entry) is None


__all__ = ["cache_dir", "entry_for_file", "entry_for_digest", "entry_problem", "discard",
           "write_entry", "TOKENIZER_FILES"]
