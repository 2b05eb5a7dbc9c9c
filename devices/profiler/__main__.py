"""``python -m edgeprune_devices.profiler --worker CFG.json OUT.json``: the profiler's measuring worker.

Started by :func:`devices.profiler.measure.run_worker` in a fresh process; use
``edgeprune profile`` (or :func:`devices.profiler.profile`) rather than calling it by hand.
"""

import sys

from .measure import worker_main

if len(sys.argv) == 4 and sys.argv[1] == "--worker":
    sys.exit(worker_main(sys.argv[2:]))
print("usage: python -m edgeprune_devices.profiler --worker CFG.json OUT.json  (use `edgeprune profile` instead)")
sys.exit(2)
