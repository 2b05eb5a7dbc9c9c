"""The study's content-hash cache: every compressed model and every result is stored under
the SHA-256 of what produced it, so a re-run computes only what changed.

Keys (:func:`key`, over canonical JSON):

* a model's **digest**: the SHA-256 of its files' bytes (the GGUF file of an alias, every
  file of a folder), memoized per (path, size, mtime) in ``digests.json``;
* a **cell**: the model digest, the cell's method settings (group size resolved), the
  calibration (source digest, ``nsamples``, ``seqlen``, ``seed``) and :data:`STUDY_VERSION`;
* a **unit** (one measurement of one cell: ``text``, ``task:piqa``, ``lang:deu``): the cell
  key, the unit's own settings and the digest of its data.

Layout under the cache folder: ``models/<cell key>/`` (the tensors compression changed,
``weights.safetensors``, and ``record.json``), ``results/<unit key>.json``,
``digests.json``. Files are written atomically (:mod:`runtime.files`), so a killed run
leaves whole entries or none; entries are never rewritten in place, so several workers
(Ray) may share one folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Optional

from edgeprune_runtime.files import atomic_write, write_json

#: Bumped when what a cell or unit computes changes (old entries are then not reused).
STUDY_VERSION = 1


def key(obj: Any) -> str:
    """SHA-256 (first 20 hex digits) of ``obj`` as canonical JSON."""
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


class Cache:
    """A study cache folder.

    Args:
        root: the folder (created on first write).
    """

    def __init__(self, root):
        self.root = Path(root).expanduser().resolve()
        self._lock = threading.Lock()

    # ---- digests of inputs
    def digest(self, path: Path) -> str:
        """SHA-256 of a file, or of a folder's files (names and bytes), memoized by
        (path, size, mtime) in ``digests.json``."""
        path = Path(path).resolve()
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        stamp = [[str(p.relative_to(path) if path.is_dir() else p.name), p.stat().st_size,
                  p.stat().st_mtime_ns] for p in files]
        memo_key = key([str(path), stamp])
        memo = self._read_json(self.root / "digests.json") or {}
        if memo_key in memo:
            return memo[memo_key]
        h = hashlib.sha256()
        for (name, _, _), p in zip(stamp, files):
            h.update(name.encode() + b"\0" + file_sha256(p).encode())
        value = h.hexdigest()
        with self._lock:
            memo = self._read_json(self.root / "digests.json") or {}
            memo[memo_key] = value
            write_json(self.root / "digests.json", memo)
        return value

    # ---- results
    def result_path(self, unit_key: str) -> Path:
        return self.root / "results" / f"{unit_key}.json"

    def get(self, unit_key: str) -> Optional[dict]:
        """The stored result of a unit, or None."""
        return self._read_json(self.result_path(unit_key))

    def put(self, unit_key: str, value: dict) -> None:
        """Store a unit's result (atomically)."""
        write_json(self.result_path(unit_key), value)

    # ---- compressed models
    def model_dir(self, cell_key: str) -> Path:
        return self.root / "models" / cell_key

    def has_model(self, cell_key: str) -> bool:
        d = self.model_dir(cell_key)
        return (d / "record.json").is_file() and (d / "weights.safetensors").is_file()

    def save_model(self, cell_key: str, model, dense_state: dict, record: dict) -> None:
        """Store the tensors of ``model`` that differ from ``dense_state`` (compression
        touches the decoder blocks' linear weights only) and the cell's record."""
        from safetensors.torch import save_file

        changed = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
                   if k in dense_state and not _same(v, dense_state[k])}
        d = self.model_dir(cell_key)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".weights.safetensors.tmp-{os.getpid()}"
        save_file(changed, str(tmp))
        os.replace(tmp, d / "weights.safetensors")
        write_json(d / "record.json", dict(record, tensors=len(changed)))

    def load_model(self, cell_key: str, model) -> dict:
        """Write the stored tensors into ``model`` (a copy of the dense model); returns the record."""
        from safetensors.torch import load_file

        d = self.model_dir(cell_key)
        state = load_file(str(d / "weights.safetensors"))
        missing = set(state) - set(model.state_dict())
        if missing:
            from ..errors import CheckpointError

            raise CheckpointError(f"cached model {d} holds tensors the model lacks ({sorted(missing)[:3]})",
                                  f"delete {d} and re-run")
        model.load_state_dict(state, strict=False)
        return self._read_json(d / "record.json") or {}

    @staticmethod
    def _read_json(path: Path) -> Optional[Any]:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def write_text(self, rel: str, text: str) -> Path:
        return atomic_write(self.root / rel, text)


def _same(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


__all__ = ["Cache", "key", "file_sha256", "STUDY_VERSION"]
