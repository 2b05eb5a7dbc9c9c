"""Writing files so that nothing is ever half-written (standard library only).

Every package writes its outputs through these helpers: a file is written to a temporary
name in the same folder and renamed into place, so a reader (or a crash) sees the old
file or the new one, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union


def plain_file_mode() -> int:
    """``0o666`` minus the process umask: the mode a plain ``open(..., "w")`` would give."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: Union[str, Path], data: Union[bytes, str]) -> Path:
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


__all__ = ["atomic_write", "plain_file_mode"]
