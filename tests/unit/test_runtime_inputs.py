"""Runtime input checks and KV-buffer sizing found by a newcomer's review (issue 5):
each bad input gets a GenerationError / RuntimeLoadError naming the fix, never a raw
TypeError / AttributeError / hang / OOM kill."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime
import edgeprune_runtime.generation as rg
import edgeprune_runtime.memory as rm
from edgeprune_runtime.errors import DeviceError, GenerationError, RuntimeLoadError

from tiny import byte_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Tiny llama exported fused with a 600-token context (room for several KV sizes)."""
    from transformers import LlamaConfig
    from tiny import tiny_model
    out = tmp_path_factory.mktemp("inputs") / "fused"
    exporters.export_onnx(tiny_model(LlamaConfig, max_position_embeddings=1024), byte_tokenizer(), out,
                          max_length=600, validate=False)
    return out


def test_kv_buffers_sized_per_call_and_reused(folder, monkeypatch):
    """Above FULL_KV_BYTES the KV buffers hold prompt + max_new_tokens rounded up to 256
    tokens (capped at max_length), not the whole context for every row; a later call that fits reuses
    them, a longer one replaces them; the size is checked against available memory."""
    with runtime.load(folder) as s:                  # a small cache spans the whole context
        s.generate([5, 6, 7], max_new_tokens=4)
        assert s._caches[1].arrays[0].shape[2] == 600
    monkeypatch.setattr(rg, "FULL_KV_BYTES", 0)       # as if the whole context were large
    asked = []
    real = rm.check_memory
    monkeypatch.setattr(rm, "check_memory",
                        lambda n, what, fix: ("KV cache" in what and asked.append(n)) or real(n, what, fix))
    with runtime.load(folder) as s:
        s.eos_token_ids = []
        s.generate([5, 6, 7], max_new_tokens=4)
        c = s._caches[1]
        assert c.arrays[0].shape[2] == 256
        assert asked == [sum(s.kv.bytes(256, 1).values())]
        bufs = [a.ctypes.data for a in c.arrays]
        s.generate([5, 6, 7, 8], max_new_tokens=100)           # fits: same buffers
        assert [a.ctypes.data for a in s._caches[1].arrays] == bufs
        r_long = s.generate([5, 6, 7], max_new_tokens=300)     # 303 -> 512
        assert s._caches[1].arrays[0].shape[2] == 512 and len(r_long.token_ids[0]) == 300
        s.generate([5, 6, 7], max_new_tokens=590)              # 593 -> capped at 600
        assert s._caches[1].arrays[0].shape[2] == 600
        # the result does not depend on the buffer size
        r = s.generate([5, 6, 7], max_new_tokens=300)
        assert r.token_ids == r_long.token_ids
        s.generate(["ab", "cd"], max_new_tokens=2)
        assert s._caches[2].arrays[0].shape[:3] == (2, s.kv.kv_heads[0], 256) and 1 not in s._caches
    with runtime.load(folder, context_policy="sliding_window") as s:
        s.generate([5, 6], max_new_tokens=2)
        assert s._caches[1].arrays[0].shape[2] == 600          # may run past: whole context


def test_unequal_rows_prefilled_one_by_one_give_the_same_tokens(folder, monkeypatch):
    """A batch whose kept prefill logits (B x (longest - shortest + 1) x vocab) would pass
    PREFILL_LOGITS_BYTES is prefilled a row at a time into the rows of the KV buffers:
    same tokens as the batched prefill and as each prompt alone."""
    prompts = [list(range(3, 60)), [5], [9, 10, 11]]
    with runtime.load(folder) as s:
        s.eos_token_ids = []
        batched = s.generate(prompts, max_new_tokens=6).token_ids
        alone = [s.generate(p, max_new_tokens=6).token_ids[0] for p in prompts]
        calls = []
        orig = s._run_fused
        monkeypatch.setattr(s, "_run_fused", lambda *a: calls.append(a[0].shape) or orig(*a))
        monkeypatch.setattr(rg, "PREFILL_LOGITS_BYTES", 0)
        rowwise = s.generate(prompts, max_new_tokens=6).token_ids
    assert rowwise == batched == alone
    assert calls == [(1, 57), (1, 1), (1, 3)]


