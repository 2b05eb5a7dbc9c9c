"""The claim on an output path while it is written: one writer at a time, and what dead
writers left beside it cleaned up (standard library only; :mod:`runtime.files` is the
entry point).

A claim is a lock file ``.NAME.lock`` beside the output, created exclusively and holding
the writer's pid, host, start time and a random token. Another process (or another
thread of this one) asking for the same output is refused at once; a lock whose process
is gone is stale and taken over.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

from .errors import EdgePruneError

_HOST = socket.gethostname()
#: Claims this process holds: lock path -> the outermost OutputClaim.
_HELD: dict[str, "OutputClaim"] = {}
_HELD_LOCK = threading.RLock()
#: A lock file with no readable owner yet (being written) counts as live this long.
_UNREADABLE_GRACE_S = 30.0


def _proc_stat(pid: int) -> Optional[tuple[str, str]]:
    """``(state, start time)`` of ``pid`` from ``/proc`` (Linux); ``None`` elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int, start: Optional[str] = None) -> bool:
    """Whether process ``pid`` runs on this machine (a zombie does not; with ``start``,
    the ``/proc`` start time must match, so a reused pid is not taken for the writer).
    On Windows every pid counts as alive (``os.kill(pid, 0)`` would end the process)."""
    if pid <= 0:
        return False
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:        # PermissionError: another user's live process
        pass
    stat = _proc_stat(pid)
    if stat is not None and (stat[0] in ("Z", "X") or (start is not None and stat[1] != start)):
        return False
    return True


def _lock_path(p: Path) -> Path:
    return p.parent / f".{p.name}.lock"


def _read_owner(lock: Path) -> Optional[dict]:
    """The owner record of a lock file; ``{}`` when unreadable, ``None`` when absent."""
    try:
        text = lock.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        owner = json.loads(text)
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _owner_alive(owner: dict, lock: Path) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):   # being written, or torn:
        try:                                                 # live while young
            return time.time() - lock.stat().st_mtime < _UNREADABLE_GRACE_S
        except OSError:
            return False
    if owner.get("host") != _HOST:                  # another machine: cannot tell
        return True
    return pid_alive(pid, owner.get("start"))


def _held_here(lock: Path) -> Optional["OutputClaim"]:
    with _HELD_LOCK:
        root = _HELD.get(str(lock))
    return root if root is not None and root._pid == os.getpid() else None


def refuse_live_claim(p: Path, where: str, error) -> None:
    """Refuse an output another live writer holds: another thread of this process, or a
    process whose lock ``.NAME.lock`` names it (alive, or on another host, or a lock still
    being written). A claim of this thread, or a stale lock, passes.

    Raises:
        error: naming the holder's pid and the lock to delete if that process is gone.
    """
    lock = _lock_path(p)
    root = _held_here(lock)
    if root is not None:
        if root._thread != threading.get_ident():
            raise error(f"{where} is being written by another thread of this process",
                        "write each output from one thread at a time, or choose another output")
        return
    owner = _read_owner(lock)
    if owner is not None and _owner_alive(owner, lock):
        who = f"pid {owner.get('pid', '?')}" + (f" on {owner['host']}" if owner.get("host")
                                                 not in (None, _HOST) else "")
        raise error(f"{where} is being written by another edgeprune process ({who})",
                    f"wait for it to finish or choose another output; if no such process runs, "
                    f"delete {lock}")


_LEFTOVER = r"\.{name}\.(?:(tmp|old)-(\d+)-.+|lock\.stale-(\d+)-.+)"


def _clean_leftovers(p: Path) -> None:
    """Remove what dead writers of ``p`` left beside it: temporary folders
    ``.NAME.tmp-PID-*``, replaced folders ``.NAME.old-PID-*`` and set-aside locks. A
    replaced folder whose writer died before the new one took its place (``p`` missing)
    is put back instead."""
    pat = re.compile(_LEFTOVER.format(name=re.escape(p.name)))
    found = []
    try:
        for e in p.parent.iterdir():
            m = pat.fullmatch(e.name)
            if m:
                found.append((e.lstat().st_mtime, e, m))
    except OSError:
        return
    for _, e, m in sorted(found, key=lambda t: t[0], reverse=True):   # newest first
        pid = int(m.group(2) or m.group(3))
        if pid == os.getpid() or pid_alive(pid):
            continue
        try:
            if m.group(1) == "old" and not p.exists() and e.is_dir():
                os.replace(e, p)
            elif e.is_dir() and not e.is_symlink():
                shutil.rmtree(e, ignore_errors=True)
            else:
                e.unlink()
        except OSError:
            pass


