"""Helpers for tests of the output claim: another process that holds one, or died."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]


def python_child(code: str) -> subprocess.Popen:
    """A child Python running ``code`` with this checkout's packages importable."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@contextmanager
def claim_held_elsewhere(out) -> Iterator[int]:
    """Another process holds the claim on ``out`` (as a running ``edgeprune compress``
    would) until the block ends; yields its pid."""
    holder = python_child(f"""
        import sys
        from edgeprune_runtime.files import OutputClaim
        claim = OutputClaim({str(out)!r}).acquire()
        print("held", flush=True)
        sys.stdin.read()
        claim.release()
    """)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        yield holder.pid
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert holder.returncode == 0, holder.stderr.read()
