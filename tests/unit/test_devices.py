"""devices: the shipped profiles, loading errors, host measurement and roofline projection."""

from __future__ import annotations

import os

import pytest

import edgeprune_devices as devices
from edgeprune_devices import DeviceProfile, load_profile, project, roofline_seconds
from edgeprune_runtime.errors import DeviceError


def _prof(name, bw, fp32, int8=None, cls="mobile"):
    return DeviceProfile(name=name, device_class=cls, execution_provider="CPUExecutionProvider", threads=1,
                         memory_budget_bytes=1 << 30, bandwidth_gbs=bw, peak_int8_gops=int8 or 4 * fp32,
                         peak_fp32_gflops=fp32, source="test")


def test_shipped_profiles_cover_the_required_targets():
    profs = {p.name: p for p in devices.list_profiles(measure=False)}
    classes = [p.device_class for p in profs.values()]
    assert "cpu-host" in profs and profs["cpu-host"].device_class == "host"
    assert classes.count("mobile") >= 2 and "laptop" in classes
    assert {"snapdragon-8-gen3", "raspberry-pi-5", "apple-a17-pro", "ryzen-7-7840u"} <= set(profs)
    gpus = [p for p in profs.values() if p.device_class == "gpu"]
    assert gpus and all(p.execution_provider == "CUDAExecutionProvider" for p in gpus)
    for p in profs.values():
        assert p.source and p.threads >= 1 and p.memory_budget_bytes > 0
        if not p.is_host:  # published figures, each with its source named
            assert p.bandwidth_gbs > 0 and p.peak_fp32_gflops > 0 and p.peak_int8_gops >= p.peak_fp32_gflops
            assert "." in p.source  # names a site / document
    pi = profs["raspberry-pi-5"]
    assert (pi.bandwidth_gbs, pi.threads, pi.peak_fp32_gflops) == (17.1, 4, 154.0)
    assert pi.to_dict()["memory_budget_mb"] == 6144.0


def test_unknown_profile_lists_known_names():
    with pytest.raises(DeviceError) as e:
        load_profile("pixel-99")
    msg = str(e.value)
    assert "pixel-99" in msg and "raspberry-pi-5" in msg and "cpu-host" in msg and e.value.hint


def test_profile_from_path_and_validation(tmp_path):
    src = (devices.PROFILE_DIR / "raspberry-pi-5.toml").read_text()
    p = tmp_path / "my-board.toml"
    p.write_text(src.replace('name = "raspberry-pi-5"', 'name = "my-board"'))
    assert load_profile(str(p)).name == "my-board"
    p.write_text(src.replace('class = "mobile"', 'class = "toaster"'))
    with pytest.raises(DeviceError, match="toaster"):
        load_profile(p)
    p.write_text("\n".join(line for line in src.splitlines() if not line.startswith("bandwidth_gbs")))
    with pytest.raises(DeviceError, match="lacks bandwidth_gbs"):
        load_profile(p)
    for bad in ("0", "inf", "nan"):     # inf passed, and projected infinite speed
        p.write_text(src.replace("bandwidth_gbs = 17.1", f"bandwidth_gbs = {bad}"))
        with pytest.raises(DeviceError, match=f"bandwidth_gbs = {bad} is not a positive finite number"):
            load_profile(p)
    # values that used to pass and then crash (\"measure\" threads or budget) or be
    # silently truncated (2.7 threads -> 2, true -> 1)
    for old, new, needle in (("threads = 4", 'threads = "measure"', "threads = 'measure'"),
                             ("threads = 4", "threads = 2.7", "whole number"),
                             ("threads = 4", "threads = true", "whole number"),
                             ("memory_budget_mb = 6144", 'memory_budget_mb = "measure"', "memory_budget_mb"),
                             ("bandwidth_gbs = 17.1", 'bandwidth_gbs = "fast"', "bandwidth_gbs"),
                             ("threads = 4", "threads = 4\nbandwidth_efficiency = 1.5", "bandwidth_efficiency"),
                             ("threads = 4", "threads = 4\ncompute_efficiency = 0", "compute_efficiency"),
                             # misspelt fields used to be dropped for the defaults
                             ("threads = 4", "threads = 4\nbandwith_gbs = 5", "unknown field.*bandwith_gbs"),
                             # "measure" outside the host failed only after the measurement
                             ("bandwidth_gbs = 17.1", 'bandwidth_gbs = "measure"',
                              "bandwidth_gbs = \"measure\" but class 'mobile'")):
        p.write_text(src.replace(old, new))
        with pytest.raises(DeviceError, match=needle):
            load_profile(p)
    p.write_text("name = [unclosed")
    with pytest.raises(DeviceError, match="cannot read"):
        load_profile(p)


