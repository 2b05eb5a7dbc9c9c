"""Device profiles and roofline projection.

Each target is one small TOML file in ``devices/profiles/``: its class
(host / mobile / laptop / gpu), the onnxruntime execution provider and thread count
to run with, a memory budget, the memory bandwidth and the peak int8 / fp32 compute,
and where those figures come from. The ``cpu-host`` profile says ``"measure"`` /
``"auto"`` for its figures: they are measured on this machine when the profile is
loaded with ``measure=True`` (:func:`measure_host`).

Projection (:func:`project`) uses the roofline model (Williams, Waterman & Patterson,
"Roofline: an insightful visual performance model", CACM 2009): the time of one step
is bounded below by ``max(bytes / bandwidth, ops / peak_compute)``. A real runtime
reaches only part of that bound, so the bound on the target is divided by the
*efficiency measured on the host* (host roofline time / host measured time):

    t_target = max(B / BW_t, F / C_t) * (t_host_measured / max(B / BW_h, F / C_h))

This is an estimate, labelled "projected" everywhere it is shown; it assumes the
target runs the same graph with the same efficiency relative to its roofline.

This package imports only ``runtime`` (never torch or edgeprune).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import DeviceError

try:  # Python >= 3.11
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as _toml  # type: ignore[no-redef]

__all__ = ["DeviceProfile", "Projection", "PROFILE_DIR", "list_profiles", "load_profile", "measure_host",
           "measure_bandwidth", "project", "roofline_seconds"]

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
CLASSES = ("host", "mobile", "laptop", "gpu")
_PROVIDERS = ("CPUExecutionProvider", "CUDAExecutionProvider", "CoreMLExecutionProvider",
              "QNNExecutionProvider", "NnapiExecutionProvider", "XnnpackExecutionProvider",
              "TensorrtExecutionProvider", "DmlExecutionProvider")
MiB = 1024 * 1024


@dataclasses.dataclass
class DeviceProfile:
    """One target device.

    Attributes:
        name: short id (the TOML file's stem), e.g. ``"raspberry-pi-5"``.
        device_class: ``host`` | ``mobile`` | ``laptop`` | ``gpu``.
        execution_provider: onnxruntime provider to run with (``CPUExecutionProvider``...).
        threads: intra-op threads to run with.
        memory_budget_bytes: the most resident memory a run may use (bytes).
        bandwidth_gbs: DRAM bandwidth, GB/s (1e9 bytes/s).
        peak_int8_gops: peak int8 multiply-accumulate throughput, 1e9 ops/s (1 MAC = 2 ops).
        peak_fp32_gflops: peak fp32 throughput, 1e9 FLOP/s (1 FMA = 2 FLOP).
        source: where the figures come from (spec sheets / URLs / "measured on this host").
        description: one line naming the hardware.
        notes: derivation of the figures.
        measured: True when bandwidth/compute were measured here rather than read.
        path: the TOML file it was read from.
        bandwidth_efficiency: the share of ``bandwidth_gbs`` a STREAM-style copy sustains
            (TOML ``bandwidth_efficiency``; default :data:`DEFAULT_BANDWIDTH_EFFICIENCY`
            for spec-sheet figures, 1 for measured ones). Projections compare like with
            like: the host's figures are measured, so a target's theoretical peaks are
            scaled down to what the same measurement would find there.
        compute_efficiency: the same for the compute peaks (a GEMM through onnxruntime vs
            the cores x clock x SIMD peak; default :data:`DEFAULT_COMPUTE_EFFICIENCY`).
        kernel_launch_us: per-operator dispatch floor in microseconds (GPU profiles, TOML
            ``kernel_launch_us``): a decode step takes at least ``nodes x`` this.
    """

    name: str
    device_class: str
    execution_provider: str
    threads: int
    memory_budget_bytes: int
    bandwidth_gbs: float
    peak_int8_gops: float
    peak_fp32_gflops: float
    source: str
    description: str = ""
    notes: str = ""
    measured: bool = False
    path: str | None = None
    raw: dict = dataclasses.field(default_factory=dict, repr=False)
    bandwidth_efficiency: float = 1.0
    compute_efficiency: float = 1.0
    kernel_launch_us: float = 0.0

    @property
    def is_host(self) -> bool:
        """True for the profile of the machine we run on (figures measured here)."""
        return self.device_class == "host"

    def peak_ops(self, compute: str = "fp32") -> float:
        """Peak ops/s for ``compute`` = ``"fp32"`` or ``"int8"`` (ops per second, not G)."""
        if compute == "int8":
            return self.peak_int8_gops * 1e9
        if compute == "fp32":
            return self.peak_fp32_gflops * 1e9
        raise DeviceError(f"unknown compute type {compute!r}", "use 'fp32' or 'int8'")

    def sustained(self) -> "DeviceProfile":
        """This profile with its bandwidth and compute scaled to what a measurement would
        sustain (``bandwidth_efficiency``, ``compute_efficiency``; measured profiles are
        returned as they are)."""
        if self.measured or (self.bandwidth_efficiency == 1.0 and self.compute_efficiency == 1.0):
            return self
        return dataclasses.replace(
            self, bandwidth_gbs=self.bandwidth_gbs * self.bandwidth_efficiency,
            peak_int8_gops=self.peak_int8_gops * self.compute_efficiency,
            peak_fp32_gflops=self.peak_fp32_gflops * self.compute_efficiency,
            bandwidth_efficiency=1.0, compute_efficiency=1.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (without the raw TOML)."""
        d = dataclasses.asdict(self)
        d.pop("raw")
        d["memory_budget_mb"] = round(self.memory_budget_bytes / MiB, 1)
        for k in ("bandwidth_gbs", "peak_int8_gops", "peak_fp32_gflops"):
            if self.raw.get(k) == "measure" and not self.measured:
                d[k] = None           # to be measured at profile time, not a figure of 0
        return d


def _known_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def list_profiles(measure: bool = False) -> list[DeviceProfile]:
    """Every profile shipped in ``devices/profiles``, sorted by class then name.

    Args:
        measure: measure the host's figures now (about 2 s); otherwise the host
            profile shows 0 for figures that are measured at profile time.
    """
    profs = [load_profile(n, measure=measure) for n in _known_names()]
    return sorted(profs, key=lambda p: (CLASSES.index(p.device_class), p.name))


def load_profile(name_or_path: str | os.PathLike | DeviceProfile, measure: bool = True) -> DeviceProfile:
    """Load a profile by name (``"raspberry-pi-5"``) or from a ``.toml`` path.

    Args:
        name_or_path: a profile name, a path to a TOML file, or a DeviceProfile (returned as is).
        measure: for a profile with ``"measure"`` / ``"auto"`` fields (the host),
            measure them on this machine (:func:`measure_host`); when False they are 0.

    Raises:
        DeviceError: unknown name (the message lists the known ones), unreadable TOML,
            missing/invalid fields.
    """
    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    s = str(name_or_path)
    path = Path(s) if s.endswith(".toml") else PROFILE_DIR / f"{s}.toml"
    if not path.is_file():
        raise DeviceError(f"unknown device profile {s!r}; known: {', '.join(_known_names())}",
                          "pick one of the known names (`edgeprune devices`) or pass a path to a .toml profile")
    try:
        raw = _toml.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DeviceError(f"cannot read device profile {path}: {e}", "fix the TOML syntax") from e
    return _from_dict(raw, path, measure)


#: Share of a spec-sheet DRAM bandwidth a STREAM-style copy sustains when a profile does
#: not say (``bandwidth_efficiency``): STREAM typically reaches 60-80 % of the
#: theoretical peak on desktop and server parts and less on phones (McCalpin, STREAM
#: results, cs.virginia.edu/stream); 0.6 is the low end. This host: 12-19 GB/s copy.
DEFAULT_BANDWIDTH_EFFICIENCY = 0.6
#: Share of a cores x clock x SIMD compute peak that an onnxruntime GEMM sustains when a
#: profile does not say (``compute_efficiency``): an assumption, stated as one.
DEFAULT_COMPUTE_EFFICIENCY = 0.5


def _from_dict(raw: dict, path: Path, measure: bool) -> DeviceProfile:
    required = ("name", "class", "execution_provider", "threads", "memory_budget_mb", "bandwidth_gbs",
                "peak_int8_gops", "peak_fp32_gflops", "source")
    missing = [k for k in required if k not in raw]
    if missing:
        raise DeviceError(f"device profile {path} lacks {', '.join(missing)}",
                          f"add them; see {PROFILE_DIR / 'raspberry-pi-5.toml'} for an example")
    known = set(required) | {"description", "notes", "bandwidth_efficiency", "compute_efficiency",
                             "kernel_launch_us"}
    unknown = sorted(set(raw) - known)
    if unknown:         # a misspelt figure would otherwise be dropped for a default
        raise DeviceError(f"device profile {path}: unknown field(s) {', '.join(unknown)}",
                          f"use only {', '.join(sorted(known))}")
    cls = raw["class"]
    if cls not in CLASSES:
        raise DeviceError(f"device profile {path}: class {cls!r} is not one of {CLASSES}", "fix 'class'")
    if raw["execution_provider"] not in _PROVIDERS:
        raise DeviceError(f"device profile {path}: unknown execution_provider {raw['execution_provider']!r}",
                          f"use one of {', '.join(_PROVIDERS)}")
    words = {"threads": ("auto",), "memory_budget_mb": ("auto",), "bandwidth_gbs": ("measure",),
             "peak_int8_gops": ("measure",), "peak_fp32_gflops": ("measure",)}
    for k, allowed in words.items():
        v = raw[k]
        if isinstance(v, str) and v in allowed:
            continue
        whole = k == "threads"
        if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)) or \
                (whole and v < 1) or (not whole and not 0 < v < math.inf):
            raise DeviceError(f"device profile {path}: {k} = {v!r} is not "
                              + ("a whole number >= 1" if whole else "a positive finite number"),
                              f"give {'a whole number' if whole else 'a number'} or "
                              + " / ".join(f'"{w}"' for w in allowed))
    wants = [k for k in words if isinstance(raw[k], str)]
    measured_here = [k for k in wants if raw[k] == "measure"]
    if measured_here and cls != "host":
        raise DeviceError(f"device profile {path}: {', '.join(measured_here)} = \"measure\" but class "
                          f"{cls!r} is not this machine", "give the target's figures (spec sheet) or "
                          "class = \"host\" for the machine the profile runs on")
    extra = {}
    for k, span in (("bandwidth_efficiency", "(0, 1]"), ("compute_efficiency", "(0, 1]"),
                    ("kernel_launch_us", "[0, 1e6]")):
        if k in raw:
            v = raw[k]
            fits = isinstance(v, (int, float)) and not isinstance(v, bool) and \
                (0 < v <= 1 if span == "(0, 1]" else 0 <= v <= 1e6)
            if not fits:
                raise DeviceError(f"device profile {path}: {k} = {v!r} is out of range {span}", "fix the figure")
            extra[k] = float(v)
    host: dict[str, float] = {}
    threads = raw["threads"]
    if threads == "auto":
        threads = os.cpu_count() or 1
    if measure and any(k in wants for k in ("bandwidth_gbs", "peak_int8_gops", "peak_fp32_gflops")):
        host = measure_host(int(threads))
    budget = raw["memory_budget_mb"]
    if budget == "auto":
        import psutil
        budget_bytes = int(psutil.virtual_memory().total // 2)  # half the machine's RAM
    else:
        budget_bytes = int(float(budget) * MiB)
    values = {}
    for k in ("bandwidth_gbs", "peak_int8_gops", "peak_fp32_gflops"):
        v = raw[k]
        values[k] = float(host.get(k, 0.0)) if isinstance(v, str) else float(v)
    if budget_bytes <= 0:           # the numbers were checked above; a budget can round to 0
        raise DeviceError(f"device profile {path}: memory_budget_mb must be positive", "fix the figure")
    if cls != "host":      # spec-sheet peaks: what a measurement would sustain
        extra.setdefault("bandwidth_efficiency", DEFAULT_BANDWIDTH_EFFICIENCY)
        extra.setdefault("compute_efficiency", DEFAULT_COMPUTE_EFFICIENCY)
    return DeviceProfile(name=str(raw["name"]), device_class=cls, execution_provider=raw["execution_provider"],
                         threads=int(threads), memory_budget_bytes=budget_bytes, source=str(raw["source"]),
                         description=str(raw.get("description", "")), notes=str(raw.get("notes", "")),
                         measured=bool(host), path=str(path), raw=raw, **values, **extra)


# -- host measurement ----------------------------------------------------------------------------

def measure_bandwidth(threads: int = 1, size_mb: int = 128, repeat: int = 5) -> float:
    """Memory copy bandwidth of this machine, GB/s (1e9 bytes/s), best of ``repeat``.

    Each of ``threads`` threads copies its own slice of a ``size_mb`` MiB float32
    buffer with ``numpy.copyto`` (which releases the GIL); bytes moved count the read
    and the write (2 x size), as STREAM's "Copy" kernel does (McCalpin 1995).
    The buffer is much larger than any cache, so this is DRAM bandwidth.
    """
    threads = max(1, int(threads))
    n = size_mb * MiB // 4
    src = np.ones(n, dtype=np.float32)
    dst = np.empty_like(src)
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)
    slices = [(slice(bounds[i], bounds[i + 1])) for i in range(threads)]

    def _copy(s):
        np.copyto(dst[s], src[s])

    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(_copy, slices))  # warm-up: page faults
        for _ in range(repeat):
            t0 = time.perf_counter()
            list(ex.map(_copy, slices))
            best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def _measure_fp32_gflops(threads: int, n: int = 768, repeat: int = 5) -> float:
    """fp32 GEMM throughput through onnxruntime (MatMul, ``threads`` intra-op threads)."""
    x = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    sess = _ort_matmul_session("MatMul", "float", n, threads)
    return _time_session(sess, {"A": x, "B": x}, 2 * n ** 3, repeat)


