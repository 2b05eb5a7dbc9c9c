"""The runtime's OS memory management: what the process holds resident, and what it may allocate.

* :func:`check_memory`: a buffer checked against the memory the OS reports available
  (a clear :class:`~runtime.errors.GenerationError` instead of the OOM killer).
* :func:`release_free_heap`: heap freed by the session build handed back to the OS.
* :func:`small_page_cache`: the weight file's row-read tables put in the page cache as
  4 KiB pages before onnxruntime maps the file.
* :func:`drop_mapped_weight_pages` / :func:`weight_mappings`: the memory-mapped weight
  file's resident pages handed back after the session build.
* :class:`WeightPageDropper`: the same, repeatedly *during* the session build, so the
  mapped file and onnxruntime's pre-packed copies of it are never resident together.

Linux-specific where it says so; elsewhere each function does nothing (or returns 0 /
``False``). Huge-page backing of the pre-packed weights is :mod:`runtime.hugepages`.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Iterable, Optional

from .errors import GenerationError

def check_memory(nbytes: int, what: str, fix: str) -> None:
    """Raise :class:`GenerationError` when ``nbytes`` exceed 90 % of the memory the OS
    reports available now (``MemAvailable`` in ``/proc/meminfo``; no check where it is
    absent; the rest is headroom for activations), instead of letting the OOM killer end
    the process."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    if nbytes > 0.9 * avail:
        raise GenerationError(f"{what} needs {nbytes / 2**20:.0f} MiB, more than the "
                              f"{avail / 2**20:.0f} MiB available", fix)


def release_free_heap() -> None:
    """Return heap freed by the session build (graph transforms, prepacking) to the OS
    (glibc ``malloc_trim``), so the generation peak RSS does not sit on top of it."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def small_page_cache(path: Path, ranges: Optional[list] = None) -> bool:
    """Put the row-read tables of the weight file in the page cache as 4 KiB pages
    before onnxruntime maps it.

    After the session build, the runtime drops the mapped weight pages
    (:func:`drop_mapped_weight_pages`); the embedding table shared with the q8
    ``lm_head`` is then read a row per token through that private mapping. When the
    file sits in the page cache as 2 MiB folios (Linux readahead makes them on
    filesystems with large-folio support), each such row read maps a whole 2 MiB folio:
    SmolLM2-135M int4 held 20 MiB of the 28 MiB table resident after 128 tokens (peak
    RSS 224 MiB instead of 214). Evicting the clean, unmapped page-cache pages
    (``POSIX_FADV_DONTNEED``) and reading them back with readahead off
    (``POSIX_FADV_RANDOM``) leaves single pages, so a row costs a page. Never changes
    data: pages mapped or dirty elsewhere are not evicted.

    Args:
        path: ``model.onnx.data``.
        ranges: ``[[offset, length], ...]`` bytes to treat, the exporter's
            ``row_read_ranges`` in ``edgeprune.json`` (the ``Gather`` tables: 29 of 94 MB
            for SmolLM2-135M int4); ``None`` (exports without the field) = the whole
            file (one sequential read, 0.19 s for 94 MB here).

    Returns:
        True when done; False where unsupported (not Linux, no file, an OS error).
    """
    if not hasattr(os, "posix_fadvise") or not path.is_file():
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if ranges is None:
            spans = [(0, size)]
        else:
            page = 4096
            spans = []
            for off, length in ranges:
                a = max(0, int(off)) // page * page
                b = min(size, -(-(int(off) + int(length)) // page) * page)
                if b > a:
                    spans.append((a, b))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)      # the whole fd: no readahead
        chunk = 1 << 16
        for a, b in spans:
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
            pos = a
            while pos < b:
                n = len(os.pread(fd, min(chunk, b - pos), pos))
                if n == 0:
                    break
                pos += n
        return True
    except (OSError, TypeError, ValueError):
        return False
    finally:
        os.close(fd)


def drop_mapped_weight_pages(folder: Path) -> int:
    """Drop the resident pages of this folder's memory-mapped weight file.

    onnxruntime memory-maps page-aligned external initializers (``model.onnx.data``,
    private mappings). Building the session reads them all (pre-packing ``MatMulNBits``
    into its own buffers), which leaves the whole file resident, although afterwards
    only the initializers that are not pre-packed are read, and sparsely: the embedding
    table (shared with the quantized ``lm_head``) is read one row per token.
    ``madvise(MADV_DONTNEED)`` hands those pages back to the page cache; a later read
    faults the page in again from the file. Only mappings without a single
    copy-on-write page (``Anonymous: 0`` in ``/proc/self/smaps``: nothing this process
    wrote) are advised, so no data can be lost. ``Private_Dirty`` alone is not such a
    page: a file written moments ago (a fresh export, a copy) still has dirty page-cache
    pages, which ``smaps`` counts as dirty in every mapping of them; skipping those
    mappings left ~25 MiB more resident (peak RSS 240 vs 215 MiB for SmolLM2-135M int4).
    llama.cpp's mmap'd weights keep the same kind of footprint: only the pages in use
    are resident.

    Returns:
        Bytes of mappings advised (0 where unsupported: not Linux, no mapping).
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        done = 0
        for m in weight_mappings(folder):
            a, b = m["range"]
            if m["Anonymous"] == 0 and libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), 4) == 0:
                done += b - a                                   # 4 = MADV_DONTNEED
        return done
    except (OSError, AttributeError, ValueError):
        return 0


