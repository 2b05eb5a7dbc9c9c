"""Measure an exported folder on this machine and project it to device profiles.

:func:`profile` answers "how fast, and how much memory, on my device?":

* **measured** (on this host, with the profile's thread count and memory budget):
  time to first token, prefill tokens/s, decode tokens/s (median and p90 over every
  decode step of ``repeat`` runs), peak RSS, weights bytes, KV-cache bytes (K and V)
  at the final length. The run happens in a fresh subprocess that imports only the
  runtime (``python -m edgeprune_devices.profiler --worker``), so peak RSS is what an app
  embedding the runtime would see, not the caller's torch. A sampling thread kills
  the run as soon as RSS exceeds the profile's budget and :func:`profile` raises
  :class:`~runtime.errors.DeviceError`.
* **projected** (for targets not at hand): the roofline model of ``devices.project``
  (bytes moved and operations per token vs the target's bandwidth and compute,
  scaled by the efficiency measured on the host), always labelled "projected".
* **sweep**: decode latency and memory vs context length, drawn to a PNG.

Outputs: :meth:`ProfileReport.to_json`, :meth:`ProfileReport.to_markdown`,
:meth:`ProfileReport.plot`.

One module per concern: :mod:`~devices.profiler.run` (the entry point),
:mod:`~devices.profiler.measure` (the worker, its RSS watchdog, GPU availability),
:mod:`~devices.profiler.work` (bytes and operations per token, read from the graph with
``onnx``), :mod:`~devices.profiler.report` (JSON, Markdown, matplotlib plot),
:mod:`~devices.profiler.project` (roofline projection to targets). ``import edgeprune_runtime``
loads none of it; ``onnx`` and ``matplotlib`` are imported only where they are used.
"""

from __future__ import annotations

from .measure import gpu_availability
from .report import ProfileReport
from .run import DEFAULT_SWEEP, check_profile_args, profile
from .work import model_work

__all__ = ["profile", "ProfileReport", "model_work", "gpu_availability", "check_profile_args",
           "DEFAULT_SWEEP"]
