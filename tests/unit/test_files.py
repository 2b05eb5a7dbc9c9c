"""runtime.files: the JSON writer, the one output guard, the claim on an output (a second
writer refused at once, a dead writer's lock and leftovers cleaned up) and the atomic
folder writer."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from _claims import claim_held_elsewhere, python_child
from edgeprune_runtime.errors import CheckpointError, ConfigError, ExportError
from edgeprune_runtime.files import (FILE_OUTPUT, FOLDER_OUTPUT, OutputClaim, OutputKind, atomic_folder,
                           check_output, claim_output, json_ready, pid_alive, write_json)

EXPORT = OutputKind("export", files=frozenset({"model.onnx", "edgeprune.json"}),
                    marker="edgeprune.json", empty_ok=False)
CKPT = OutputKind("checkpoint", files=frozenset({"w.bin", "ck.json"}), marker="ck.json",
                  marker_key="run_id")
RUN = OutputKind("run", files=frozenset({"report.json", "checkpoint"}), marker="report.json",
                 marker_key="fingerprint", ours="part of an edgeprune run")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not pid_alive(p.pid)
    return p.pid


# --------------------------------------------------------------------------- JSON

def test_write_json_strict_values_numpy_and_atomic(tmp_path):
    """NaN / inf become the strings the CLI always wrote (strict JSON has neither);
    numpy scalars and arrays become numbers and lists (they were strings or TypeErrors);
    the file appears whole with plain permissions and no temporary file beside it."""
    old = os.umask(0o022)
    try:
        path = write_json(tmp_path / "sub" / "r.json", {
            "ppl": float("inf"), "kl": float("-inf"), "x": [float("nan"), 1.5, (2, 3)],
            "f32": np.float32(0.5), "f64nan": np.float64("nan"), "i": np.int64(7),
            "b": np.bool_(True), "arr": np.arange(3, dtype=np.int8), "p": Path("/a/b")})
    finally:
        os.umask(old)
    text = path.read_text()
    assert json.loads(text) == {"ppl": "inf", "kl": "-inf", "x": ["nan", 1.5, [2, 3]], "f32": 0.5,
                                "f64nan": "nan", "i": 7, "b": True, "arr": [0, 1, 2], "p": "/a/b"}
    assert "NaN" not in text and "Infinity" not in text
    assert os.listdir(tmp_path / "sub") == ["r.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert write_json(tmp_path / "k.json", {"b": 1, "a": 2}, sort_keys=True).read_text() == \
        '{\n  "a": 2,\n  "b": 1\n}'
    assert json_ready((1, {"z": float("nan")})) == [1, {"z": "nan"}]


# --------------------------------------------------------------------------- the guard

def test_guard_refuses_inputs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    gguf = tmp_path / "dl" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    for out, needle in ((model, "is or lies inside the input model folder"),
                        (model / "ck", "is or lies inside the input model folder"),
                        (tmp_path, "holds the input model folder"),
                        (gguf.parent, "is or holds the input model file")):
        with pytest.raises(ExportError, match=needle) as e:
            check_output(out, EXPORT, inputs=[model, gguf], overwrite=True, error=ExportError)
        assert str(e.value).startswith("refusing to write the export there")
    # a folder beside a model file is fine; missing inputs (aliases, hub ids) are skipped
    assert check_output(gguf.parent / "run1", EXPORT, inputs=[gguf, "owner/hub-model", None],
                        error=ExportError) == (gguf.parent / "run1").resolve()
    # a folder a tool only adds files to may hold the input; a file may not be in it
    check_output(tmp_path, FOLDER_OUTPUT, inputs=[model], label="--out", error=ConfigError)
    with pytest.raises(ConfigError, match="refusing to write --json there"):
        check_output(model / "r.json", FILE_OUTPUT, inputs=[model], label="--json", error=ConfigError)


def test_guard_refuses_the_wrong_kind_and_unwritable_places(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"--out .*a-file is a file, not a folder \(fix: pass a folder to --out\)"):
        check_output(f, FOLDER_OUTPUT, label="--out", error=ConfigError)
    with pytest.raises(CheckpointError, match="output folder .*a-file is a file, not a folder"):
        check_output(f, CKPT, error=CheckpointError)
    for p in (tmp_path, f"{tmp_path / 'newdir'}/"):
        with pytest.raises(ConfigError, match="--json .* names a folder"):
            check_output(p, FILE_OUTPUT, label="--json", error=ConfigError)
    for p in (f / "sub" / "deeper", "/proc/nope/out"):
        with pytest.raises(ExportError, match=r"cannot be written .*fix: pass a path in a writable folder"):
            check_output(p, EXPORT, error=ExportError)
    assert sorted(os.listdir(tmp_path)) == ["a-file"]          # the probe left nothing


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_guard_refuses_a_read_only_parent(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ExportError, match=r"ro/onnx cannot be written"):
            check_output(ro / "onnx", EXPORT, error=ExportError)
        with pytest.raises(ConfigError, match="--out .* cannot be written"):
            check_output(ro / "a" / "b", FOLDER_OUTPUT, label="--out", error=ConfigError)
    finally:
        ro.chmod(0o755)


def test_guard_refuses_foreign_files_even_with_overwrite(tmp_path):
    out = tmp_path / "e"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for ow in (False, True):          # no marker: every name is someone else's
        with pytest.raises(ExportError, match=r"holds files that are not an edgeprune export \(notes.txt\)"):
            check_output(out, EXPORT, overwrite=ow, error=ExportError)
    (out / "edgeprune.json").write_text("{}")
    (out / "model.onnx").write_text("")
    with pytest.raises(ExportError, match=r"not an edgeprune export \(notes.txt\); overwrite only "
                                          r"replaces an earlier export"):
        check_output(out, EXPORT, overwrite=True, error=ExportError)
    (out / "notes.txt").unlink()
    check_output(out, EXPORT, overwrite=True, error=ExportError)
    with pytest.raises(ExportError, match="already holds an export.*--overwrite"):
        check_output(out, EXPORT, error=ExportError)
    # a marker that is not the kind's own (no run key) marks nothing: all names foreign
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text('{"coverage": 91}')
    with pytest.raises(CheckpointError, match=r"not part of an edgeprune run \(report.json\)"):
        check_output(run, RUN, overwrite=True, error=CheckpointError)


def test_guard_existing_folders_and_the_same_run(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExportError, match="output folder .*empty already exists"):
        check_output(empty, EXPORT, error=ExportError)
    check_output(empty, CKPT, error=CheckpointError)           # an empty folder is taken
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "ck.json").write_text('{"run_id": "abc"}')
    check_output(ck, CKPT, run_id="abc", error=CheckpointError)   # the same run: replaced
    with pytest.raises(CheckpointError, match="already holds a different run"):
        check_output(ck, CKPT, run_id="xyz", error=CheckpointError)
    with pytest.raises(CheckpointError, match="--out .*ck already holds a checkpoint"):
        check_output(ck, CKPT, label="--out", error=CheckpointError)
    check_output(ck, CKPT, overwrite=True, error=CheckpointError)


# --------------------------------------------------------------------------- the claim

def test_a_second_process_is_refused_at_once_while_the_first_writes(tmp_path):
    """Two writers into one new folder: both passed the existence check and the later
    rename silently replaced the first one's result. The claim refuses the second at
    once, naming the first's pid; once released, the folder can be claimed."""
    out = tmp_path / "racek"
    with claim_held_elsewhere(out) as pid:
        lock = json.loads((tmp_path / ".racek.lock").read_text())
        assert lock["pid"] == pid
        for call in (claim_output, check_output):
            with pytest.raises(CheckpointError, match=rf"output folder .*racek is being written by "
                                                      rf"another edgeprune process \(pid {pid}\)"):
                call(out, CKPT, error=CheckpointError)
        with pytest.raises(ExportError, match="being written by another edgeprune process"):
            with atomic_folder(out, error=ExportError) as tmp:
                (tmp / "model.onnx").write_text("lost")
        assert not out.exists() and sorted(os.listdir(tmp_path)) == [".racek.lock"]
    assert os.listdir(tmp_path) == []                      # released: the lock is gone
    with claim_output(out, CKPT, error=CheckpointError):
        with atomic_folder(out) as tmp:
            (tmp / "w.bin").write_text("mine")
    assert os.listdir(tmp_path) == ["racek"]


