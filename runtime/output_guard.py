"""The one output guard: what an output path may be before any work is spent on it
(standard library only; :mod:`runtime.files` is the entry point).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from .errors import EdgePruneError
from .output_claim import OutputClaim, refuse_live_claim

PathLike = Union[str, "os.PathLike[str]"]



@dataclass(frozen=True)
class OutputKind:
    """What a tool writes at an output path, for :func:`check_output` / :func:`claim_output`.

    Attributes:
        noun: what is written, in messages (``"export"``, ``"checkpoint"``, ``"run"``).
        folder: the output is a folder (else a file).
        replaces: the tool replaces the folder as a whole: an existing one needs
            ``overwrite`` (unless it holds the same run), may hold only ``files``, and is
            claimed while written. ``False``: a file rewritten in place, or a folder the
            tool only adds files to.
        files: the names a folder of this kind holds (``None``: any name).
        marker: the file every folder of this kind holds; without it every name in an
            existing folder is someone else's.
        marker_key: the marker must be a JSON object holding this key, whose value names
            the run (``run_id``, ``fingerprint``): the same run is replaced without
            ``overwrite``.
        empty_ok: an existing empty folder is taken without ``overwrite``.
        ours: the kind in "holds files that are not ..." (default ``"an edgeprune NOUN"``).
    """

    noun: str
    folder: bool = True
    replaces: bool = True
    files: Optional[frozenset] = None
    marker: Optional[str] = None
    marker_key: Optional[str] = None
    empty_ok: bool = True
    ours: Optional[str] = None


#: A file the tool (re)writes atomically (``--json``, a mask file).
FILE_OUTPUT = OutputKind("file", folder=False, replaces=False)
#: A folder the tool adds files to (``profile --out``).
FOLDER_OUTPUT = OutputKind("folder", replaces=False)


def source_conflict(out: PathLike, sources: Iterable, replaces: bool = True) -> Optional[str]:
    """Why writing ``out`` (and, when ``replaces``, replacing it) would touch an input, or
    ``None``. A source folder: ``out`` is it, lies inside it or (``replaces``) holds it.
    A source file (a ``.gguf``): ``out`` is it or (``replaces``) holds it; a folder beside
    it is harmless. Sources that do not exist (aliases, hub ids) are skipped."""
    out = Path(out).expanduser().resolve()
    for src in sources:
        if not src or not Path(src).expanduser().exists():
            continue
        src = Path(src).expanduser().resolve()
        if src.is_dir():
            if out == src or src in out.parents:
                return f"{out} is or lies inside the input model folder {src}"
            if replaces and out in src.parents:
                return f"{out} holds the input model folder {src}"
        elif out == src or (replaces and out in src.parents):
            return f"{out} is or holds the input model file {src}"
    return None


def _marker_value(path: Path, key: str) -> Any:
    """``key`` of the JSON object in ``path``; ``None`` when unreadable or absent."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data.get(key) if isinstance(data, dict) else None


def foreign_entries(out: PathLike, allowed=None, marker: Optional[str] = None,
                    marker_key: Optional[str] = None) -> list[str]:
    """Names in the existing folder ``out`` that a replacement would delete although no
    edgeprune step wrote them: everything when ``marker`` (e.g. ``edgeprune.json``) is
    missing (or, with ``marker_key``, is no JSON object holding that key), else the names
    outside ``allowed`` (``None``: any name)."""
    out = Path(out)
    names = sorted(p.name for p in out.iterdir())
    if marker is not None and (marker not in names or (
            marker_key and _marker_value(out / marker, marker_key) is None)):
        return names
    return [n for n in names if allowed is not None and n not in allowed]


def shown_names(names: list[str], k: int = 4) -> str:
    """The first ``k`` names for an error message, ``", ..."`` after them when cut."""
    return ", ".join(names[:k]) + (", ..." if len(names) > k else "")


def _where(path, kind: OutputKind, label: Optional[str]) -> str:
    return f"{label} {path}" if label else f"output {'folder' if kind.folder else 'file'} {path}"


def _probe_writable(p: Path, kind: OutputKind, where: str, label, error) -> None:
    """Create (and drop) an unnamed file where the output goes: the nearest existing
    folder above it, or the folder itself for a folder the tool adds files to."""
    parent = p if (kind.folder and not kind.replaces and p.is_dir()) else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        if not parent.is_dir():
            raise OSError(f"{parent} is not a folder")
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise error(f"{where} cannot be written ({e})",
                    "pass a path in a writable folder" + (f" to {label}" if label else "")) from e


