"""Device profiles, host measurement and roofline projection.

* :mod:`devices.catalog`: :class:`DeviceProfile`, read from the TOML files in
  ``devices/profiles/`` (:func:`load_profile`, :func:`list_profiles`).
* :mod:`devices.host`: this machine's bandwidth and compute (:func:`measure_host`).
* :mod:`devices.roofline`: a host measurement projected to a target (:func:`project`).
* :mod:`devices.profiler`: measure an export on this host and project it
  (``devices.profiler.profile``; imported on demand, it needs ``onnx`` and draws with
  ``matplotlib``).
* :mod:`devices.arm64_check`: the ARM64 numerics check under QEMU.

This package imports only ``runtime`` (never torch, edgeprune or exporters); ``runtime``
never imports it.
"""

from __future__ import annotations

from .catalog import (CLASSES, DEFAULT_BANDWIDTH_EFFICIENCY, DEFAULT_COMPUTE_EFFICIENCY, PROFILE_DIR,
                      DeviceProfile, list_profiles, load_profile)
from .host import measure_bandwidth, measure_host
from .roofline import Projection, project, roofline_seconds

__all__ = ["DeviceProfile", "Projection", "PROFILE_DIR", "CLASSES", "DEFAULT_BANDWIDTH_EFFICIENCY",
           "DEFAULT_COMPUTE_EFFICIENCY", "list_profiles", "load_profile", "measure_host", "measure_bandwidth",
           "project", "roofline_seconds"]
