"""Where a step's time goes, per operator type, from onnxruntime's own profiler.

onnxruntime writes a Chrome-trace JSON when ``SessionOptions.enable_profiling`` is set
(``runtime.load(..., profile_prefix=...)``): one ``model_run`` event per ``run()`` (``ts``,
``dur`` in microseconds) and one ``<node>_kernel_time`` event per node executed, with its
``op_name``. :func:`op_breakdown` assigns the node events to the runs they fall in and sums
them by operator type, for the decode steps and the prefill of one generation.

The profiler's own bookkeeping slows each node a little, so a profiled step is longer than
a timed one: read the shares, not the absolute figures, and take speeds from the timed
runs. Pure Python (``json``, ``statistics``): the same parser reads a peer's trace
(onnxruntime-genai writes the same format), which is how ``bench/compare_runtimes.py --ops``
puts both graphs side by side. ``report.format_ops`` renders it as a table.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Union

from edgeprune_runtime.errors import DeviceError


def _events(trace) -> list:
    if isinstance(trace, (str, Path)):
        try:
            data = json.loads(Path(trace).read_text())
        except (OSError, ValueError) as e:
            raise DeviceError(f"cannot read the onnxruntime profile {trace}: {e}",
                              "profile again; the trace is written when the session ends profiling") from e
    else:
        data = trace
    if isinstance(data, dict):                      # {"traceEvents": [...]} form
        data = data.get("traceEvents", [])
    if not isinstance(data, list):
        raise DeviceError(f"the onnxruntime profile holds {type(data).__name__}, not a list of events",
                          "pass the JSON file onnxruntime's profiler wrote")
    return [e for e in data if isinstance(e, dict)]


def _tally(runs: list, nodes: list) -> dict:
    """Per-op-type sums over ``runs`` (each ``(ts, dur)``), ``nodes`` ``(ts, dur, op)`` sorted by ``ts``."""
    by, count = defaultdict(float), defaultdict(int)
    j = 0
    for ts, dur in runs:
        while j < len(nodes) and nodes[j][0] < ts:
            j += 1
        while j < len(nodes) and nodes[j][0] <= ts + dur:
            _, d, op = nodes[j]
            by[op] += d
            count[op] += 1
            j += 1
    n = max(len(runs), 1)
    mean = sum(d for _, d in runs) / n
    in_nodes = sum(by.values()) / n
    ops = [{"op": op, "us_per_run": by[op] / n, "nodes_per_run": count[op] / n,
            "share": by[op] / (mean * n) if mean > 0 else 0.0}
           for op in sorted(by, key=lambda o: -by[o])]
    return {"runs": len(runs), "run_us_median": statistics.median(d for _, d in runs) if runs else 0.0,
            "run_us_mean": mean, "nodes_us_per_run": in_nodes, "outside_nodes_us_per_run": mean - in_nodes,
            "ops": ops}


def op_breakdown(trace: Union[str, Path, list, dict], decode_steps: int) -> dict:
    """Time per operator type of the last generation in an onnxruntime profile trace.

    The trace's last ``decode_steps`` ``model_run`` events are taken as that generation's
    decode steps (one new token each, batch 1) and the run before them as its prefill;
    earlier runs (a warm-up) are ignored.

    Args:
        trace: the JSON file onnxruntime's profiler wrote, or its parsed events.
        decode_steps: decode steps of the last generation (``max_new_tokens - 1`` for a
            greedy generation without prompt lookup).

    Returns:
        ``{"decode": T, "prefill": T}`` where ``T`` is ``{"runs", "run_us_median",
        "run_us_mean", "nodes_us_per_run", "outside_nodes_us_per_run", "ops": [{"op",
        "us_per_run", "nodes_per_run", "share"}]}`` (microseconds per run; ``share``: of
        the mean run time; ops sorted by time, longest first). ``prefill`` is ``None``
        when the trace has no run before the decode steps.

    Raises:
        DeviceError: an unreadable trace, ``decode_steps < 1``, or fewer runs than
            ``decode_steps``.
    """
    if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or decode_steps < 1:
        raise DeviceError(f"decode_steps must be an integer >= 1, got {decode_steps!r}",
                          "profile a generation of at least 2 new tokens")
    ev = _events(trace)
    runs = sorted(((float(e["ts"]), float(e["dur"])) for e in ev
                   if e.get("cat") == "Session" and e.get("name") == "model_run"
                   and "ts" in e and "dur" in e), key=lambda r: r[0])
    if len(runs) < decode_steps:
        raise DeviceError(f"the profile holds {len(runs)} runs, fewer than the {decode_steps} decode "
                          "steps asked for", "profile the whole generation (enable profiling before "
                                             "the session is built, end it after the generation)")
    nodes = sorted((float(e["ts"]), float(e.get("dur", 0)), (e.get("args") or {}).get("op_name") or "?")
                   for e in ev if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")
                   and "ts" in e)
    dec = runs[-decode_steps:]
    pre = runs[-decode_steps - 1:-decode_steps] if len(runs) > decode_steps else []
    return {"decode": _tally(dec, nodes), "prefill": _tally(pre, nodes) if pre else None}


__all__ = ["op_breakdown"]
