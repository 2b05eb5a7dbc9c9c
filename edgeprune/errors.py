"""Re-export of the shared exception hierarchy (defined in :mod:`runtime.errors`)."""

from edgeprune_runtime.errors import *  # noqa: F401,F403
from edgeprune_runtime.errors import __all__  # noqa: F401
