"""Writing outputs so that nothing is half-written, lost to a second writer, or left behind
(standard library only: it ships in the torch-free runtime).

Every package writes through these helpers:

* :func:`atomic_write` and :func:`write_json` write one file: a temporary name in the same
  folder, renamed into place, so a reader (or a crash) sees the old file or the new one.
* :func:`check_output` is the one output guard: before any work it refuses an output that
  is, lies in or holds an input, has the wrong kind, cannot be written, is being written
  by another process, or exists without ``overwrite`` (and, even with it, a folder holding
  files the tool did not write). An :class:`OutputKind` says what the tool writes there.
* :func:`claim_output` checks the same and *claims* the output for the whole job: a lock
  file ``.NAME.lock`` beside it holds the writer's pid, so a second writer is refused at
  once. A claim whose process is gone is stale: it is taken over, and the temporary
  folders that process left are removed (:class:`OutputClaim`).
* :func:`atomic_folder` writes a whole folder: a temporary sibling ``.NAME.tmp-PID-*``,
  flushed to disk and renamed into place; on any failure nothing is left.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from .errors import EdgePruneError
from .output_claim import OutputClaim, pid_alive
from .output_guard import (FILE_OUTPUT, FOLDER_OUTPUT, OutputKind, check_output, claim_output,
                           foreign_entries, shown_names, source_conflict)

PathLike = Union[str, "os.PathLike[str]"]

def plain_file_mode() -> int:
    """``0o666`` minus the process umask: the mode a plain ``open(..., "w")`` would give."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def plain_modes(path: PathLike) -> None:
    """Give ``path`` (a file, or a folder and all it holds) the permissions a plain
    ``mkdir``/``open`` would: ``0o777`` / ``0o666`` minus the umask. ``mkdtemp`` and
    ``mkstemp`` create 0700 / 0600 and safetensors writes 0600, which would hide the
    outputs from the other users or the service account an app runs as."""
    path = Path(path)
    mask = os.umask(0)
    os.umask(mask)
    for p in [path] + (sorted(path.rglob("*")) if path.is_dir() else []):
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def atomic_write(path: PathLike, data: Union[bytes, str]) -> Path:
    """Write ``data`` to ``path`` atomically: a temporary file beside it, then
    ``os.replace``. Parent folders are created; the file gets the plain umask mode
    (``mkstemp``'s 0600 would hide it from other users).

    Args:
        path: destination file.
        data: bytes, or text (written as UTF-8).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the folder cannot be created or written (the temporary file is removed).
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, plain_file_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def json_ready(obj: Any) -> Any:
    """``obj`` as strict JSON values: numpy scalars and arrays as Python numbers and
    lists, non-finite floats as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON
    has no NaN / Infinity; ``json.dumps`` would write them anyway), tuples as lists.
    numpy is recognised by its type's module, never imported."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if type(obj).__module__ == "numpy" and hasattr(obj, "tolist"):
        return json_ready(obj.tolist())
    return obj


def write_json(path: PathLike, obj: Any, *, indent: Optional[int] = 2,
               sort_keys: bool = False) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (:func:`atomic_write`), through
    :func:`json_ready` (numpy values, non-finite floats); anything else JSON cannot hold
    is written as its ``str``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the file cannot be written.
    """
    return atomic_write(path, json.dumps(json_ready(obj), indent=indent, sort_keys=sort_keys,
                                         default=str))


def _fsync_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:        # folders cannot be opened for fsync on some platforms
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: PathLike) -> None:
    """Flush every file of ``folder`` (and the folder) to disk before it is renamed into
    place, so a crash right after the rename cannot leave a complete-looking folder with
    truncated files; it also leaves no dirty page-cache pages behind for the runtime's
    memory-mapped weights."""
    folder = Path(folder)
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            _fsync_path(p)
    _fsync_path(folder)



@contextmanager
def atomic_folder(out: PathLike, *, overwrite: bool = False, error: type = EdgePruneError,
                  label: Optional[str] = None) -> Iterator[Path]:
    """Yield a temporary folder ``.NAME.tmp-PID-*`` beside ``out``; on success its files
    get plain modes (:func:`plain_modes`), are flushed (:func:`fsync_tree`) and the folder
    is renamed to ``out`` (an existing ``out`` is set aside as ``.NAME.old-PID-*`` and
    deleted after). The output is claimed meanwhile (:class:`OutputClaim`; joined if this
    thread already holds it). On any exception, ``KeyboardInterrupt`` included, the
    temporary folder and the parent folders made for it are removed and an existing
    ``out`` is untouched.

    Raises:
        error: another writer holds ``out``; ``out`` appeared meanwhile and not
            ``overwrite``; the claim was taken over while writing.
    """
    out = Path(out).resolve()
    where = f"{label} {out}" if label else f"output folder {out}"
    with OutputClaim(out, error=error, where=where) as claim:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
        try:
            yield tmp
            plain_modes(tmp)
            fsync_tree(tmp)
            claim.verify()
            if out.exists():
                if not overwrite:
                    raise error(f"{where} appeared while it was being written",
                                "pass --overwrite (overwrite=True) or choose a new path")
                old = out.with_name(f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
                os.replace(out, old)
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out)
            _fsync_path(out.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


__all__ = ["atomic_write", "plain_file_mode", "plain_modes", "json_ready", "write_json",
           "fsync_tree", "atomic_folder", "OutputKind", "FILE_OUTPUT", "FOLDER_OUTPUT",
           "source_conflict", "foreign_entries", "shown_names", "check_output", "claim_output",
           "OutputClaim", "pid_alive"]