def _check_existing(p: Path, kind: OutputKind, overwrite: bool, run_id: Optional[str],
                    where: str, error) -> None:
    """The checks on what already lies at ``p`` (a folder kind that ``replaces``)."""
    if not p.exists():
        return
    names = sorted(x.name for x in p.iterdir())
    other = foreign_entries(p, kind.files, kind.marker, kind.marker_key) if names else []
    if other:
        raise error(f"{where} holds files that are not {kind.ours or 'an edgeprune ' + kind.noun} "
                    f"({shown_names(other)}); overwrite only replaces an earlier {kind.noun}",
                    "move those files out, or choose a new or empty output folder")
    if overwrite or (not names and kind.empty_ok):
        return
    if run_id and kind.marker and kind.marker_key and \
            _marker_value(p / kind.marker, kind.marker_key) == run_id:
        return                                      # the same run again: replaced
    if not names:
        msg = f"{where} already exists"
    elif run_id:
        msg = f"{where} already holds a different run"
    else:
        msg = f"{where} already holds {'an' if kind.noun[:1] in 'aeiou' else 'a'} {kind.noun}"
    raise error(msg, "pass --overwrite (overwrite=True) to replace it, or choose another folder")


def check_output(path: PathLike, kind: OutputKind = FILE_OUTPUT, *, inputs: Iterable = (),
                 overwrite: bool = False, run_id: Optional[str] = None,
                 error: type = EdgePruneError, label: Optional[str] = None) -> Path:
    """Refuse, before any work, an output that would lose data or cannot be written.

    In this order: ``path`` is, lies in or (a folder the tool replaces) holds one of
    ``inputs`` (:func:`source_conflict`); has the wrong kind (a file for a folder, a
    folder for a file); cannot take a new file (probed with an unnamed temporary file in
    the nearest existing folder: read-only, under a file, ``/proc``). For a folder kind
    that ``replaces``: another live process holds its claim (:class:`OutputClaim`); it
    holds files the kind does not write (refused even with ``overwrite``); it exists
    without ``overwrite`` (an empty one when ``kind.empty_ok``, and one holding the same
    ``run_id``, are taken). The path is checked as given (a quoted ``~`` is a folder
    named ``~``).

    Args:
        path: the output file or folder.
        kind: what is written there (:class:`OutputKind`).
        inputs: the command's input files and folders (missing ones are skipped).
        overwrite: an existing output of this kind may be replaced.
        run_id: identifies this run; an existing folder whose marker holds it is the
            same run, replaced without ``overwrite``.
        error: the :class:`~runtime.errors.EdgePruneError` subclass to raise
            (``ExportError``, ``CheckpointError``, ``ConfigError``...).
        label: how the path is named in messages (a CLI flag such as ``--out``);
            default ``output folder`` / ``output file``.

    Returns:
        The resolved path.

    Raises:
        error: naming the path, the problem and the fix.
    """
    where = _where(path, kind, label)
    p = Path(path).resolve()
    why = source_conflict(p, inputs, replaces=kind.replaces)
    if why:
        raise error(f"refusing to write {label or 'the ' + kind.noun} there: {why}",
                    f"write {label or 'the ' + kind.noun} outside the input's folder")
    if kind.folder and p.exists() and not p.is_dir():
        raise error(f"{where} is a file, not a folder",
                    "pass a folder" + (f" to {label}" if label else " path"))
    if not kind.folder and (p.is_dir() or str(path).endswith(("/", os.sep))):
        raise error(f"{where} names a folder",
                    f"pass a file path, e.g. {label + ' ' if label else ''}out.json")
    _probe_writable(p, kind, where, label, error)
    if kind.folder and kind.replaces:
        refuse_live_claim(p, where, error)
        _check_existing(p, kind, overwrite, run_id, where, error)
    return p



def claim_output(path: PathLike, kind: OutputKind, *, inputs: Iterable = (),
                 overwrite: bool = False, run_id: Optional[str] = None,
                 error: type = EdgePruneError, label: Optional[str] = None) -> OutputClaim:
    """:func:`check_output`, then claim the output (:class:`OutputClaim`) and check what
    lies there again under the claim. Call it before any work and hold it until the
    output is written::

        with claim_output(out, CHECKPOINT_OUTPUT, inputs=[src], overwrite=ow,
                          error=CheckpointError):
            ...                                  # minutes of work, then atomic_folder(out)

    Args:
        path, kind, inputs, overwrite, run_id, error, label: as :func:`check_output`.

    Returns:
        The held :class:`OutputClaim` (a context manager: leaving it releases).

    Raises:
        error: every refusal of :func:`check_output`; another live writer holds the output.
    """
    p = check_output(path, kind, inputs=inputs, overwrite=overwrite, run_id=run_id,
                     error=error, label=label)
    where = _where(path, kind, label)
    claim = OutputClaim(p, error=error, where=where).acquire()
    try:
        _check_existing(p, kind, overwrite, run_id, where, error)
    except BaseException:
        claim.release()
        raise
    return claim


__all__ = ["OutputKind", "FILE_OUTPUT", "FOLDER_OUTPUT", "source_conflict", "foreign_entries",
           "shown_names", "check_output", "claim_output"]
