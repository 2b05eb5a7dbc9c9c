"""Fault injection (issue 27): ``compress`` and ``export`` killed with SIGKILL at several
points leave the previous output intact (or no output), never a half-written one, and the
next run leaves nothing behind; a killed ``profile`` takes its worker with it.

Each kill runs the real CLI in a forked child that SIGKILLs itself at the chosen point,
found with an audit hook (a file opened, a folder renamed) or a wrapped ``nn.Linear``, so
the points stay where they are whatever the code around them becomes:

* ``load``: the input model is being read (``export``);
* ``calibration``: the calibration text is being read (the output folder is claimed);
* ``mid-layer``: block 1 is running after block 0 was compressed;
* ``mid-save``: the temporary folder holds the weights, not yet the tokenizer or record;
* ``rename``: the previous output was moved aside, the new one not yet moved in.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_cli_inputs import model_dir  # noqa: F401 - the tiny saved llama, a fixture

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env

def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, out: str) -> None:
    """In the child: SIGKILL this process when it reaches ``point`` (see the module
    docstring); ``out`` is the output folder's name."""
    state = {"aside": False, "linear": 0}

    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, os.PathLike)):
            path = os.fspath(args[0])
            if point == "calibration" and path.endswith("calib.txt"):
                _die()
            if point == "load" and path.endswith("/tiny/config.json"):
                _die()
            if point == "mid-save" and f"/.{out}.tmp-" in path and (
                    "tokenizer" in path or "genai_config" in path):
                _die()
        if event == "os.rename" and point == "rename":
            dst = os.fspath(args[1])
            if f"/.{out}.old-" in dst:
                state["aside"] = True
            elif state["aside"] and dst.rstrip("/").endswith("/" + out):
                _die()

    sys.addaudithook(hook)
    if point == "mid-layer":
        forward = torch.nn.Linear.forward

        def counted(self, x):
            state["linear"] += 1
            if state["linear"] == 16:     # block 1's statistics pass (2 blocks x 7 linears)
                _die()
            return forward(self, x)

        torch.nn.Linear.forward = counted


def _edgeprune(point: str | None, out: Path, argv: list, timeout: float = 300) -> int:
    """``edgeprune ARGV`` in a forked child (torch and transformers already imported:
    no interpreter start per run), killed at ``point`` (``None``: a plain run); its exit
    code, ``-9`` when killed."""
    from edgeprune.cli import main

    pid = os.fork()
    if pid == 0:                                          # the child: never returns
        code = 70
        try:
            if point:
                _arm(point, out.name)
            code = main([str(a) for a in argv])
        finally:
            os._exit(code)
    deadline = time.time() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"edgeprune {' '.join(map(str, argv))} hung (killed at {point})")
        time.sleep(0.05)


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _previous_intact(out: Path, before: dict) -> None:
    """``out`` is the previous output, byte for byte; or, killed between moving it aside
    and moving the new one in, the next claim puts it back untouched."""
    from edgeprune_runtime.files import claim_output
    from edgeprune_runtime.output_guard import FOLDER_OUTPUT

    if not out.exists():
        with claim_output(out, FOLDER_OUTPUT, overwrite=True):
            pass                          # a claim cleans up after dead writers
    assert out.is_dir() and _hashes(out) == before


def _only(parent: Path, *names: str) -> None:
    """``parent`` holds exactly ``names``: no temporary folder, set-aside output or lock."""
    assert sorted(p.name for p in parent.iterdir()) == sorted(names)


def _killed_runs(argv, outs: Path, out: Path, fresh: Path, points: tuple) -> int:
    """The kill sequence both verbs go through; returns how many runs were killed.

    A first run in this process (it also imports what the forked runs need); a run into
    a new folder killed mid-save (no output); a run killed at each of ``points`` over the
    first output (intact each time); then plain runs into both folders clean up every
    leftover and write complete outputs."""
    from edgeprune.cli import main

    def at(folder):
        return [folder if a == out else a for a in argv]

    assert main([str(a) for a in argv]) == 0
    before = _hashes(out)
    assert _edgeprune("mid-save", fresh, at(fresh)) == -signal.SIGKILL
    assert not fresh.exists()                            # a new folder: no output at all
    for point in points:
        assert _edgeprune(point, out, [*argv, "--overwrite"]) == -signal.SIGKILL, point
        _previous_intact(out, before)
    assert _edgeprune(None, out, [*argv, "--overwrite"]) == 0
    assert _edgeprune(None, fresh, at(fresh)) == 0
    _only(outs, out.name, fresh.name)
    return 1 + len(points)


