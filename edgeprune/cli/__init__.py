"""The ``edgeprune`` command line (click). It parses options and calls the Python API.

Verbs: ``run`` (the main job), ``compress``, ``eval``, ``study``, ``export``, ``leank``, ``kvcache``, ``countdown``, ``igprune``,
``generate``, ``chat``, ``serve``, ``profile``, ``devices``; one module per verb. Every verb
that measures something takes ``--json PATH``. Errors print one line
(``error: ... (fix: ...)``) and exit with code 2; nothing half-written is left behind.
"""

from __future__ import annotations

from . import (chat, compress, countdown, evaluate, export, generate, igprune,  # noqa: F401
               kvcache, leank, profile, run, serve, study)  # (register verbs)
from ._app import cli, main
from ._common import METHODS, _finite  # noqa: F401

__all__ = ["cli", "main"]
