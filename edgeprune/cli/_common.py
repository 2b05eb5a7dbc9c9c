"""Helpers every command shares: console, JSON output, output-path checks, tables and the
compression options of ``run`` and ``compress``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import click

from runtime.errors import ConfigError


class _RegisteredMethods(Sequence):
    """The compression method names of the registry (:func:`edgeprune.methods.method_names`),
    read on each use: the registry imports torch, the CLI's start does not."""

    def _names(self) -> tuple:
        from ..methods import method_names

        return tuple(method_names())

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(list(self._names()))


#: The ``--method`` choices: every registered compression method.
METHODS = _RegisteredMethods()


class _MethodChoice(click.Choice):
    """``click.Choice`` over :data:`METHODS`, looked up when click first needs them
    (parsing ``--method``, printing help), not when the CLI starts."""

    def __init__(self):
        super().__init__(())

    @property
    def choices(self) -> tuple:
        return tuple(METHODS)

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ assigns; ours come from the registry
        pass


def _console():
    from rich.console import Console

    # markup off: paths, model names and protocol labels such as "[heldout]" print as they
    # are (rich read them as style tags, dropped them, or raised MarkupError on "[/x]")
    con = Console(stderr=False, highlight=False, markup=False)
    if not con.is_terminal:        # piped / redirected: no 80-column wrapping of tables
        con = Console(stderr=False, highlight=False, markup=False, width=200)
    return con


def _write_json(path: Optional[str], data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temporary file, then rename)."""
    from runtime.files import atomic_write

    if path:
        atomic_write(Path(path), json.dumps(_finite(data), indent=2, default=str))


def _finite(x):
    """``x`` with non-finite floats as the strings ``"inf"``, ``"-inf"``, ``"nan"`` (strict
    JSON has no NaN / Infinity; json.dumps would write them anyway)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _check_output(path: Optional[str], flag: str, inputs=(), folder: bool = False) -> None:
    """Refuse, before any work, an output path (``--json`` file, ``--out`` folder the
    command adds files to) that is or lies in an input folder (or is an input file), has
    the wrong kind (a folder for a file, a file for a folder), or whose nearest existing
    parent cannot take a new file (a file, read-only, ``/proc``): probed with an unnamed
    temporary file. The path is checked as given, as the writers use it (a quoted ``~``
    is a folder named ``~``, not the home folder).

    Raises:
        ConfigError: naming the flag, the path and the fix.
    """
    import tempfile

    if not path:
        return
    p = Path(path).resolve()
    for src in inputs:
        if not src or not Path(src).exists():
            continue          # a model alias, or an input the command reports itself
        src = Path(src).resolve()
        if p == src or (src.is_dir() and src in p.parents):
            raise ConfigError(f"refusing to write {flag} {path}: it is or lies inside the "
                              f"input {src}", f"write {flag} outside the input folder")
    if folder and p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a folder", f"pass a folder to {flag}")
    if not folder and (p.is_dir() or str(path).endswith(("/", os.sep))):
        raise ConfigError(f"{flag} {path} names a folder", f"pass a file path, e.g. {flag} out.json")
    parent = p if folder and p.is_dir() else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        if not parent.is_dir():
            raise OSError(f"{parent} is not a folder")
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be written ({e})",
                          f"pass a path in a writable folder to {flag}") from e


def _parse_pattern(pattern: Optional[str]) -> tuple[Optional[int], Optional[int]]:
    if not pattern:
        return None, None
    try:
        n, m = (int(x) for x in pattern.split(":"))
    except ValueError:
        raise ConfigError(f"--pattern {pattern!r} is not N:M", "use e.g. --pattern 2:4") from None
    return n, m


def _table(title: str, columns: list[str], rows: list[list[Any]]):
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        first = c == columns[0]   # names (e.g. device profiles) are never cut
        t.add_column(c, justify="left" if first else "right", no_wrap=first, overflow="fold")
    from ..pipeline import format_value

    for r in rows:
        t.add_row(*[format_value(v) for v in r])
    return t


def _parse_levels(items) -> dict:
    """``("down_proj=0", ...)`` -> ``{"down_proj": 0}``; raises ConfigError on a bad item."""
    out = {}
    for it in items or ():
        k, sep, v = str(it).partition("=")
        if not sep or not k or not v.strip().isdigit():
            raise ConfigError(f"--accuracy-level-for {it!r} is not SUFFIX=LEVEL",
                              "pass e.g. --accuracy-level-for down_proj=0")
        out[k.strip()] = int(v)
    return out


def method_options(f):
    """Options shared by ``run`` and ``compress``."""
    opts = [
        click.option("--method", type=_MethodChoice(), default=None,
                     help="Compression method (default for run: the best-w4 preset, GPTQ int4 g64 with 8-bit v_proj and first-layer down_proj)."),
        click.option("--recipe", type=click.Path(dir_okay=False), default=None,
                     help="TOML/YAML recipe file chaining methods, or a preset name such as best-w4 (it fixes the method and its settings: not with --method, --bits, --group-size, --sym, --sparsity or --pattern)."),
        click.option("--bits", type=int, default=None, help="Quantization bits: 2, 3, 4 or 8."),
        click.option("--group-size", type=int, default=None, help="Quantization group size (-1 = per row)."),
        click.option("--sym/--asym", default=None, help="Symmetric or asymmetric grid."),
        click.option("--sparsity", type=float, default=None, help="Unstructured sparsity in [0, 1)."),
        click.option("--pattern", default=None, help="N:M sparsity, e.g. 2:4 (prune_n:prune_m)."),
        click.option("--calib", default=None,
                     help="Calibration text: .txt/.jsonl/.parquet file, hf:NAME, or 'self' (text sampled "
                          "from the model), or 'default' (the embedded text) (default: run 'self', compress 'default')."),
        click.option("--nsamples", type=int, default=None,
                     help="Calibration windows (default: run 32, compress 128)."),
        click.option("--seqlen", type=int, default=512, show_default=True, help="Tokens per calibration window."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--device", default="cpu", show_default=True, help="cpu or cuda."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f