def test_a_second_thread_is_refused_and_the_same_thread_joins(tmp_path):
    out = tmp_path / "o"
    got, go, done = [], threading.Event(), threading.Event()

    def hold():
        with claim_output(out, CKPT, error=CheckpointError):
            go.set()
            done.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert go.wait(30)
        with pytest.raises(CheckpointError, match="being written by another thread of this process"):
            claim_output(out, CKPT, error=CheckpointError)
        with pytest.raises(CheckpointError, match="another thread"):
            with atomic_folder(out, error=CheckpointError):
                got.append("wrote")
    finally:
        done.set()
        t.join(30)
    assert got == [] and os.listdir(tmp_path) == []
    # nested claims of one thread (the CLI, then save_checkpoint): the lock goes with the last
    with claim_output(out, CKPT, error=CheckpointError):
        with claim_output(out, CKPT, error=CheckpointError), atomic_folder(out) as tmp:
            (tmp / "w.bin").write_text("x")
        assert (tmp_path / ".o.lock").exists()
    assert os.listdir(tmp_path) == ["o"]


def test_a_dead_writers_lock_and_leftovers_are_removed_by_the_next_claim(tmp_path):
    """SIGKILL mid-write left the lock and a hidden .NAME.tmp-PID-* folder (up to 94 MB)
    that no later run removed; the next claim takes the stale lock over and removes them."""
    out = tmp_path / "run"
    child = python_child(f"""
        import os, signal
        from edgeprune_runtime.files import OutputClaim, atomic_folder
        with OutputClaim({str(out)!r}), atomic_folder({str(out)!r}) as tmp:
            (tmp / "model.onnx.data").write_bytes(b"x" * (1 << 20))
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    left = sorted(os.listdir(tmp_path))
    assert left[0] == ".run.lock" and left[1].startswith(f".run.tmp-{child.pid}-") and len(left) == 2
    # leftovers of a live process, and names that are not a writer's, are kept
    (tmp_path / f".run.tmp-{os.getppid()}-keep").mkdir()
    (tmp_path / ".run.notes").write_text("mine")
    with claim_output(out, RUN, error=CheckpointError) as claim:
        assert json.loads(claim.lock.read_text())["pid"] == os.getpid()
        assert sorted(os.listdir(tmp_path)) == [".run.lock", ".run.notes", f".run.tmp-{os.getppid()}-keep"]
    assert sorted(os.listdir(tmp_path)) == [".run.notes", f".run.tmp-{os.getppid()}-keep"]


def test_a_folder_set_aside_by_a_dead_writer_is_put_back(tmp_path):
    """Killed between setting the old folder aside and renaming the new one in: the next
    claim restores the old folder (the output was missing) and drops the lock."""
    dead = _dead_pid()
    old = tmp_path / f".ck.old-{dead}-1a2b3c4d"
    old.mkdir()
    (old / "ck.json").write_text('{"run_id": "r1"}')
    (tmp_path / ".ck.lock").write_text(json.dumps({"pid": dead, "host": socket.gethostname(),
                                                   "start": None, "token": "t"}))
    (tmp_path / f".ck.tmp-{dead}-zzzz").mkdir()
    with pytest.raises(CheckpointError, match="already holds a different run"):
        claim_output(tmp_path / "ck", CKPT, run_id="r2", error=CheckpointError)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert json.loads((tmp_path / "ck" / "ck.json").read_text())["run_id"] == "r1"


def test_a_live_or_young_unreadable_lock_is_respected(tmp_path):
    (tmp_path / ".o.lock").write_text("")          # being written right now by someone
    with pytest.raises(ExportError, match=r"being written by another edgeprune process \(pid \?\)"):
        claim_output(tmp_path / "o", EXPORT, error=ExportError)
    os.utime(tmp_path / ".o.lock", (1, 1))         # ... for a long time: torn, stale
    with claim_output(tmp_path / "o", EXPORT, error=ExportError):
        pass
    assert os.listdir(tmp_path) == []


def test_atomic_folder_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "new" / "deeper" / "f"
    for exc in (OSError("disk full (simulated)"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with atomic_folder(out, error=ExportError) as tmp:
                assert tmp.name.startswith(f".f.tmp-{os.getpid()}-")
                (tmp / "half").write_bytes(b"x")
                raise exc
        assert os.listdir(tmp_path) == []          # no temp folder, lock or parent folder
    out.parent.mkdir(parents=True)
    out.mkdir()
    (out / "old").write_text("1")
    with pytest.raises(ExportError, match="appeared while it was being written"):
        with atomic_folder(out, error=ExportError) as tmp:
            (tmp / "new").write_text("2")
    assert os.listdir(out) == ["old"] and os.listdir(out.parent) == ["f"]
    with atomic_folder(out, overwrite=True) as tmp:
        (tmp / "new").write_text("2")
    assert os.listdir(out) == ["new"] and os.listdir(out.parent) == ["f"]


def test_a_claim_taken_over_meanwhile_is_not_renamed_into_place(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(ExportError, match="claimed by another process while it was written"):
        with atomic_folder(out, error=ExportError) as tmp:
            (tmp / "x").write_text("1")
            lock = tmp_path / ".o.lock"
            rec = json.loads(lock.read_text())
            lock.write_text(json.dumps(dict(rec, token="someone else")))
    assert sorted(os.listdir(tmp_path)) == [".o.lock"]   # the other claim's lock is theirs
    assert isinstance(OutputClaim(out), OutputClaim)