def test_host_profile_is_measured():
    host = load_profile("cpu-host")
    assert host.measured and host.threads == os.cpu_count()
    # Any real machine copies faster than 0.5 GB/s and slower than 2 TB/s.
    assert 0.5 < host.bandwidth_gbs < 2000
    assert host.peak_fp32_gflops > 0.5 and host.peak_int8_gops > 0.5
    assert not load_profile("cpu-host", measure=False).measured


def test_roofline_exact_values():
    p = _prof("p", bw=10.0, fp32=100.0, int8=400.0)
    assert roofline_seconds(p, 1e9, 1e9) == pytest.approx((0.1, "memory"))
    t, bound = roofline_seconds(p, 1e9, 1e11)
    assert (t, bound) == (pytest.approx(1.0), "compute")
    assert roofline_seconds(p, 1e9, 1e11, compute="int8") == pytest.approx((0.25, "compute"))
    with pytest.raises(DeviceError):
        roofline_seconds(p, 1, 1, compute="fp8")
    with pytest.raises(DeviceError, match="no bandwidth"):
        roofline_seconds(_prof("h", bw=0.0, fp32=1.0), 1, 1)


def test_projection_scales_spec_sheet_peaks_to_sustained():
    """A host's figures are measured (a copy, a GEMM); a target's are spec-sheet peaks:
    the projection scales them by the target's bandwidth/compute efficiency first."""
    import dataclasses
    host, target = _prof("host", bw=10.0, fp32=100.0), _prof("tgt", bw=40.0, fp32=100.0)
    half = dataclasses.replace(target, bandwidth_efficiency=0.5, compute_efficiency=0.25)
    assert project(0.2, host, half, 1e9, 1e9).seconds_per_token == pytest.approx(0.1)   # 2 x 0.05
    assert half.sustained().bandwidth_gbs == 20.0 and half.sustained().peak_fp32_gflops == 25.0
    pi = load_profile("raspberry-pi-5")
    assert (pi.bandwidth_efficiency, pi.compute_efficiency) == (devices.DEFAULT_BANDWIDTH_EFFICIENCY,
                                                                devices.DEFAULT_COMPUTE_EFFICIENCY)
    assert load_profile("cpu-host", measure=False).bandwidth_efficiency == 1.0
    assert load_profile("nvidia-h200").kernel_launch_us > 0
    assert load_profile("cpu-host", measure=False).to_dict()["bandwidth_gbs"] is None


def test_projection_carries_host_efficiency():
    host, target = _prof("host", bw=10.0, fp32=100.0), _prof("tgt", bw=40.0, fp32=100.0)
    # 1 GB per token: host roofline 0.1 s; measured 0.2 s -> efficiency 0.5;
    # target roofline 0.025 s -> projected 0.05 s/token (20 tok/s), memory-bound.
    pr = project(0.2, host, target, model_bytes_per_token=1e9, flops_per_token=1e9)
    assert pr.host_efficiency == pytest.approx(0.5) and pr.seconds_per_token == pytest.approx(0.05)
    assert pr.tokens_per_s == pytest.approx(20.0) and pr.bound == "memory" and pr.target == "tgt"
    # A compute-bound target: 1e11 ops at 10 GFLOP/s = 10 s bound; host is memory bound (0.1 s).
    slow = _prof("slow", bw=1000.0, fp32=10.0)
    pr = project(0.2, host, slow, 1e9, 1e11)
    assert pr.bound == "compute" and pr.host_roofline_s == pytest.approx(1.0)  # host: 1e11/1e11
    assert pr.seconds_per_token == pytest.approx(10.0 / (1.0 / 0.2))
    with pytest.raises(DeviceError):
        project(0.0, host, target, 1e9, 1e9)