def test_logits_checks_its_buffers_against_memory(folder, monkeypatch):
    """logits() allocates a KV cache and B x S x vocab logits: checked like generate()'s."""
    seen = []
    monkeypatch.setattr(rm, "check_memory", lambda n, what, fix: seen.append((n, what)))
    with runtime.load(folder) as s:
        s.logits(np.array([[1, 2, 3, 4]] * 2))
        kv = sum(s.kv.bytes(4, 2).values())
    assert (kv + 2 * 4 * s.vocab_size * 4, "the KV cache and logits of 2 row(s) x 4 tokens") in seen


def test_check_memory_names_the_size_and_the_fix():
    with pytest.raises(GenerationError, match=r"needs \d+ MiB, more than .* available.*fewer rows"):
        rm.check_memory(1 << 60, "the KV cache for 9 row(s) x 256 tokens", "generate fewer rows")
    rm.check_memory(1024, "x", "y")                           # small: fine


def test_suspended_stream_raises_instead_of_hanging(folder):
    with runtime.load(folder) as s:
        # argument errors come at the call, not at the first next()
        with pytest.raises(GenerationError, match="temperature"):
            s.stream("abc", temperature=-1)
        with pytest.raises(GenerationError, match="max_new_tokens"):
            s.stream("abc", max_new_tokens=True)
        assert "".join(s.stream([{"role": "user", "content": "hi"}], max_new_tokens=3)) == \
            s.generate([{"role": "user", "content": "hi"}], max_new_tokens=3).texts[0]
        s.eos_token_ids = []
        full = s.generate("abc", max_new_tokens=12).texts[0]
        assert "".join(s.stream("abc", max_new_tokens=12, stop=full[2:4])) == full[:full.find(full[2:4])]
        it = s.stream("abc", max_new_tokens=20)
        next(it)
        with pytest.raises(GenerationError, match="stream.*still open"):
            s.generate("ab", max_new_tokens=2)
        with pytest.raises(GenerationError, match="stream.*still open"):
            s.logits(np.array([[1, 2, 3]]))
        it.close()
        assert len(s.generate("ab", max_new_tokens=2).token_ids[0]) >= 1


def test_stop_and_prompt_types(folder):
    with runtime.load(folder) as s:
        s.eos_token_ids = []
        full = s.generate("abc", max_new_tokens=12).texts[0]
        assert len(full) >= 4
        word = full[2:4]
        one = s.generate("abc", max_new_tokens=12, stop=word)
        assert one.texts == s.generate("abc", max_new_tokens=12, stop=[word]).texts
        assert one.texts[0] == full[:full.find(word)] and one.finish_reasons == ["stop"]
        for bad in ([1], 5, ["a", None]):
            with pytest.raises(GenerationError, match="stop must be"):
                s.generate("abc", stop=bad)
        for bad, msg in (([1.5, 2.0], "neither a string nor integer"),
                         (np.array([1.5, 2.2]), "neither a string nor integer"),
                         (None, "must be a string"), (5, "must be a string"),
                         (b"abc", "must be a string"), ([True, 2], "neither")):
            with pytest.raises(GenerationError, match=msg):
                s.generate(bad, max_new_tokens=2)
        with pytest.raises(GenerationError, match="row 1"):
            s.generate(["ab", ""], max_new_tokens=2)


def test_chat_messages_and_a_broken_template(folder, tmp_path):
    with runtime.load(folder) as s:
        msgs = [{"role": "user", "content": "hi"}]
        a = s.generate(msgs, max_new_tokens=3)
        b = s.generate("hi", max_new_tokens=3, chat=True)
        assert a.token_ids == b.token_ids and a.prompt_tokens == b.prompt_tokens
        # token ids cannot be templated: said, not silently ignored
        with pytest.raises(GenerationError, match="chat=True renders the chat template"):
            s.generate([5, 6, 7], max_new_tokens=2, chat=True)
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content ")
    with runtime.load(bad) as s:
        with pytest.raises(GenerationError, match="chat template failed.*no-chat"):
            s.generate("hi", chat=True)
        assert s.generate("hi", max_new_tokens=1, chat=False).token_ids


