"""Roofline projection: a time measured on the host carried over to a target device.

The roofline model (Williams, Waterman & Patterson, "Roofline: an insightful visual
performance model", CACM 2009) bounds the time of one step below by
``max(bytes / bandwidth, ops / peak_compute)``. A real runtime reaches only part of that
bound, so the bound on the target is divided by the *efficiency measured on the host*
(host roofline time / host measured time):

    t_target = max(B / BW_t, F / C_t) * (t_host_measured / max(B / BW_h, F / C_h))

This is an estimate, labelled "projected" everywhere it is shown; it assumes the
target runs the same graph with the same efficiency relative to its roofline.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from edgeprune_runtime.errors import DeviceError

from .catalog import DeviceProfile


def roofline_seconds(profile: DeviceProfile, bytes_moved: float, ops: float, compute: str = "fp32") -> tuple[float, str]:
    """Roofline lower bound on the time of a step: ``max(bytes / bandwidth, ops / peak)``.

    Args:
        profile: the device.
        bytes_moved: DRAM bytes the step reads/writes (weights + KV cache for a decode step).
        ops: arithmetic operations of the step (2 per multiply-accumulate).
        compute: ``"fp32"`` or ``"int8"``: which peak applies.

    Returns:
        ``(seconds, bound)`` with ``bound`` = ``"memory"`` or ``"compute"``.

    Raises:
        DeviceError: the profile has no bandwidth/compute figure (host not measured).
    """
    bw = profile.bandwidth_gbs * 1e9
    peak = profile.peak_ops(compute)
    if bw <= 0 or peak <= 0:
        raise DeviceError(f"profile {profile.name!r} has no bandwidth/compute figures",
                          "load it with measure=True (host profiles are measured at profile time)")
    t_mem, t_ops = bytes_moved / bw, ops / peak
    return (t_mem, "memory") if t_mem >= t_ops else (t_ops, "compute")


@dataclasses.dataclass
class Projection:
    """A projected (not measured) per-token time on a target device.

    Attributes:
        target: target profile name.
        seconds_per_token: projected seconds per token.
        tokens_per_s: ``1 / seconds_per_token``.
        bound: ``"memory"`` or ``"compute"``: the binding roofline term on the target.
        host_efficiency: host roofline time / host measured time (0..1, higher is better).
        host_roofline_s, target_roofline_s: the two roofline bounds (seconds per token).
    """

    target: str
    seconds_per_token: float
    tokens_per_s: float
    bound: str
    host_efficiency: float
    host_roofline_s: float
    target_roofline_s: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict."""
        return dataclasses.asdict(self)


def project(measured: float, host_profile: DeviceProfile, target_profile: DeviceProfile,
            model_bytes_per_token: float, flops_per_token: float, compute: str = "fp32") -> Projection:
    """Project a time measured on the host to a target with the roofline model.

    Args:
        measured: seconds per token measured on the host (e.g. median decode step).
        host_profile: the host's profile with measured bandwidth/compute.
        target_profile: the device to project to.
        model_bytes_per_token: DRAM bytes per token (decode: weight bytes + KV bytes read;
            prefill: weight bytes / prompt length + activations).
        flops_per_token: arithmetic ops per token (about 2 x parameters + attention).
        compute: ``"fp32"`` or ``"int8"`` peak to use on both devices.

    Returns:
        :class:`Projection`: ``t = roofline_target * measured / roofline_host``
        (the host's efficiency relative to its roofline carried over to the target; the
        target's spec-sheet peaks first scaled by its ``bandwidth_efficiency`` /
        ``compute_efficiency``, since the host's roofline uses measured figures).

    Raises:
        DeviceError: non-positive measured time or inputs; a profile without figures.
    """
    if not measured or measured <= 0 or model_bytes_per_token < 0 or flops_per_token < 0:
        raise DeviceError(f"cannot project from measured={measured!r}, bytes={model_bytes_per_token!r}, "
                          f"ops={flops_per_token!r}", "pass a positive measured time and non-negative work")
    host_t, _ = roofline_seconds(host_profile, model_bytes_per_token, flops_per_token, compute)
    tgt_t, bound = roofline_seconds(target_profile.sustained(), model_bytes_per_token, flops_per_token,
                                    compute)
    eff = host_t / measured
    t = tgt_t / eff if eff > 0 else float("inf")
    return Projection(target=target_profile.name, seconds_per_token=t, tokens_per_s=1.0 / t, bound=bound,
                      host_efficiency=eff, host_roofline_s=host_t, target_roofline_s=tgt_t)


__all__ = ["Projection", "project", "roofline_seconds"]
