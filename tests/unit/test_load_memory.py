"""What a load holds in memory: the tokenizer file's merges form and the weight pages
dropped while onnxruntime builds the session (issue 22: Gemma 3 270M's peak RSS)."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import pytest

from edgeprune_exporters.folder import MERGES_CHECK_TEXT, compact_merges
import edgeprune_runtime.memory as rm

TEXTS = [MERGES_CHECK_TEXT, "the cat sat on the mat; then the hat", "aaaa bbbb abab"]


def _bpe_file(tmp_path: Path, extra_token: str | None = None) -> Path:
    """A small byte-fallback-free BPE tokenizer.json as ``tokenizers`` >= 0.20 writes it
    (merges as pairs), trained on a few sentences."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=120,
                                                             special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    if extra_token is not None:                     # a merge whose part holds a space
        d = json.loads(path.read_text())
        a, b = extra_token.split("|")
        d["model"]["vocab"][a + b] = len(d["model"]["vocab"])
        d["model"]["vocab"].setdefault(a, len(d["model"]["vocab"]))
        d["model"]["merges"].append([a, b])
        path.write_text(json.dumps(d))
    return path


def test_compact_merges_writes_strings_and_keeps_every_id(tmp_path):
    from tokenizers import Tokenizer

    path = _bpe_file(tmp_path)
    before = json.loads(path.read_text())["model"]["merges"]
    assert before and all(isinstance(m, list) for m in before)
    ref = Tokenizer.from_file(str(path))
    size = path.stat().st_size
    assert compact_merges(path) is True
    after = json.loads(path.read_text())["model"]["merges"]
    assert after == [f"{a} {b}" for a, b in before]
    assert path.stat().st_size < size                     # no indentation either
    new = Tokenizer.from_file(str(path))
    assert new.get_vocab() == ref.get_vocab()
    for t in TEXTS:
        assert new.encode(t).ids == ref.encode(t).ids
    assert compact_merges(path) is False                  # already strings: left alone


def test_compact_merges_leaves_a_merge_with_a_space_alone(tmp_path):
    path = _bpe_file(tmp_path, extra_token="a b|c")
    raw = path.read_bytes()
    assert compact_merges(path) is False
    assert path.read_bytes() == raw


