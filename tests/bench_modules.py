"""Bench code for the tests: ``bench/`` is not a package, so its files are loaded by path."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """The module ``bench/<name>.py``, freshly executed (not registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def peer_python(name: str, label: str | None = None) -> Path:
    """The python of the peer venv ``name`` (``benchlib.ensure_peer``, built on first use);
    skips the test, naming ``label`` (default ``name``), when it cannot be installed here."""
    try:
        return load_bench("benchlib").ensure_peer(name)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"{label or name} cannot be installed here: {e}")