def weight_mappings(folder: Path) -> list[dict]:
    """This process's mappings of ``folder``'s ``model.onnx*`` files, from
    ``/proc/self/smaps``: ``[{"range": (start, end), "Rss": bytes, "Anonymous": bytes}]``
    (``Anonymous``: copy-on-write pages this process wrote).

    Raises:
        OSError: no ``/proc/self/smaps`` (not Linux).
    """
    root = os.path.realpath(folder) + os.sep
    maps, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:
                path = head[5].strip() if len(head) > 5 else ""
                cur = None
                if path.startswith(root) and os.path.basename(path).startswith("model.onnx"):
                    a, b = (int(x, 16) for x in head[0].split("-"))
                    cur = {"range": (a, b), "Rss": 0, "Anonymous": 0}
                    maps.append(cur)
            elif cur is not None and head[0] in ("Rss:", "Anonymous:"):
                cur[head[0][:-1]] += int(head[1]) * 1024
    return maps


def _weight_maps(folder: Path) -> list[tuple[int, int, str, int]]:
    """``(start, end, file name, file offset)`` of this process's mappings of ``folder``'s
    ``model.onnx*`` files, from ``/proc/self/maps`` (a few ms for hundreds of mappings;
    ``/proc/self/smaps``, which :func:`weight_mappings` reads, takes ~50 ms because the
    kernel walks every page table).

    Raises:
        OSError: no ``/proc/self/maps`` (not Linux).
    """
    root = os.path.realpath(folder) + os.sep
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            path = head[5].strip() if len(head) > 5 else ""
            if path.startswith(root) and os.path.basename(path).startswith("model.onnx"):
                a, b = (int(x, 16) for x in head[0].split("-"))
                out.append((a, b, os.path.basename(path), int(head[2], 16)))
    return out


def overlapping_ranges(ranges: Optional[list], spans: Iterable[tuple[int, int]],
                       size: int) -> list[list[int]]:
    """The parts of ``ranges`` (``[[offset, length], ...]``, bytes of a file; ``None`` = the
    whole file of ``size`` bytes) that fall inside ``spans`` (``[(start, end), ...]`` byte
    offsets), as ``[[offset, length], ...]`` sorted by offset; empty when none does."""
    todo = [[0, size]] if ranges is None else ranges
    out = []
    for s, e in sorted(spans):
        for off, length in todo:
            a, b = max(int(off), s), min(int(off) + int(length), e)
            if b > a:
                out.append([a, b - a])
    out.sort()
    merged: list[list[int]] = []
    for a, n in out:
        if merged and a <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], a + n - merged[-1][0])
        else:
            merged.append([a, n])
    return merged


_PAGE = 4096
MADV_PAGEOUT = 21                            # Linux 5.4+: reclaim, never discard
_PRESENT, _FILE_PAGE = 1 << 63, 1 << 61      # /proc/self/pagemap entry bits