def _measure_int8_gops(threads: int, n: int = 768, repeat: int = 5) -> float:
    """int8 GEMM throughput through onnxruntime (MatMulInteger u8 x s8 -> s32)."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 255, (n, n), dtype=np.uint8)
    b = rng.integers(-127, 127, (n, n), dtype=np.int8)
    sess = _ort_matmul_session("MatMulInteger", "int8", n, threads)
    return _time_session(sess, {"A": a, "B": b}, 2 * n ** 3, repeat)


def _ort_matmul_session(op: str, kind: str, n: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    ta = TensorProto.FLOAT if kind == "float" else TensorProto.UINT8
    tb = TensorProto.FLOAT if kind == "float" else TensorProto.INT8
    to = TensorProto.FLOAT if kind == "float" else TensorProto.INT32
    g = helper.make_graph([helper.make_node(op, ["A", "B"], ["Y"])], "mm",
                          [helper.make_tensor_value_info("A", ta, [n, n]), helper.make_tensor_value_info("B", tb, [n, n])],
                          [helper.make_tensor_value_info("Y", to, [n, n])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _time_session(sess, feeds, ops, repeat) -> float:
    sess.run(None, feeds)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        best = min(best, time.perf_counter() - t0)
    return ops / best / 1e9


@functools.lru_cache(maxsize=8)
def measure_host(threads: int) -> dict[str, float]:
    """Measure this machine: DRAM copy bandwidth (GB/s) and onnxruntime GEMM peaks.

    Returns ``{"bandwidth_gbs", "peak_fp32_gflops", "peak_int8_gops", "threads", "seconds"}``.
    Cached per thread count for the life of the process. Figures are noisy on a
    shared machine: they are the best of a few repeats.
    """
    t0 = time.perf_counter()
    out: dict[str, float] = {"threads": threads, "bandwidth_gbs": measure_bandwidth(threads)}
    try:
        out["peak_fp32_gflops"] = _measure_fp32_gflops(threads)
        out["peak_int8_gops"] = _measure_int8_gops(threads)
    except ImportError:  # onnx missing: fall back to numpy's BLAS for fp32, no int8 figure
        n = 768
        x = np.ones((n, n), np.float32)
        x @ x
        t1 = time.perf_counter()
        x @ x
        out["peak_fp32_gflops"] = 2 * n ** 3 / (time.perf_counter() - t1) / 1e9
        out["peak_int8_gops"] = out["peak_fp32_gflops"]
    out["seconds"] = time.perf_counter() - t0
    return out


# -- roofline projection ----------------------------------------------------------------------------

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