def _mapped(tmp_path: Path, pages: int = 64):
    """``folder/model.onnx.data`` of ``pages`` pages mapped private and writable (as
    onnxruntime maps external initializers), every page read once; returns
    ``(folder, mmap, content)``."""
    folder = tmp_path / "export"
    folder.mkdir()
    content = os.urandom(pages * 4096)
    with open(folder / "model.onnx.data", "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())      # clean pages: MADV_PAGEOUT keeps dirty ones resident
    with open(folder / "model.onnx.data", "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
    assert sum(m[i * 4096] for i in range(pages)) >= 0    # fault every page in
    return folder, m, content


def _resident(folder: Path) -> int:
    return sum(x["Rss"] for x in rm.weight_mappings(folder))


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc/self/pagemap")
def test_weight_page_dropper_hands_back_read_pages_and_keeps_written_ones(tmp_path):
    folder, m, content = _mapped(tmp_path)
    try:
        assert _resident(folder) == len(content)
        (a, b, _, _), = rm._weight_maps(folder)
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            assert rm._has_written_pages(fd, a, b) is False
            dropper = rm.WeightPageDropper(folder)
            assert dropper.sweep() == len(content)
            assert _resident(folder) == 0
            assert m[:] == content                       # read back from the file
            m[5 * 4096] = (content[5 * 4096] + 1) % 256  # a copy-on-write page
            assert rm._has_written_pages(fd, a, b) is True
        finally:
            os.close(fd)
        assert dropper.sweep() == 0                       # never advised: the write is kept
        assert m[5 * 4096] == (content[5 * 4096] + 1) % 256
        assert dropper.sweeps == 2 and dropper.dropped == len(content)
    finally:
        m.close()


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc/self/pagemap")
def test_weight_page_dropper_sweeps_in_the_background_until_closed(tmp_path):
    folder, m, content = _mapped(tmp_path)
    try:
        with rm.WeightPageDropper(folder, interval=0.001) as d:
            import time
            t0 = time.monotonic()
            while d.sweeps < 3 and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            assert m[:] == content                        # pages fault back in
        done = d.sweeps
        assert done >= 3 and d.dropped >= len(content)
        time.sleep(0.05)
        assert d.sweeps == done                           # stopped with the block
    finally:
        m.close()


def test_load_memory_stages_of_a_tiny_export(tmp_path, benchlib, monkeypatch):
    """bench/load_memory.py's stage worker: one reading per stage, resident sizes that
    grow with what is loaded, every peak at least the resident size at that point."""
    import sys

    from bench_modules import load_bench
    from tiny import export_tiny_llama

    folder, _, _ = export_tiny_llama(tmp_path / "tiny", precision="int4", max_length=64)
    monkeypatch.setitem(sys.modules, "compare_llamacpp", load_bench("compare_llamacpp"))
    st = load_bench("load_memory").worker_stages(str(folder), 1, 16, 8)
    assert list(st) == ["imports", "tokenizer", "session", "generate"]
    for k, v in st.items():
        assert 0 < v["rss"] <= v["hwm"] + 1e-6, k
    assert st["generate"]["hwm"] >= st["session"]["hwm"] >= st["imports"]["hwm"]


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc/self/pagemap")
def test_page_counts_per_mapping_in_one_read(tmp_path):
    """``_page_counts`` over several mappings (read together): resident pages and written
    (copy-on-write) pages per mapping, as ``_has_written_pages`` sees them one by one; a
    sweep advises only the mappings with resident pages and no written one."""
    folder, m, content = _mapped(tmp_path, pages=32)
    extra = []
    try:
        with open(folder / "model.onnx.data", "rb") as f:
            for _ in range(2):
                extra.append(mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                       prot=mmap.PROT_READ | mmap.PROT_WRITE))
        extra[0][7 * 4096] = (content[7 * 4096] + 1) % 256       # written: 1 page present
        assert extra[1][3 * 4096] == content[3 * 4096]            # read: 1 page (+ fault-around)
        ranges = [(a, b) for a, b, _, _ in rm._weight_maps(folder)]
        assert len(ranges) == 3
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            counts = rm._page_counts(fd, ranges)
            for (a, b), (present, written) in zip(ranges, counts):
                assert (written > 0) == rm._has_written_pages(fd, a, b)
                assert 1 <= present <= 32
            assert sorted(w for _, w in counts) == [0, 0, 1]
            assert sorted(p for p, _ in counts)[-1] == 32          # the fully read one
        finally:
            os.close(fd)
        d = rm.WeightPageDropper(folder)
        assert d.sweep() == 2 * len(content)                      # not the written one
        assert extra[0][7 * 4096] == (content[7 * 4096] + 1) % 256
        assert m[:] == content and extra[1][:] == content
    finally:
        for x in extra:
            x.close()
        m.close()


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc/self/pagemap")
@pytest.mark.parametrize("trim", [True, False])
def test_weight_page_dropper_trims_the_heap_while_sweeping(tmp_path, monkeypatch, trim):
    """Each background sweep also hands freed heap back (``release_free_heap``: what the
    session build frees while it is still pre-packing), unless ``trim_heap=False``."""
    import time

    folder, m, _ = _mapped(tmp_path, pages=4)
    calls = []
    monkeypatch.setattr(rm, "release_free_heap", lambda: calls.append(1))
    try:
        with rm.WeightPageDropper(folder, interval=0.001, trim_heap=trim) as d:
            t0 = time.monotonic()
            while d.sweeps < 3 and time.monotonic() - t0 < 10:
                time.sleep(0.01)
        assert d.sweeps >= 3
        assert (len(calls) >= 3) if trim else calls == []
    finally:
        m.close()


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc/self/pagemap")
def test_weight_page_dropper_never_discards_what_a_stale_range_now_holds(tmp_path, monkeypatch):
    """The build unmaps pre-packed initializers while a sweep works from the list it read,
    and the next allocation may take the same address. A sweep that finds such a range
    (listed as a clean weight mapping, now anonymous memory holding data) must leave the
    data intact: ``MADV_PAGEOUT`` reclaims without discarding, where ``MADV_DONTNEED``
    zero-filled it."""
    import ctypes

    heap = mmap.mmap(-1, 16 * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # now at the address
    data = os.urandom(16 * 4096)
    heap[:] = data
    a = ctypes.addressof(ctypes.c_char.from_buffer(heap))
    monkeypatch.setattr(rm, "_weight_maps", lambda folder: [(a, a + 16 * 4096, "model.onnx.data", 0)])
    monkeypatch.setattr(rm, "_page_counts", lambda fd, ranges: [(16, 0)])   # the stale view
    try:
        d = rm.WeightPageDropper(tmp_path)
        assert d.sweep() == 16 * 4096 and d.supported
        assert heap[:] == data
    finally:
        heap.close()


def test_overlapping_ranges_exact():
    """The row-read ranges a sweep may have evicted: intersections, sorted and merged;
    ``None`` stands for the whole file."""
    ranges = [[100, 50], [1000, 500], [4096, 8192]]
    assert rm.overlapping_ranges(ranges, [(0, 4096)], 20000) == [[100, 50], [1000, 500]]
    assert rm.overlapping_ranges(ranges, [(120, 1200), (8000, 9000)], 20000) == \
        [[120, 30], [1000, 200], [8000, 1000]]
    assert rm.overlapping_ranges(ranges, [(150, 1000), (12288, 16384)], 20000) == []
    assert rm.overlapping_ranges(None, [(8192, 12288), (4096, 8192)], 20000) == [[4096, 8192]]
    assert rm.overlapping_ranges(ranges, [], 20000) == []


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc/self/pagemap")
def test_weight_page_dropper_records_the_file_offsets_it_paged_out(tmp_path):
    """``paged`` holds the file byte ranges of the mappings a sweep advised, at their file
    offsets (a mapping of the file's second half reports the second half)."""
    folder, m, content = _mapped(tmp_path, pages=8)
    with open(folder / "model.onnx.data", "rb") as f:
        half = mmap.mmap(f.fileno(), 4 * 4096, offset=4 * 4096, flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ)
    try:
        assert half[:] == content[4 * 4096:]
        d = rm.WeightPageDropper(folder)
        assert d.sweep() == len(content) + 4 * 4096
        assert sorted(d.paged["model.onnx.data"]) == [(0, 8 * 4096), (4 * 4096, 8 * 4096)]
        assert m[:] == content and half[:] == content[4 * 4096:]   # faulted back in
        assert d.sweep() == len(content) + 4 * 4096           # advised again, held once
        assert len(d.paged["model.onnx.data"]) == 2
        m[0] = (content[0] + 1) % 256                      # written: not advised again
        assert half[0] == content[4 * 4096]                # faulted back in
        d.paged.clear()
        assert d.sweep() == 4 * 4096
        assert d.paged == {"model.onnx.data": {(4 * 4096, 8 * 4096)}}
    finally:
        half.close()
        m.close()