def _error_of(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except Exception as e:          # noqa: BLE001 - the test inspects it
        return e
    return None


@pytest.mark.parametrize("ids, mask, needle", [
    ([[1, 2, 9999]], None, "out of range"),
    ([[1, -1, 3]], None, "out of range"),          # used to wrap around to the last row
    ([[1.0, 2.0]], None, "integer token ids"),
    (np.ones((1, 2, 3), np.int64), None, "integer token ids"),
    ([[1, 2, 3]], [[1, 1, 0]], "padding after a real token"),   # right padding: shifted output
    ([[1, 2, 3]], [[0, 2, 1]], "0/1"),
    ([[1, 2, 3]], [[1, 1]], "0/1 of the ids' shape"),
    ([[1, 2, 3]], [[0, 0, 0]], "no real token"),
])
def test_logits_checks_its_inputs(folder, ids, mask, needle):
    with runtime.load(folder) as s:
        with pytest.raises(GenerationError, match=needle):
            s.logits(np.asarray(ids), None if mask is None else np.asarray(mask))
        # left padding still works and matches the unpadded row
        np.testing.assert_allclose(s.logits(np.array([[7, 1, 2, 3]]), np.array([[0, 1, 1, 1]]))[0, 1:],
                                   s.logits(np.array([[1, 2, 3]]))[0], atol=1e-5)


def test_closed_session_and_load_arguments(folder, tmp_path):
    s = runtime.load(folder)
    it = s.stream("abc", max_new_tokens=10)
    next(it)
    s.close()
    with pytest.raises(GenerationError, match="closed"):
        next(it)
    with pytest.raises(GenerationError, match="closed"):
        s.logits(np.array([[1, 2, 3]]))
    # a stream made before close() and first read after it; a call that was waiting for
    # the lock in another thread (both used to hit the released onnxruntime session)
    s = runtime.load(folder)
    it = s.stream("abc", max_new_tokens=3)
    s.close()
    with pytest.raises(GenerationError, match="closed"):
        next(it)
    s = runtime.load(folder)
    s._lock.acquire()
    errs = []
    t = threading.Thread(target=lambda: errs.append(_error_of(s.generate, "abc", max_new_tokens=2)))
    t.start()
    s.close()
    s._lock.release()
    t.join(30)
    assert errs and isinstance(errs[0], GenerationError) and "closed" in str(errs[0])
    # close() from another thread while a prefill runs: the call ends with the closed
    # error at its next step, and the session is freed when it lets go (it used to free
    # it under the running call: AttributeError 'NoneType' ... 'io_binding')
    s = runtime.load(folder)
    inside, go = threading.Event(), threading.Event()
    orig = s._prefill

    def slow_prefill(*a, **k):
        inside.set()
        go.wait(30)
        return orig(*a, **k)

    s._prefill = slow_prefill
    errs = []
    t = threading.Thread(target=lambda: errs.append(_error_of(s.generate, "abc", max_new_tokens=4)))
    t.start()
    assert inside.wait(30)
    s.close()
    assert s.sess is not None                      # not under the running call
    go.set()
    t.join(30)
    assert isinstance(errs[0], GenerationError) and "closed" in str(errs[0]), errs
    assert s.sess is None and not s._lock.locked()
    # close() landing between a holder's last check and its release (the lock still
    # held, so close() cannot free): the holder looks again once the lock is free
    s = runtime.load(folder)

    class CloseDuringRelease:
        def __init__(self):
            self.inner, self.fired = threading.Lock(), False

        def acquire(self, blocking=True):
            return self.inner.acquire(blocking)

        def locked(self):
            return self.inner.locked()

        def release(self):
            if not self.fired:
                self.fired = True
                s.close()                          # finds the lock held: frees nothing
            self.inner.release()

    s._lock = CloseDuringRelease()
    s._lock.acquire()
    s._release()
    assert s._closed and s.sess is None
    with pytest.raises(RuntimeLoadError, match="folder must be a path"):
        runtime.load(None)
    for kw in ({"max_length": 0}, {"max_length": -5}, {"threads": 0}, {"threads": 2.5},
               {"threads": True}):
        with pytest.raises(RuntimeLoadError, match="positive integer"):
            runtime.load(folder, **kw)
    bad = tmp_path / "meta"
    shutil.copytree(folder, bad)
    (bad / "edgeprune.json").write_text("[]")
    with pytest.raises(RuntimeLoadError, match="JSON object"):
        runtime.load(bad)
    # hand-edited fields: one clear error at load (they were a ValueError / TypeError /
    # AttributeError at some later call, or max_length 0 silently became 2048)
    good = json.loads((folder / "edgeprune.json").read_text())
    for field, value in (("max_length", "abc"), ("max_length", 0), ("vocab_size", "x"),
                         ("eos_token_id", "2"), ("quantization", [1]),
                         ("quantization", {"accuracy_level": "x"}), ("quantization", {"accuracy_level": 9})):
        (bad / "edgeprune.json").write_text(json.dumps(dict(good, **{field: value})))
        with pytest.raises(RuntimeLoadError, match=field):
            runtime.load(bad)
    # a vocab_size the graph contradicts is refused; without one, the logits' width is
    # used (it used to be the first output's last dim: present.0.key's head_dim)
    (bad / "edgeprune.json").write_text(json.dumps(dict(good, vocab_size=good["vocab_size"] - 1)))
    with pytest.raises(RuntimeLoadError, match="vocab_size=.* logits have"):
        runtime.load(bad)
    (bad / "edgeprune.json").write_text(json.dumps({k: v for k, v in good.items() if k != "vocab_size"}))
    with runtime.load(bad) as s:
        assert s.vocab_size == good["vocab_size"] != s.kv.key_dims[0]
        assert s.generate("ab", max_new_tokens=2).token_ids
    # a max_length beyond the graph's rotary tables is refused at load (it was a raw
    # onnxruntime error about cos_cache / a Gather index once a row passed 600 tokens);
    # without a max_length the graph's own record is the limit (it used to default to 2048)
    (bad / "edgeprune.json").write_text(json.dumps(dict(good, max_length=1024)))
    with pytest.raises(RuntimeLoadError, match=r"max_length=1024 .* rotary tables hold 600 "
                                               r"positions.*restore the folder's edgeprune.json"):
        runtime.load(bad)
    (bad / "edgeprune.json").write_text(json.dumps({k: v for k, v in good.items() if k != "max_length"}))
    with runtime.load(bad) as s:
        assert s.max_length == s.export_max_length == 600


def test_truncated_weight_file_is_named(tmp_path):
    from transformers import LlamaConfig
    from tiny import tiny_model
    folder = tmp_path / "ext"
    exporters.export_onnx(tiny_model(LlamaConfig), byte_tokenizer(), folder, max_length=64,
                          validate=False, external_data=True)
    meta = json.loads((folder / "edgeprune.json").read_text())
    assert meta["data_bytes"] == (folder / "model.onnx.data").stat().st_size
    bad = tmp_path / "trunc"
    shutil.copytree(folder, bad)
    data = (bad / "model.onnx.data").read_bytes()
    (bad / "model.onnx.data").write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeLoadError, match=r"truncated.*\(\d[\d,]* bytes, the export wrote [\d,]+\).*re-run `edgeprune export`"):
        runtime.load(bad)


