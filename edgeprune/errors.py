"""Re-export of the shared exception hierarchy (defined in :mod:`runtime.errors`)."""

from runtime.errors import *  # noqa: F401,F403
from runtime.errors import __all__  # noqa: F401
