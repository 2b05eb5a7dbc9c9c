"""Run an exported model on the ARM64 (aarch64) code path under emulation and compare
its logits with this machine's x86-64 run.

Mobile-class targets (phones, Raspberry Pi) run onnxruntime's aarch64 build: other
MLAS kernels (NEON SGEMM, NEON/dot-product int8 and 4-bit GEMMs), other threading
and memory code. This check executes that very build, under QEMU user-mode
emulation, on the same folder and prompt, and reports how far its logits are from
the x86 run: a numerics check of the ARM path, NOT a timing. Emulated seconds are
printed only to say how long the check took.

Setup (done once, cached under ``--root``, needs root for ``apt-get``):

1. ``apt-get install qemu-user-static debootstrap`` (Debian packages);
2. ``debootstrap --arch=arm64 --foreign --variant=minbase --include=python3,libstdc++6``
   a Debian bookworm arm64 tree, unpacking every downloaded package with ``dpkg -x``
   (no second stage, no chroot, no binfmt needed): an aarch64 Python 3.11;
3. ``pip install --platform manylinux2014_aarch64 --only-binary=:all: --target SITE``
   the aarch64 wheels of onnxruntime (same version as here), numpy, tokenizers,
   jinja2, psutil from PyPI.

Running: ``unshare -m`` + a bind mount of a Cortex-A76 ``/proc/cpuinfo`` (QEMU 7.2
passes the host's x86 ``/proc/cpuinfo`` through, and onnxruntime's cpuinfo library
crashes parsing it on aarch64), then ``qemu-aarch64-static -cpu cortex-a76 -L SYSROOT
SYSROOT/usr/bin/python3.11 -m edgeprune_devices.arm64_check --probe ...``.

Usage::

    python -m edgeprune_devices.arm64_check OUT/tiny-int4 --tokens 16 --json arm64.json
    bash devices/arm64_check.sh OUT/tiny-int4            # same, via the wrapper
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgeprune_runtime.errors import DeviceError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = Path(os.environ.get("EDGEPRUNE_ARM64_ROOT", Path.home() / ".cache" / "edgeprune" / "arm64"))
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# /proc/cpuinfo of a Cortex-A76 (Raspberry Pi 5's core): implementer 0x41 (Arm), part 0xd0b.
CPUINFO_A76 = "".join(
    f"processor\t: {i}\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp "
    f"asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
    f"CPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n\n" for i in range(2))
PROMPT = ("Small language models run on phones and single-board computers. The quick brown fox jumps "
          "over the lazy dog while the runtime streams weights from memory.")


def _run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def setup(root: Path = DEFAULT_ROOT, quiet: bool = True) -> dict:
    """Install QEMU and build the aarch64 Python + wheels under ``root`` (idempotent).

    Returns ``{"qemu", "sysroot", "python", "site"}`` paths.

    Raises:
        DeviceError: a step failed (no root for apt-get, no network to the Debian/PyPI
            registries, ...), naming the step.
    """
    out = subprocess.DEVNULL if quiet else None
    root = Path(root)
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    need = [p for p, ok in (("qemu-user-static", qemu), ("debootstrap", shutil.which("debootstrap"))) if not ok]
    if need:
        if os.geteuid() != 0:
            raise DeviceError(f"{', '.join(need)} missing and not root", f"sudo apt-get install -y {' '.join(need)}")
        try:
            _run(["apt-get", "update", "-qq"], stdout=out, stderr=out)
            _run(["apt-get", "install", "-y", "-qq", *need], stdout=out, stderr=out)
        except (subprocess.CalledProcessError, OSError) as e:
            raise DeviceError(f"apt-get install {' '.join(need)} failed: {e}", "install them by hand") from e
        qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    sysroot = root / "sysroot"
    py = sysroot / "usr" / "bin" / "python3"
    if not py.exists():
        tmp = root / "sysroot.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            _run(["debootstrap", "--arch=arm64", "--foreign", "--variant=minbase",
                  "--include=python3,libstdc++6", SUITE, str(tmp), MIRROR], stdout=out, stderr=out)
            for deb in sorted((tmp / "var" / "cache" / "apt" / "archives").glob("*.deb")):
                _run(["dpkg", "-x", str(deb), str(tmp)], stdout=out, stderr=out)
        except (subprocess.CalledProcessError, OSError) as e:
            raise DeviceError(f"building the arm64 Debian tree failed: {e}",
                              f"check that {MIRROR} is reachable and debootstrap is installed") from e
        shutil.rmtree(sysroot, ignore_errors=True)
        os.replace(tmp, sysroot)
    pyver = sorted(p.name for p in (sysroot / "usr" / "bin").glob("python3.*") if p.name[8:].isdigit())[-1][6:]
    import onnxruntime
    site = root / f"site-py{pyver}-ort{onnxruntime.__version__}"
    if not (site / "onnxruntime").exists():
        tmp = Path(str(site) + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        pkgs = [f"onnxruntime=={onnxruntime.__version__}", "numpy", "tokenizers", "jinja2", "psutil"]
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--only-binary=:all:", "--python-version", pyver,
               "--implementation", "cp", "--target", str(tmp)]
        for plat in ("manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"):
            cmd += ["--platform", plat]
        try:
            _run(cmd + pkgs, stdout=out, stderr=out)
        except (subprocess.CalledProcessError, OSError) as e:
            raise DeviceError(f"pip could not fetch aarch64 wheels ({', '.join(pkgs)}): {e}",
                              "check PyPI access; onnxruntime publishes manylinux aarch64 wheels") from e
        os.replace(tmp, site)
    cpuinfo = root / "cpuinfo-cortex-a76"
    cpuinfo.write_text(CPUINFO_A76)
    return {"qemu": qemu, "sysroot": str(sysroot), "python": str(sysroot / "usr" / "bin" / f"python{pyver}"),
            "site": str(site), "cpuinfo": str(cpuinfo)}


def _probe(folder: str, tokens: int, threads: int) -> dict:
    """The measured part, identical on both architectures: prefill logits + greedy ids."""
    import platform

    import onnxruntime

    import edgeprune_runtime as runtime

    t0 = time.perf_counter()
    s = runtime.load(folder, threads=threads)
    ids = s.tokenizer.encode(PROMPT)
    logits = s.logits(np.asarray([ids], np.int64))[0]
    if hasattr(s, "eos_token_ids"):
        s.eos_token_ids = []
    gen = s.generate(ids, max_new_tokens=tokens).token_ids[0]
    s.close()
    return {"machine": platform.machine(), "onnxruntime": onnxruntime.__version__, "prompt_ids": ids,
            "logits": logits, "greedy": [int(t) for t in gen], "seconds": time.perf_counter() - t0}


def _import_root(td: Path) -> Path:
    """A folder under ``td`` that makes this checkout's runtime and devices importable by
    their import names (``edgeprune_runtime``, ``edgeprune_devices``: symbolic links to the
    ``runtime/`` and ``devices/`` folders) in the emulated interpreter, which has no install
    of ours."""
    pkgs = td / "pkgs"
    pkgs.mkdir()
    for name, folder in (("edgeprune_runtime", "runtime"), ("edgeprune_devices", "devices")):
        (pkgs / name).symlink_to(REPO / folder, target_is_directory=True)
    return pkgs


def run_arm64(folder: Path, env_paths: dict, tokens: int, threads: int, cpu: str, timeout: float) -> dict:
    """Run :func:`_probe` under qemu-aarch64 and return its result (logits included)."""
    with tempfile.TemporaryDirectory(prefix="edgeprune-arm64-") as td:
        out = Path(td) / "arm.npz"
        py = [env_paths["qemu"], "-cpu", cpu, "-L", env_paths["sysroot"], env_paths["python"], "-m",
              "edgeprune_devices.arm64_check", "--probe", str(folder), str(out), "--tokens", str(tokens), "--threads", str(threads)]
        inner = " ".join(f"'{a}'" for a in py)
        cmd = ["unshare", "-m", "sh", "-c", f"mount --bind '{env_paths['cpuinfo']}' /proc/cpuinfo && exec {inner}"]
        pkgs = _import_root(Path(td))
        env = dict(os.environ, PYTHONPATH=f"{env_paths['site']}{os.pathsep}{pkgs}", PYTHONNOUSERSITE="1")
        env.pop("PYTHONHOME", None)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(REPO))
        except subprocess.TimeoutExpired as e:
            raise DeviceError(f"the emulated run did not finish in {timeout:.0f} s", "use a smaller folder or fewer --tokens") from e
        if p.returncode != 0 or not out.exists():
            hint = ("run as root (unshare -m + mount need CAP_SYS_ADMIN)" if "unshare" in p.stderr or "mount" in p.stderr
                    else "see the stderr above")
            raise DeviceError(f"the aarch64 run failed (exit {p.returncode}): {p.stderr.strip()[-600:]}", hint)
        z = np.load(out, allow_pickle=False)
        meta = json.loads(str(z["meta"]))
        meta["logits"] = z["logits"]
        meta["wall_seconds"] = time.perf_counter() - t0
        return meta


def compare(folder: Path, tokens: int = 16, threads: int = 1, cpu: str = "cortex-a76", root: Path = DEFAULT_ROOT,
            timeout: float = 1800.0) -> dict:
    """x86-64 vs emulated aarch64 on one folder.

    Returns:
        ``{"x86": {...}, "arm64": {...}, "max_abs_logit_diff", "mean_abs_logit_diff",
        "max_rel_logit_diff", "top1_agreement", "greedy_equal", "greedy_common_prefix",
        "note"}``; logits compared on every prompt position.
    """
    folder = Path(folder).resolve()
    paths = setup(root)
    x86 = _probe(str(folder), tokens, threads)
    arm = run_arm64(folder, paths, tokens, threads, cpu, timeout)
    a, b = x86["logits"], arm["logits"]
    if a.shape != b.shape:
        raise DeviceError(f"logit shapes differ: x86 {a.shape} vs arm64 {b.shape}", "report this as a bug")
    d = np.abs(a.astype(np.float64) - b)
    common = 0
    for u, v in zip(x86["greedy"], arm["greedy"]):
        if u != v:
            break
        common += 1
    return {
        "folder": str(folder), "prompt_tokens": len(x86["prompt_ids"]), "new_tokens": tokens, "threads": threads,
        "x86": {"machine": x86["machine"], "onnxruntime": x86["onnxruntime"], "seconds": round(x86["seconds"], 2)},
        "arm64": {"machine": arm["machine"], "onnxruntime": arm["onnxruntime"], "emulator": f"qemu-user -cpu {cpu}",
                  "emulated_seconds": round(arm["seconds"], 2)},
        "max_abs_logit_diff": float(d.max()), "mean_abs_logit_diff": float(d.mean()),
        "max_rel_logit_diff": float(d.max() / max(1e-12, np.abs(a).max())),
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
        "greedy_equal": x86["greedy"] == arm["greedy"], "greedy_common_prefix": common,
        "greedy_x86": x86["greedy"], "greedy_arm64": arm["greedy"],
        "note": "numerics check of onnxruntime's aarch64 build under QEMU user-mode emulation; "
                "emulated seconds are NOT device timings",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens to compare (default 16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu", default="cortex-a76", help="QEMU CPU model (cortex-a76: Pi 5; cortex-a72: no dot-product)")
    ap.add_argument("--root", default=str(DEFAULT_ROOT), help="cache of the arm64 tree and wheels")
    ap.add_argument("--json", help="write the comparison here")
    ap.add_argument("--atol", type=float, default=None, help="fail (exit 1) if max |Δlogit| exceeds this")
    a = ap.parse_args(argv)
    if a.probe:
        r = _probe(a.folder, a.tokens, a.threads)
        logits = r.pop("logits")
        np.savez(a.out, logits=logits, meta=np.array(json.dumps(r)))
        return 0
    res = compare(Path(a.folder), a.tokens, a.threads, a.cpu, Path(a.root))
    text = json.dumps(res, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    if a.atol is not None and res["max_abs_logit_diff"] > a.atol:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
