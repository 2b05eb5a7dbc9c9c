"""Device profiles: the :class:`DeviceProfile` record, read and checked from TOML files.

Each target is one small TOML file in ``devices/profiles/``: its class
(host / mobile / laptop / gpu), the onnxruntime execution provider and thread count
to run with, a memory budget, the memory bandwidth and the peak int8 / fp32 compute,
and where those figures come from. The ``cpu-host`` profile says ``"measure"`` /
``"auto"`` for its figures: they are measured on this machine when the profile is
loaded with ``measure=True`` (:func:`devices.host.measure_host`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from edgeprune_runtime.errors import DeviceError

from .host import measure_host

try:  # Python >= 3.11
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as _toml  # type: ignore[no-redef]

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
    """The names of the shipped profiles (``devices/profiles/*.toml`` stems)."""
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
    """The profile in a parsed TOML file ``raw`` (read from ``path``), its fields checked.

    Raises:
        DeviceError: a missing, unknown or out-of-range field, naming it and the fix.
    """
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



__all__ = ["DeviceProfile", "PROFILE_DIR", "CLASSES", "DEFAULT_BANDWIDTH_EFFICIENCY",
           "DEFAULT_COMPUTE_EFFICIENCY", "list_profiles", "load_profile"]