def _has_written_pages(pagemap_fd: int, start: int, end: int) -> bool:
    """Whether ``[start, end)`` (a private file mapping) holds a page this process wrote:
    present in memory (pagemap bit 63) but no longer the file's page (bit 61 clear: an
    anonymous copy-on-write page), which ``MADV_DONTNEED`` would throw away. Reads 8 bytes
    of ``/proc/self/pagemap`` per page (320 KiB for a 160 MiB table; no privilege needed
    for these bits)."""
    import numpy as np

    first, n = start // _PAGE, (end - start) // _PAGE
    raw = os.pread(pagemap_fd, 8 * n, 8 * first)
    v = np.frombuffer(raw, np.uint64)
    return bool(np.any((v & np.uint64(_PRESENT)) & ~((v & np.uint64(_FILE_PAGE)) << np.uint64(2))))


def _page_counts(pagemap_fd: int, ranges: list[tuple[int, int]],
                 gap: int = 1 << 20) -> list[tuple[int, int]]:
    """``[(present, written), ...]``: for each ``(start, end)`` of ``ranges`` (page-aligned
    private file mappings), how many of its pages are resident and how many of those this
    process wrote (:func:`_has_written_pages`' test, page by page). Mappings closer than
    ``gap`` bytes are read in one ``pread`` of ``/proc/self/pagemap`` and counted with a
    few numpy operations, so a sweep over the ~190 mappings of a Gemma 3 int4 export takes
    ~1 ms instead of ~4 (one read and several numpy calls per mapping): on a loaded core
    the dropper then keeps up with onnxruntime's pre-packing reads.

    Raises:
        OSError: ``/proc/self/pagemap`` cannot be read.
    """
    import numpy as np

    out: list[tuple[int, int]] = [(0, 0)] * len(ranges)
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    k = 0
    while k < len(order):
        j = k + 1
        while j < len(order) and ranges[order[j]][0] - ranges[order[j - 1]][1] <= gap:
            j += 1
        group = order[k:j]
        lo = ranges[group[0]][0] // _PAGE
        hi = max(ranges[i][1] for i in group) // _PAGE
        v = np.frombuffer(os.pread(pagemap_fd, 8 * (hi - lo), 8 * lo), np.uint64)
        present = (v & np.uint64(_PRESENT)) != 0
        written = present & ((v & np.uint64(_FILE_PAGE)) == 0)
        cp = np.concatenate(([0], np.cumsum(present)))
        cw = np.concatenate(([0], np.cumsum(written)))
        a = np.array([ranges[i][0] // _PAGE - lo for i in group])
        b = np.array([ranges[i][1] // _PAGE - lo for i in group])
        b = np.minimum(b, len(v))
        for i, p, w in zip(group, (cp[b] - cp[a]).tolist(), (cw[b] - cw[a]).tolist()):
            out[i] = (int(p), int(w))
        k = j
    return out


class WeightPageDropper:
    """Hands back the weight file's resident mapped pages over and over while onnxruntime
    builds a session (a context manager around ``ort.InferenceSession(...)``).

    The build reads every memory-mapped initializer once to pre-pack it into a buffer of
    its own, and the mapped pages stay resident until :func:`drop_mapped_weight_pages`
    runs after the build: for that moment the process holds the weights twice. For Gemma 3
    270M int4 (a 166 MiB 8-bit table shared by the head and the embedding) the load then
    peaked at 584 MiB against 440 MiB while generating. A thread here sweeps the
    mappings every ``interval`` seconds, ``MADV_DONTNEED`` on each that has no page this
    process wrote (:func:`_has_written_pages`: nothing can be lost; a page read again
    faults back in from the page cache), so the mapped copy never piles up. Linux only;
    elsewhere (no ``/proc/self/pagemap``, no ``madvise``) it does nothing.

    With ``trim_heap`` (default) each background sweep also hands the heap the build has
    freed back to the OS (:func:`release_free_heap`): onnxruntime frees ~20 MiB of graph
    build memory while it is still pre-packing, which otherwise stayed resident until the
    build ended (Gemma 3 int4, one thread: build peak 376-384 -> 367-372 MiB).

    **Why ``MADV_PAGEOUT`` and not ``MADV_DONTNEED`` here.** The build unmaps each
    pre-packed initializer's mapping while this thread works from the list it read, and the
    next allocation may be placed at the very address (the fp32 SmolLM2-135M export: 184
    weight mappings while pre-packing, 64 when the build returns). ``MADV_DONTNEED`` on
    such a stale range zero-fills the memory now there: pre-packed weights or malloc's own
    bookkeeping (the likely cause of a ``make test`` under load that aborted in a session's
    destructor). ``MADV_PAGEOUT`` (Linux 5.4+) never loses data whatever the range holds:
    clean file pages are reclaimed (re-read from the file on the next touch) and anonymous
    ones stay where there is no swap or are swapped out. It also evicts the clean pages
    from the page cache, so after the build the runtime puts the row-read tables back as
    small pages (:func:`small_page_cache`), only the parts inside the file ranges a sweep
    advised (``paged``: Qwen2.5-Coder-0.5B int4's untied 65 MiB embedding, which the build
    never reads, is no longer read twice; SmolLM2's table, shared with the head, is),
    before the one synchronous
    :func:`drop_mapped_weight_pages`, which runs when no mapping can change under it.
    Kernels without ``MADV_PAGEOUT`` (``EINVAL``) get no background sweeps. The cost is in
    load time, not memory: Gemma 3 270M int4 (RTN) loads in 2.2-2.7 s instead of 1.8-2.5 s
    (0.25 s of it reading the 166 MiB table back), with the same resident size after the
    load and after 128 tokens; SmolLM2-135M unchanged (quiet host, one thread).

    Args:
        folder: the export folder whose ``model.onnx*`` mappings are swept.
        interval: seconds between background sweeps.
        trim_heap: also ``malloc_trim`` after each background sweep.

    Attributes:
        sweeps: sweeps done; ``dropped``: bytes of mappings advised over all sweeps;
        ``paged``: ``{file name: {(start, end), ...}}``, the file byte offsets those
        mappings covered (the page-cache pages the advice may have evicted; a set, so a
        mapping advised on every sweep is held once);
        ``supported``: False once the kernel refused ``MADV_PAGEOUT`` (sweeps stop).
    """

    def __init__(self, folder: Path, interval: float = 0.005, trim_heap: bool = True):
        self.folder, self.interval, self.trim_heap = Path(folder), float(interval), bool(trim_heap)
        self.sweeps = self.dropped = 0
        self.paged: dict[str, set[tuple[int, int]]] = {}    # file name -> (start, end) offsets
        self.supported = True          # False once the kernel refuses MADV_PAGEOUT
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sweep(self) -> int:
        """One pass over the mappings; returns the bytes of mappings advised (0 where
        unsupported). Only mappings holding a resident page are advised, and only those
        without a page this process wrote (:func:`_page_counts`)."""
        try:
            import ctypes
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        except (OSError, AttributeError):
            return 0
        done = 0
        try:
            maps = _weight_maps(self.folder)
            ranges = [(a, b) for a, b, _, _ in maps]
            for (a, b, name, off), (present, written) in zip(maps, _page_counts(fd, ranges)):
                if present and not written:
                    # the range may be stale by now: only a non-destructive advice
                    if libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), MADV_PAGEOUT) == 0:
                        done += b - a
                        self.paged.setdefault(name, set()).add((off, off + b - a))
                    elif ctypes.get_errno() == errno.EINVAL and b > a:   # kernel < 5.4
                        self.supported = False
                        break
        except (OSError, ValueError):
            pass
        finally:
            os.close(fd)
        self.sweeps += 1
        self.dropped += done
        return done

    def _run(self) -> None:
        while self.supported and not self._stop.wait(self.interval):
            self.sweep()
            if self.trim_heap:
                release_free_heap()

    def __enter__(self) -> "WeightPageDropper":
        if hasattr(os, "pread") and os.path.exists("/proc/self/pagemap"):
            self._thread = threading.Thread(target=self._run, name="weight-page-dropper",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


__all__ = ["check_memory", "release_free_heap", "small_page_cache", "drop_mapped_weight_pages",
           "overlapping_ranges", "weight_mappings", "WeightPageDropper"]
