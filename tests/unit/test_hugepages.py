"""runtime.hugepages: fully resident anonymous memory is collapsed into 2 MiB pages, partly
resident memory is left alone (no RSS growth), and sessions use it by default."""

import ctypes
import mmap
import platform
import sys
from pathlib import Path

import numpy as np
import pytest

from tiny import export_tiny_llama

from edgeprune_runtime import hugepages

HP = hugepages.HUGE_PAGE


def _collapse_supported() -> bool:
    if not sys.platform.startswith("linux") or not Path("/sys/kernel/mm/transparent_hugepage").is_dir():
        return False
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 1)


needs_collapse = pytest.mark.skipif(not _collapse_supported(),
                                    reason="needs Linux 6.1+ with transparent huge pages")


def _anon_huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages (KiB) of the mappings overlapping [lo, hi) in /proc/self/smaps."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split(None, 1)[0]
        if "-" in head and ":" not in head:
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a < hi and b > lo
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def _resident_pages(addr: int, n: int) -> int:
    libc = hugepages._libc()
    vec = (ctypes.c_ubyte * (n // 4096))()
    assert libc.mincore(ctypes.c_void_p(addr), n, vec) == 0
    return sum(v & 1 for v in vec)


@needs_collapse
def test_fully_resident_memory_is_collapsed_partly_resident_is_not():
    n = 8 * HP
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # 8 huge pages
    buf = np.frombuffer(m, np.uint8)
    addr = buf.ctypes.data
    first = (addr + HP - 1) // HP * HP         # first 2 MiB-aligned stretch inside
    buf[: first - addr + 3 * HP] = 1           # touch everything up to 3 aligned stretches
    half = first + 3 * HP                      # the next stretch: only its first half
    buf[half - addr: half - addr + HP // 2] = 1
    assert _anon_huge_kib(addr, addr + n) == 0
    done = hugepages.collapse_resident()
    assert done >= 3 * HP
    assert _anon_huge_kib(addr, addr + n) >= 3 * HP // 1024
    # the half-touched stretch keeps its untouched pages unmapped: no RSS growth
    assert _resident_pages(half, HP) == HP // 4096 // 2
    assert (buf[: first - addr + 3 * HP] == 1).all() and buf[half - addr + HP // 2:].max() == 0
    del buf
    m.close()


def test_sessions_collapse_what_their_load_made_resident(tmp_path, monkeypatch):
    """A CPU session collapses the stretches its load made resident (those resident
    before are excluded), huge_pages=False skips it, outputs are the same. How much a
    real model gets is checked on SmolLM2 (integration test_runtime_memory_smollm2): a
    tiny model's weights may fit in memory the process already had."""
    import edgeprune_runtime as runtime
    import edgeprune_runtime.session as rs

    folder, _, _ = export_tiny_llama(tmp_path / "tiny")
    calls = []
    monkeypatch.setattr(rs, "resident_stretches", lambda: {1 << 21, 2 << 21})
    monkeypatch.setattr(rs, "collapse_resident", lambda exclude=(): calls.append(set(exclude)) or 4 << 20)
    with runtime.load(folder, threads=1, huge_pages=False) as s:
        assert s.huge_page_bytes == 0 and calls == []
        ref = s.generate([5, 6, 7], max_new_tokens=6).token_ids
    with runtime.load(folder, threads=1) as s:
        assert s.huge_page_bytes == 4 << 20 and calls == [{1 << 21, 2 << 21}]
        assert s.generate([5, 6, 7], max_new_tokens=6).token_ids == ref


def _vm_rss() -> int:
    return int(next(x for x in open("/proc/self/status") if x.startswith("VmRSS:")).split()[1]) * 1024


@needs_collapse
def test_zero_page_reads_are_not_collapsed(monkeypatch):
    """Pages only read map the shared zero page: resident to mincore, free in RSS.
    Collapsing them allocated real memory (64 MiB read, 1 page in 64 written: RSS +63
    MiB). Checked on the calls ``collapse_resident`` makes: no ``madvise`` on the
    mapping, although mincore calls every stretch of it resident. The mapping's own
    AnonHugePages is not asserted: on a host whose kernel backs hot regions with huge
    pages by itself (khugepaged, DAMON), it failed in a full test run (6,144 KiB) and
    passed alone."""
    real = hugepages._libc()
    calls = []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def madvise(self, addr, length, advice):
            calls.append(addr.value if isinstance(addr, ctypes.c_void_p) else addr)
            return real.madvise(addr, length, advice)

    monkeypatch.setattr(hugepages, "_libc", lambda: Spy())
    n = 16 * HP
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(m, np.uint8)
    assert int(buf.sum()) == 0                 # read everything: zero-page mappings
    buf[::64 * 4096] = 1                       # write one page in 64
    addr = buf.ctypes.data
    mine = [a for a in hugepages.resident_stretches() if addr <= a < addr + n]
    assert len(mine) >= 15                     # resident to mincore (16 when 2 MiB-aligned)
    hugepages.collapse_resident()
    assert [a for a in calls if a is not None and addr <= a < addr + n] == []
    del buf
    m.close()


@needs_collapse
def test_exclude_leaves_earlier_memory_alone():
    n = 6 * HP
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(m, np.uint8)
    buf[:] = 1
    addr = buf.ctypes.data
    before = hugepages.resident_stretches()
    assert hugepages.collapse_resident(before) == 0
    assert _anon_huge_kib(addr, addr + n) == 0
    del buf
    m.close()


def test_off_linux_it_does_nothing(monkeypatch):
    monkeypatch.setattr(hugepages.sys, "platform", "darwin")
    assert hugepages.collapse_resident() == 0