def test_profile_checks_arguments_before_measuring(folder, monkeypatch, tmp_path):
    import edgeprune_devices.profiler as rp
    import edgeprune_devices.profiler.measure as measure

    def no(*a, **k):
        raise AssertionError("measured before checking the arguments")
    monkeypatch.setattr(measure, "run_worker", no)
    with pytest.raises(DeviceError, match="raspbery-pi-5"):
        rp.profile(folder, "cpu-host", prompt_len=8, gen_len=4, repeat=1, targets=["raspbery-pi-5"])
    with pytest.raises(GenerationError, match="gen_len must be an integer >= 2"):
        rp.profile(folder, "cpu-host", prompt_len=8, gen_len=1, repeat=1)
    with pytest.raises(GenerationError, match="sweep must be"):
        rp.profile(folder, "cpu-host", prompt_len=8, gen_len=4, repeat=1, sweep="abc")
    # the targets are read before measuring: a broken profile file failed only after the
    # whole run (its measurement lost); cpu-host projects only to targets asked for
    import shutil
    import edgeprune_devices as devices
    import edgeprune_devices.catalog  # noqa: F401
    broken = tmp_path / "profiles"
    shutil.copytree(devices.PROFILE_DIR, broken)
    (broken / "raspberry-pi-5.toml").write_text("name = [unclosed")
    monkeypatch.setattr(devices.catalog, "PROFILE_DIR", broken)
    with pytest.raises(DeviceError, match="raspberry-pi-5.toml"):
        rp.profile(folder, "cpu-host", prompt_len=8, gen_len=4, repeat=1, targets=["raspberry-pi-5"])
