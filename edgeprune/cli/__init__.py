"""The ``edgeprune`` command line (click). It parses options and calls the Python API.

Verbs: ``run`` (the main job), ``compress``, ``eval``, ``study``, ``export``, ``leank``, ``generate``,
``profile``, ``devices``; one module per verb. Every verb that measures something takes
``--json PATH``. Errors print one line (``error: ... (fix: ...)``) and exit with code 2;
nothing half-written is left behind.
"""

from __future__ import annotations

from . import compress, evaluate, export, generate, leank, profile, run  # noqa: F401  (register verbs)
from . import study  # noqa: F401  (register the study verb)
from ._app import cli, main
from ._common import METHODS, _finite  # noqa: F401

__all__ = ["cli", "main"]

