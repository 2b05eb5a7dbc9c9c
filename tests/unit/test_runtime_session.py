"""Runtime session tests: generate/stream/logits/batching/errors on tiny exports."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime
from edgeprune_runtime.errors import GenerationError, RuntimeLoadError

from tiny import rand_ids, byte_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny qwen2 (GQA + bias) exported fused and plain, plus the torch model."""
    from transformers import Qwen2Config
    from tiny import tiny_model
    model = tiny_model(Qwen2Config)
    tok = byte_tokenizer()
    base = tmp_path_factory.mktemp("rt")
    out = {}
    for graph in ("fused", "plain"):
        exporters.export_onnx(model, tok, base / graph, graph=graph, max_length=160,
                              validate=False)
        out[graph] = base / graph
    return model, out


def _torch_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.from_numpy(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("graph", ["fused", "plain"])
def test_greedy_matches_torch_64_tokens(folders, graph):
    model, f = folders
    ids = rand_ids(12, seed=11)
    ref = _torch_greedy(model, ids, 64)
    with runtime.load(f[graph]) as s:
        s.eos_token_ids = []            # random model: never stop early
        res = s.generate(ids[0].tolist(), max_new_tokens=64)
    assert res.token_ids[0] == ref
    assert res.prompt_tokens == [12] and len(res.step_ms) == 63
    assert res.ttft_ms > 0 and res.decode_tok_s > 0 and res.finish_reasons == ["length"]


def test_generic_binding_path_matches_in_place(folders):
    """The decode path GPU sessions take (inputs bound each step, logits taken from the
    binding's outputs) gives the CPU path's tokens: onnxruntime returns bound outputs in
    binding order, and this path used to bind the logits first, then read the output at
    the graph's logits index - a KV buffer."""
    model, f = folders
    ids = rand_ids(10, seed=5)[0].tolist()
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        ref = s.generate([ids, ids[:6]], max_new_tokens=12).token_ids
        s.in_place_io = False
        s._caches.clear()
        got = s.generate([ids, ids[:6]], max_new_tokens=12).token_ids
    assert got == ref and ref[0] == _torch_greedy(model, np.array([ids]), 12)


@pytest.mark.parametrize("graph", ["fused", "plain"])
def test_left_padding_invisible(folders, graph):
    """A prompt alone and in a batch beside a longer one: same logits, same tokens."""
    _, f = folders
    short, long_ = rand_ids(9, seed=1)[0], rand_ids(30, seed=2)[0]
    with runtime.load(f[graph]) as s:
        s.eos_token_ids = []
        ids = np.zeros((2, 30), np.int64)
        mask = np.zeros((2, 30), np.int64)
        ids[0, 21:], mask[0, 21:] = short, 1
        ids[1], mask[1] = long_, 1
        both = s.logits(ids, mask)
        np.testing.assert_allclose(both[0, 21:], s.logits(short[None])[0], atol=1e-5)
        np.testing.assert_allclose(both[1], s.logits(long_[None])[0], atol=1e-5)
        assert not both[0, :21].any()
        assert both.dtype == np.float32          # the plain graph's used to come back float64
        # padded rows are aligned in place: no second [B, S, vocab] array (the fused graph's
        # copy used to double the peak; tracemalloc sees numpy's allocations only)
        import tracemalloc
        tracemalloc.start()
        again = s.logits(ids, mask)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        np.testing.assert_array_equal(again, both)
        assert peak < 0.75 * both.nbytes, (peak, both.nbytes)
        batch = s.generate([short.tolist(), long_.tolist()], max_new_tokens=20)
        a = s.generate(short.tolist(), max_new_tokens=20)
        b = s.generate(long_.tolist(), max_new_tokens=20)
    assert batch.token_ids == [a.token_ids[0], b.token_ids[0]]


def test_stream_equals_generate_and_sampling_seeded(folders):
    _, f = folders
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        kw = dict(max_new_tokens=40, temperature=0.8, top_k=50, top_p=0.95, seed=7)
        g = s.generate("hello world", **kw)
        pieces = list(s.stream("hello world", **kw))
        assert "".join(pieces) == g.text and len(pieces) > 1
        g2 = s.generate("hello world", **kw)
        assert g2.token_ids == g.token_ids
        g3 = s.generate("hello world", **{**kw, "seed": 8})
        assert g3.token_ids != g.token_ids


def test_stop_strings_and_eos(folders):
    _, f = folders
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        full = s.generate("abc", max_new_tokens=30).text
        stop = full[5:7]
        cut = s.generate("abc", max_new_tokens=30, stop=[stop])
        assert cut.text == full[:full.find(stop)] and cut.finish_reasons == ["stop"]
        assert "".join(s.stream("abc", max_new_tokens=30, stop=[stop])) == cut.text
        # make the first greedy token an eos: generation ends with nothing
        first = s.generate("abc", max_new_tokens=1).token_ids[0][0]
        s.eos_token_ids = [first]
        r = s.generate("abc", max_new_tokens=10)
        assert r.token_ids == [[]] and r.finish_reasons == ["eos"]


def test_decode_time_ends_at_the_last_kept_token(folders, monkeypatch):
    """decode_tok_s counts the time from the first to the last token kept: the step whose
    logits gave the end-of-sequence token (dropped) is not decode time (it was, so a short
    answer read slower than the same steps ending at max_new_tokens)."""
    import time as _time
    _, f = folders
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        toks = s.generate("abc", max_new_tokens=12).token_ids[0]
        first = next(i for i in range(3, 12) if toks.index(toks[i]) == i)   # a new token
        eos = toks[first]
        s.eos_token_ids = [eos]
        real, calls = s._decode_step, []

        def slow_last(st, feed):
            calls.append(1)
            if len(calls) == first:        # this step's logits give the eos token
                _time.sleep(0.3)
            return real(st, feed)

        monkeypatch.setattr(s, "_decode_step", slow_last)
        r = s.generate("abc", max_new_tokens=12)
    assert r.token_ids == [toks[:first]] and r.finish_reasons == ["eos"] and first >= 3
    assert (first - 1) / r.decode_tok_s < 0.1          # seconds of decode: the 0.3 s left out


def test_chat_template(folders):
    _, f = folders
    with runtime.load(f["fused"]) as s:
        r = s.generate("hi", max_new_tokens=2, chat=True)
        assert r.prompt_tokens == [len("<user>hi<assistant>")]


def test_kv_cache_sized_from_graph_and_preallocated(folders):
    _, f = folders
    with runtime.load(f["fused"], max_length=100) as s:
        # 2 layers x 2 kv heads x 16 dims x 4 bytes per token
        assert s.kv_cache_bytes(100) == {"k": 2 * 2 * 16 * 4 * 100, "v": 2 * 2 * 16 * 4 * 100}
        s.eos_token_ids = []
        s.generate("abc", max_new_tokens=5)
        cache = s._caches[1]
        bufs = [a.ctypes.data for a in cache.arrays]
        assert cache.arrays[0].shape == (1, 2, 100, 16)
        s.generate("abcdef", max_new_tokens=50)
        assert [a.ctypes.data for a in s._caches[1].arrays] == bufs   # reused, not reallocated
        assert s.weights_bytes > 0


def test_context_overflow_policies(folders):
    model, f = folders
    with runtime.load(f["fused"], max_length=32) as s:
        s.eos_token_ids = []
        with pytest.raises(GenerationError, match="max_length=32"):
            s.generate(rand_ids(20)[0].tolist(), max_new_tokens=20)
        with pytest.raises(GenerationError, match="max_length=32"):
            s.generate(rand_ids(40)[0].tolist(), max_new_tokens=1)
        with pytest.raises(GenerationError, match="max_length=32"):
            s.generate(rand_ids(20)[0].tolist(), max_new_tokens=14)     # 33 cached
        # exactly full: 20 + 13 new = 32 cached tokens (the 13th is never fed back)
        ids = rand_ids(20, seed=5)[0].tolist()
        full = s.generate(ids, max_new_tokens=13)
        with runtime.load(f["fused"]) as roomy:             # 160-token context
            roomy.eos_token_ids = []
            assert full.token_ids == roomy.generate(ids, max_new_tokens=13).token_ids
        assert len(s.generate(rand_ids(32)[0].tolist(), max_new_tokens=1).token_ids[0]) == 1
    with runtime.load(f["fused"], max_length=32, context_policy="sliding_window") as s:
        s.eos_token_ids = []
        ids = rand_ids(20, seed=3)[0].tolist()
        r = s.generate(ids, max_new_tokens=40)
        assert len(r.token_ids[0]) == 40
        # up to the window the tokens equal an unbounded run
        ref = _torch_greedy(model, np.array([ids]), 12)
        assert r.token_ids[0][:12] == ref
        # a prompt longer than the context keeps the overflow's window: its last 16 tokens
        long_ids = rand_ids(40, seed=4)[0].tolist()
        cut = s.generate(long_ids, max_new_tokens=8)
        assert cut.prompt_tokens == [16]
        assert cut.token_ids[0] == _torch_greedy(model, np.array([long_ids[-16:]]), 8)
        # in a batch only the full row is cut: each row gives what it gives alone (the
        # short rows used to be cut too, when the longest one filled)
        rows = [rand_ids(28, seed=6)[0].tolist(), [7], [8, 9]]
        together = s.generate(rows, max_new_tokens=40).token_ids
        assert together == [s.generate(r, max_new_tokens=40).token_ids[0] for r in rows]


def test_bad_inputs(folders, tmp_path):
    _, f = folders
    with pytest.raises(RuntimeLoadError, match="missing"):
        runtime.load(tmp_path)
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(f["fused"], bad)
    (bad / "model.onnx").write_bytes(b"not an onnx file")
    with pytest.raises(RuntimeLoadError, match="corrupt"):
        runtime.load(bad)
    (bad / "model.onnx").unlink()
    with pytest.raises(RuntimeLoadError, match="model.onnx"):
        runtime.load(bad)
    with pytest.raises(RuntimeLoadError, match="device"):
        runtime.load(f["fused"], device="tpu")
    with runtime.load(f["fused"]) as s:
        for empty in ("", [], [""]):
            with pytest.raises(GenerationError, match="empty"):
                s.generate(empty)
        with pytest.raises(GenerationError, match="max_new_tokens"):
            s.generate("a", max_new_tokens=0)
        with pytest.raises(GenerationError, match="temperature"):
            s.generate("a", temperature=-1)
        with pytest.raises(GenerationError, match="out of range"):
            s.generate([1, 2, 9999])
    with pytest.raises(GenerationError, match="exceeds"):
        runtime.load(f["fused"], max_length=10_000)


def test_two_sessions_in_threads(folders):
    _, f = folders
    prompts = ["one two", "three four five"]
    alone = []
    for p in prompts:
        with runtime.load(f["fused"], threads=1) as s:
            s.eos_token_ids = []
            alone.append(s.generate(p, max_new_tokens=30).token_ids)
    got = [None, None]

    def work(i):
        with runtime.load(f["fused"], threads=1) as s:
            s.eos_token_ids = []
            got[i] = s.generate(prompts[i], max_new_tokens=30).token_ids

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert got == alone


def test_runtime_without_torch(folders):
    """`import edgeprune_runtime` and a full generate with torch/transformers unimportable."""
    _, f = folders
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import edgeprune_runtime as runtime\n"
        f"s = runtime.load({str(f['fused'])!r})\n"
        "r = s.generate('hello', max_new_tokens=8)\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "print('OK', len(r.token_ids[0]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK")


def test_mapped_weight_pages_dropped_for_a_freshly_written_folder(tmp_path, monkeypatch):
    """The weight file's pages are handed back after the session build even when the
    file was written moments ago: its dirty page-cache pages count as Private_Dirty in
    /proc/self/smaps without being copy-on-write pages (once, such mappings were skipped
    and a fresh SmolLM2-135M export peaked 25 MiB higher). Decoding still reads the
    right weights afterwards."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("needs Linux /proc/self/smaps")
    import shutil
    from transformers import LlamaConfig
    from tiny import tiny_model
    model = tiny_model(LlamaConfig, tie_word_embeddings=True)
    tok = byte_tokenizer()
    exporters.export_onnx(model, tok, tmp_path / "a", precision="int4", max_length=64,
                          validate=False)
    ids = rand_ids(12, seed=2)
    with runtime.load(tmp_path / "a") as s:
        ref = s.logits(ids)
    shutil.copytree(tmp_path / "a", tmp_path / "fresh")   # new file: dirty page cache
    import edgeprune_runtime.memory as rm
    # the load's page-cache re-read (POSIX_FADV_DONTNEED) starts writeback of the dirty
    # pages; skip it so this checks the drop rule itself
    monkeypatch.setattr(rm, "small_page_cache", lambda path, ranges=None: False)
    with runtime.load(tmp_path / "fresh") as s:
        maps = rm.weight_mappings(tmp_path / "fresh")
        assert maps and sum(m["Rss"] for m in maps) == 0
        np.testing.assert_array_equal(s.logits(ids), ref)


def test_small_page_cache_reads_only_the_row_read_tables(tmp_path, monkeypatch):
    """The exporter records the byte ranges of the tables read a row at a time (the data
    inputs of ``Gather``: here the q8 table shared by the embedding and the head, its
    float zero points) and the runtime re-reads exactly those page-aligned ranges
    before loading, not the whole weight file; exports without the field fall back to
    the whole file."""
    import onnx
    from transformers import LlamaConfig
    from tiny import tiny_model
    import edgeprune_runtime.memory as rm
    model = tiny_model(LlamaConfig, tie_word_embeddings=True)
    r = exporters.export_onnx(model, byte_tokenizer(), tmp_path / "a", precision="int4",
                              max_length=64, validate=False)
    ranges = r.metadata["row_read_ranges"]
    data = tmp_path / "a" / "model.onnx.data"
    proto = onnx.load(str(tmp_path / "a" / "model.onnx"), load_external_data=False)
    ext = {t.name: {e.key: e.value for e in t.external_data} for t in proto.graph.initializer
           if t.data_location == onnx.TensorProto.EXTERNAL}
    gathered = sorted({n.input[0] for n in proto.graph.node
                       if n.op_type == "Gather" and n.input[0] in ext})
    # the codes are gathered directly (the scales pass a Reshape that onnxruntime folds
    # into a copy of its own, so their file pages are never row-read)
    assert "lm_head.qweight" in gathered
    spans = sorted((int(ext[n]["offset"]), int(ext[n]["length"])) for n in gathered)
    # every gathered table inside one recorded range, nothing else
    for off, length in spans:
        assert any(a <= off and off + length <= a + n for a, n in ranges)
    assert sum(n for _, n in ranges) <= sum(n for _, n in spans) + 4096 * len(spans)
    assert sum(n for _, n in ranges) < data.stat().st_size / 2
    read = []
    real = os.pread
    monkeypatch.setattr(rm.os, "pread", lambda fd, n, off: read.append((off, n)) or real(fd, n, off))
    assert rm.small_page_cache(data, ranges)
    expect = sum(-(-(a + n) // 4096) * 4096 - a // 4096 * 4096 for a, n in ranges)
    assert sum(n for _, n in read) == min(expect, data.stat().st_size)
    assert min(o for o, _ in read) == ranges[0][0] // 4096 * 4096
    read.clear()
    assert rm.small_page_cache(data, None)
    assert sum(n for _, n in read) == data.stat().st_size
    with runtime.load(tmp_path / "a") as s:      # and the load path passes the ranges
        assert s.meta["row_read_ranges"] == ranges


def test_stream_tells_its_finish_reason_and_result(folders):
    _, f = folders
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        it = s.stream("abc", max_new_tokens=12)
        assert it.finish_reason is None and it.result is None
        text = "".join(it)
        assert it.finish_reason == "length" and it.result.text == text
        assert len(it.result.token_ids[0]) == 12 and it.result.prompt_tokens == [3]
        stop = text[3:5]
        it = s.stream("abc", max_new_tokens=12, stop=stop)
        assert "".join(it) == text[:text.find(stop)] and it.finish_reason == "stop"
        s.eos_token_ids = [s.generate("abc", max_new_tokens=1).token_ids[0][0]]
        it = s.stream("abc", max_new_tokens=12)
        assert list(it) == [] and it.finish_reason == "eos"
        it = s.stream("abc", max_new_tokens=12)
        it.close()
        assert it.finish_reason == "cancelled"


@pytest.mark.parametrize("paged, again", [
    (None, None),                    # the build evicted nothing: no second read
    ("all", "ranges"),               # everything evicted: every row-read range again
    ("head", "head"),                # only part of the file: only the row-read part inside it
])
def test_load_reads_back_only_the_evicted_row_read_ranges(tmp_path, monkeypatch, paged, again):
    """After the build the runtime puts back as small pages only the row-read ranges
    inside the file spans the dropper's ``MADV_PAGEOUT`` sweeps covered."""
    from transformers import LlamaConfig
    from tiny import tiny_model
    import edgeprune_runtime.memory as rm
    model = tiny_model(LlamaConfig, tie_word_embeddings=True)
    r = exporters.export_onnx(model, byte_tokenizer(), tmp_path / "a", precision="int4",
                              max_length=64, validate=False)
    ranges = r.metadata["row_read_ranges"]
    data = tmp_path / "a" / "model.onnx.data"
    size = data.stat().st_size
    first_off, first_len = ranges[0]
    spans = {None: {}, "all": {"model.onnx.data": [(0, size)]},
             "head": {"model.onnx.data": [(first_off, first_off + first_len)]}}[paged]

    class FakeDropper:
        def __init__(self, folder):
            self.paged, self.dropped = spans, sum(b - a for v in spans.values() for a, b in v)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    calls = []
    monkeypatch.setattr(rm, "WeightPageDropper", FakeDropper)
    monkeypatch.setattr(rm, "small_page_cache", lambda path, rr=None: calls.append(rr) or True)
    with runtime.load(tmp_path / "a"):
        pass
    want = {None: None, "ranges": ranges, "head": [[first_off, first_len]]}[again]
    assert calls[0] == ranges
    assert calls[1:] == ([] if want is None else [want])
