"""Helpers every command shares: console, JSON output, output-path checks, tables and the
compression options of ``run`` and ``compress``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import click

from edgeprune_runtime.errors import ConfigError
from edgeprune_runtime.files import FILE_OUTPUT, FOLDER_OUTPUT, check_output, write_json
from edgeprune_runtime.files import json_ready as _finite  # noqa: F401 - edgeprune.cli._finite


class _RegisteredMethods(Sequence):
    """The compression method names of the registry (:func:`edgeprune.methods.method_names`),
    read on each use: the registry imports torch, the CLI's start does not."""

    def _names(self) -> tuple:
        from ..methods import METHODS, method_names

        # a model-scope stage (e2e-qp) tunes what an earlier stage quantized: recipes only
        return tuple(n for n in method_names() if not METHODS[n].model_scope)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(list(self._names()))


#: The ``--method`` choices: every registered compression method that runs alone (not
#: the model-scope ``e2e-qp``, which follows a quantizer in a recipe).
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
    """Write ``data`` as JSON to ``path`` atomically (:func:`runtime.files.write_json`:
    non-finite floats as ``"inf"`` / ``"-inf"`` / ``"nan"``, numpy values as numbers);
    nothing without a path."""
    if path:
        write_json(Path(path), data)


def _check_output(path: Optional[str], flag: str, inputs=(), folder: bool = False) -> None:
    """Refuse, before any work, an output path (``--json`` file, ``--out`` folder the
    command adds files to) that is or lies in an input folder (or is an input file), has
    the wrong kind (a folder for a file, a file for a folder), or whose nearest existing
    parent cannot take a new file (a file, read-only, ``/proc``): the one output guard,
    :func:`runtime.files.check_output`. The path is checked as given, as the writers use
    it (a quoted ``~`` is a folder named ``~``, not the home folder).

    Raises:
        ConfigError: naming the flag, the path and the fix.
    """
    if path:
        check_output(path, FOLDER_OUTPUT if folder else FILE_OUTPUT, inputs=inputs,
                     error=ConfigError, label=flag)


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


def describe_recipe(recipe: dict) -> str:
    """A recipe's ``to_dict()`` as one readable line: ``rtn (bits 4, group_size 64,
    asym, ignore lm_head)``, stages joined by `` -> `` (not a raw Python dict)."""
    parts = []
    for st in recipe.get("stages") or []:
        opts = []
        for k, v in st.items():
            if k in ("method", "targets", "ignore") or v is None or v is False and k != "sym":
                continue
            opts.append(("sym" if v else "asym") if k == "sym" else k if v is True else f"{k} {v}")
        for k in ("targets", "ignore"):
            if st.get(k):
                opts.append(f"{k} {', '.join(map(str, st[k]))}")
        parts.append(f"{st.get('method')} ({', '.join(opts)})" if opts else str(st.get("method")))
    return " -> ".join(parts) or str(recipe.get("name", "recipe"))


def apply_threads(threads: Optional[int]) -> None:
    """Use ``threads`` CPU threads for torch's intra-op work in this process: set at once
    when torch is imported, else through ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``, which
    torch reads when it is first imported. ``None`` leaves everything as it is.
    onnxruntime sessions get the same number through ``runtime.load(threads=...)``, which
    each verb passes."""
    if threads is None:
        return
    import os
    import sys

    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    else:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(int(threads))


def threads_option(default: Optional[int] = None, help: str = "CPU threads for torch and onnxruntime "
                   "(default: all cores)."):
    """The ``--threads N`` option every verb that computes shares: an integer >= 1 (or
    ``default``), applied to torch when parsed (:func:`apply_threads`) and passed to the
    command as ``threads`` for its onnxruntime sessions (``runtime.load(threads=...)``).
    ``--threads 0`` is refused with one :class:`ConfigError` before any work."""
    return click.option("--threads", type=int, default=default,
                        show_default=default is not None, help=help,
                        callback=_threads_callback)


def _threads_callback(ctx, param, value):
    if value is not None and value < 1:
        raise ConfigError(f"--threads {value} must be >= 1", "pass e.g. --threads 2, or omit it for all cores")
    apply_threads(value)
    return value


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
                          "from the model; 'self-multilingual' seeds each window with a prompt in one of twelve "
                          "languages, 'self-mixed' half of them, 'self-mixed-<pct>' pct % of them), or 'default' (the embedded text) (default: run 'self-multilingual', compress 'default')."),
        click.option("--nsamples", type=int, default=None,
                     help="Calibration windows (default: run 64, compress 128)."),
        click.option("--seqlen", type=int, default=512, show_default=True, help="Tokens per calibration window."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--device", default="cpu", show_default=True, help="cpu or cuda."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f