class OutputClaim:
    """A claim on one output path while it is written: the lock file ``.NAME.lock`` beside
    it, created exclusively, holding the writer's pid, host, start time and a token.

    A second writer (another process, or another thread of this one) is refused at once.
    The same thread may claim a path it holds again (nested writers: the CLI claims the
    checkpoint folder, :func:`save_checkpoint` claims it too); the lock goes with the
    outermost release. A lock whose process is gone (pid not running, or a zombie, or a
    reused pid with another start time) is stale: it is taken over, and that process's
    leftovers beside the output are removed (``.NAME.tmp-PID-*`` folders; a
    ``.NAME.old-PID-*`` folder is put back when the output is missing). The parent folders
    the claim created to hold the lock are removed on release when the output was not
    written. Use it as a context manager; it is released on every exit path, exceptions
    and ``KeyboardInterrupt`` included (a ``SIGKILL`` leaves a stale lock, which the next
    claim takes over).

    Args:
        path: the output (resolved).
        error: the error class to raise.
        where: how the output is named in messages.
    """

    def __init__(self, path, *, error: type = EdgePruneError, where: Optional[str] = None):
        self.path = Path(path).resolve()
        self.lock = _lock_path(self.path)
        self.error = error
        self.where = where or f"output {self.path}"
        self._root: Optional[OutputClaim] = None
        self._depth = 0
        self._token = ""
        self._made: list[Path] = []
        self._pid = os.getpid()
        self._thread = threading.get_ident()

    def acquire(self) -> "OutputClaim":
        """Take the claim (or join this thread's claim on the same path).

        Raises:
            error: another live process or thread holds it, or the lock cannot be made.
        """
        with _HELD_LOCK:
            root = _held_here(self.lock)
            if root is not None:
                refuse_live_claim(self.path, self.where, self.error)   # another thread
                root._depth += 1
                self._root = root
                return self
            try:
                self._made = _make_parents(self.path.parent)
            except OSError as e:
                raise self.error(f"{self.where} cannot be written ({e})",
                                 "pass a path in a writable folder") from e
            try:
                self._take_lock()
            except BaseException:
                _remove_made(self._made)
                raise
            self._root, self._depth = self, 1
            self._pid, self._thread = os.getpid(), threading.get_ident()
            _HELD[str(self.lock)] = self
        _clean_leftovers(self.path)
        return self

    def _take_lock(self) -> None:
        token = f"{os.getpid()}-{uuid.uuid4().hex}"
        stat = _proc_stat(os.getpid())
        record = json.dumps({"pid": os.getpid(), "host": _HOST, "start": stat and stat[1],
                             "token": token})
        for _ in range(8):
            try:
                fd = os.open(self.lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = _read_owner(self.lock)
                if owner is not None:
                    refuse_live_claim(self.path, self.where, self.error)
                    _take_over(self.lock, owner)
                continue
            except OSError as e:
                raise self.error(f"{self.where} cannot be written ({e})",
                                 "pass a path in a writable folder") from e
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(record)
            except BaseException:
                self.lock.unlink()
                raise
            self._token = token
            return
        raise self.error(f"{self.where}: its lock {self.lock} keeps changing hands",
                         "make sure one edgeprune process writes it at a time, and run again")

    def verify(self) -> None:
        """Check the lock still names this claim (call before renaming into place).

        Raises:
            error: another process took the claim over meanwhile.
        """
        root = self._root or self
        owner = _read_owner(root.lock) or {}
        if owner.get("token") != root._token:
            raise self.error(f"{self.where} was claimed by another process while it was written",
                             "make sure one edgeprune process writes it at a time, and run again")

    def release(self) -> None:
        """Drop the claim (the lock file goes with the outermost release)."""
        root = self._root
        if root is None:
            return
        self._root = None
        with _HELD_LOCK:
            root._depth -= 1
            if root._depth > 0:
                return
            _HELD.pop(str(root.lock), None)
        if (_read_owner(root.lock) or {}).get("token") == root._token:
            try:
                root.lock.unlink()
            except OSError:
                pass
        if not root.path.exists():
            _remove_made(root._made)

    def __enter__(self) -> "OutputClaim":
        if self._root is None:
            self.acquire()
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


@atexit.register
def _release_all() -> None:
    """At interpreter exit, drop the claims this process still holds (a claim taken
    without ``with`` and never released)."""
    with _HELD_LOCK:
        roots = [r for r in _HELD.values() if r._pid == os.getpid()]
    for root in roots:
        root._depth, root._root = 1, root
        root.release()


def _take_over(lock: Path, owner: dict) -> None:
    """Set a stale lock aside (an atomic rename: of two processes taking it over, one
    wins) and delete it; a live lock taken by mistake (claimed in between) is put back."""
    aside = lock.with_name(f"{lock.name}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return
    moved = _read_owner(aside) or {}
    if moved.get("token") != owner.get("token") and _owner_alive(moved, aside):
        try:
            os.link(aside, lock)
        except OSError:
            pass
    try:
        aside.unlink()
    except OSError:
        pass


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; the ones created, innermost first."""
    made = [p for p in [folder, *folder.parents] if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return made


def _remove_made(made: list[Path]) -> None:
    for p in made:
        try:
            p.rmdir()
        except OSError:
            break


__all__ = ["OutputClaim", "pid_alive", "refuse_live_claim"]
