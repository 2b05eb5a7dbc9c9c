"""Reading a GGUF file's metadata header (standard library only, no tensor data).

``gguf.GGUFReader`` parses every field up front: for a 262k-entry vocabulary (Gemma 3)
that alone takes most of a minute, which is too long to learn that a file is of an
architecture edgeprune refuses. This reader walks the key/value section one field at a
time and stops as soon as it has what it was asked for.

Layout (GGUF v2 and v3, little-endian): magic ``GGUF``, ``uint32`` version, ``uint64``
tensor count, ``uint64`` key/value count, then per key/value: a string key, a ``uint32``
value type and the value. A string is a ``uint64`` length and UTF-8 bytes; an array is a
``uint32`` element type, a ``uint64`` count and the elements.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO, Iterable

# value type -> struct format of a fixed-width scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file this reader understands (bad magic, version, type)."""


def _read(f: BinaryIO, fmt: str):
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFHeaderError("the file ends inside its header")
    return struct.unpack(fmt, data)[0]


def _read_string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    data = f.read(n)
    if len(data) != n:
        raise GGUFHeaderError("the file ends inside its header")
    return data.decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, vtype: int):
    """A scalar or string value; ``None`` for an array (skipped)."""
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _read_string(f)
    if vtype != _ARRAY:
        raise GGUFHeaderError(f"unknown metadata value type {vtype}")
    etype, count = _read(f, "<I"), _read(f, "<Q")
    if etype in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[etype]) * count, 1)
    elif etype == _STRING:
        for _ in range(count):
            f.seek(_read(f, "<Q"), 1)
    else:
        raise GGUFHeaderError(f"unknown metadata array element type {etype}")
    return None


def _read_preamble(f: BinaryIO) -> tuple[int, int]:
    """``(tensor count, key/value count)`` after checking the magic and the version."""
    if f.read(4) != b"GGUF":
        raise GGUFHeaderError("bad magic (not a GGUF file)")
    version = _read(f, "<I")
    if version not in (2, 3):
        raise GGUFHeaderError(f"GGUF version {version} (this reader handles 2 and 3)")
    return _read(f, "<Q"), _read(f, "<Q")


def read_gguf_metadata(path: str | Path, keys: Iterable[str]) -> dict:
    """The scalar and string metadata ``keys`` of a GGUF file (those present).

    Stops reading at the last key asked for; arrays are skipped, never returned.

    Raises:
        GGUFHeaderError: not a GGUF v2/v3 file, or a header cut short.
        OSError: the file cannot be read.
    """
    wanted, found = set(keys), {}
    with open(path, "rb") as f:
        _, n_kv = _read_preamble(f)
        for _ in range(n_kv):
            if not wanted - found.keys():
                break
            key = _read_string(f)
            value = _read_value(f, _read(f, "<I"))
            if key in wanted and value is not None:
                found[key] = value
    return found


def read_gguf_parameter_count(path: str | Path) -> int:
    """Elements of every tensor a GGUF file holds (its parameter count), from the tensor
    infos after the key/value section: per tensor a string name, a ``uint32`` dimension
    count, that many ``uint64`` dimensions, a ``uint32`` type and a ``uint64`` offset.

    Raises:
        GGUFHeaderError: not a GGUF v2/v3 file, or a header cut short.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        n_tensors, n_kv = _read_preamble(f)
        for _ in range(n_kv):
            _read_string(f)
            _read_value(f, _read(f, "<I"))
        total = 0
        for _ in range(n_tensors):
            _read_string(f)
            n = 1
            for _ in range(_read(f, "<I")):
                n *= _read(f, "<Q")
            _read(f, "<I")
            _read(f, "<Q")
            total += n
    return total


__all__ = ["GGUFHeaderError", "read_gguf_metadata", "read_gguf_parameter_count"]