def test_compress_killed_leaves_previous_output_or_none(model_dir, tmp_path):
    from pydoc_data.topics import topics

    from edgeprune.checkpoint import load_checkpoint

    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(topics[k] for k in sorted(topics)[:4]))
    outs = tmp_path / "outs"
    outs.mkdir()
    out = outs / "ck"
    t0 = time.perf_counter()
    kills = _killed_runs(["compress", model_dir, "--method", "rtn", "--bits", "4", "--group-size",
                          "32", "--calib", calib, "--nsamples", "2", "--seqlen", "32", "--out", out],
                         outs, out, outs / "fresh", ("calibration", "mid-layer", "mid-save", "rename"))
    for folder in (out, outs / "fresh"):
        load_checkpoint(folder)                          # complete
    print(f"compress: {kills} kills, nothing lost, {time.perf_counter() - t0:.1f} s")


def test_export_killed_leaves_previous_output_or_none(model_dir, tmp_path):
    import edgeprune_runtime as runtime

    outs = tmp_path / "outs"
    outs.mkdir()
    out = outs / "onnx"
    t0 = time.perf_counter()
    kills = _killed_runs(["export", model_dir, out, "--max-length", "64", "--no-validate"],
                         outs, out, outs / "fresh", ("load", "mid-save", "rename"))
    for folder in (out, outs / "fresh"):
        with runtime.load(folder) as sess:               # complete
            sess.generate("hi", max_new_tokens=2)
    print(f"export: {kills} kills, nothing lost, {time.perf_counter() - t0:.1f} s")


def test_killed_profile_takes_its_worker_and_folder(model_dir, tmp_path):
    """SIGKILL of ``edgeprune profile`` ends its measuring worker at once and leaves no
    ``edgeprune-profile-*`` folder; one a killed profiler left is removed by the next run."""
    import psutil

    from edgeprune_devices.profiler.measure import remove_stale_workdirs

    assert _edgeprune(None, tmp_path / "onnx", ["export", model_dir, tmp_path / "onnx",
                                                 "--max-length", "64", "--no-validate"]) == 0
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = dict(_env(), TMPDIR=str(tmpdir))
    proc = subprocess.Popen([sys.executable, "-m", "edgeprune.cli", "profile", tmp_path / "onnx",
                             "--prompt-len", "8", "--gen-len", "40", "--repeat", "100000",
                             "--threads", "1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        worker = None
        deadline = time.time() + 120
        while worker is None and time.time() < deadline:
            kids = psutil.Process(proc.pid).children()
            worker = next((k for k in kids if "devices.profiler" in " ".join(k.cmdline())), None)
            time.sleep(0.2)
        assert worker is not None, "the profiler never started its worker"
        assert [p.name[:-8] for p in tmpdir.glob("edgeprune-profile-*")] == [
            f"edgeprune-profile-{proc.pid}-"]
        proc.kill()
        proc.wait()
        worker.wait(timeout=10)                          # gone, not measuring on
        assert list(tmpdir.glob("edgeprune-profile-*")) == []
    finally:
        proc.kill()
    # a folder a profiler left when it was killed with its worker: removed by the next run
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (tmpdir / f"edgeprune-profile-{dead}-abc").mkdir()
    (tmpdir / f"edgeprune-profile-{os.getpid()}-live").mkdir()      # a live profiler's: kept
    assert [p.name for p in remove_stale_workdirs(tmpdir)] == [f"edgeprune-profile-{dead}-abc"]
    assert [p.name for p in tmpdir.glob("edgeprune-profile-*")] == [
        f"edgeprune-profile-{os.getpid()}-live"]
