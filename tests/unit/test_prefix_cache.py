"""Prefix reuse between generations (``session.reuse_prefix``): the KV rows of the common
prefix are kept, only the new tokens are prefilled, and the tokens are those of a full
recomputation (greedy and seeded sampling, fp32 tiny exports). Also: the KV buffers of an
unfinished generation are freed, forks generate concurrently, variants recompute."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime
from edgeprune_runtime.countdown import CountdownSession
from edgeprune_runtime.kv_reuse import common_prefix_length
from edgeprune_runtime.leank import LeanKSession

from tiny import byte_tokenizer, export_tiny_llama, rand_ids, tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny llama export (BPE tokenizer with a chat template), fused graph, fp32."""
    folder, _, _ = export_tiny_llama(tmp_path_factory.mktemp("prefix") / "llama", max_length=512)
    return folder


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    from transformers import Qwen2Config

    out = tmp_path_factory.mktemp("prefix") / "plain"
    exporters.export_onnx(tiny_model(Qwen2Config), byte_tokenizer(), out, graph="plain",
                          max_length=160, validate=False)
    return out


def _pair(folder):
    on, off = runtime.load(folder, threads=1), runtime.load(folder, threads=1)
    on.reuse_prefix = True
    on.eos_token_ids = off.eos_token_ids = []     # random model: never stop early
    return on, off


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length([1, 2, 3], [1, 2, 3], limit=2) == 2
    assert common_prefix_length([], [1]) == 0 == common_prefix_length([5], [1])


def test_turns_reuse_the_prefix_and_give_the_recomputed_tokens(tiny):
    on, off = _pair(tiny)
    with on, off:
        ids = rand_ids(40, vocab=300, seed=3)[0].tolist()
        a, b = on.generate(ids, max_new_tokens=24), off.generate(ids, max_new_tokens=24)
        assert a.token_ids == b.token_ids and a.cached_tokens == 0
        # fed to the cache: the prompt and every generated token but the last (sampled only)
        assert on.kv_cache_state()["cached_tokens"] == 40 + 23
        assert off.kv_cache_state()["cached_tokens"] == 0
        prompt = ids
        for turn in range(4):
            prompt = prompt + a.token_ids[0] + rand_ids(7 + turn, vocab=300, seed=turn)[0].tolist()
            a, b = on.generate(prompt, max_new_tokens=24), off.generate(prompt, max_new_tokens=24)
            assert a.token_ids == b.token_ids, turn
            assert a.cached_tokens == len(prompt) - 7 - turn - 1 and b.cached_tokens == 0
        # the same prompt again: all but its last token kept
        again = on.generate(prompt, max_new_tokens=24)
        assert again.cached_tokens == len(prompt) - 1 and again.token_ids == b.token_ids
        # a prompt that diverges early keeps only the common part
        fork = prompt[:10] + [7, 8, 9]
        c, d = on.generate(fork, max_new_tokens=16), off.generate(fork, max_new_tokens=16)
        assert c.cached_tokens == 10 and c.token_ids == d.token_ids
        # seeded sampling draws the same tokens too
        kw = dict(max_new_tokens=20, temperature=0.9, top_k=40, seed=5)
        on.generate(prompt, max_new_tokens=4)
        s1, s2 = on.generate(prompt + [11, 12], **kw), off.generate(prompt + [11, 12], **kw)
        assert s1.cached_tokens > 0 and s1.token_ids == s2.token_ids


def test_chat_turns_and_stream(tiny):
    on, off = _pair(tiny)
    with on, off:
        msgs = [{"role": "system", "content": "Be brief."}]
        for turn in range(3):
            msgs.append({"role": "user", "content": f"Question {turn}: how are you?"})
            st = on.stream(msgs, max_new_tokens=16)
            text = "".join(st)
            ref = off.generate(msgs, max_new_tokens=16)
            assert st.result.token_ids == ref.token_ids and text == ref.text
            assert (st.result.cached_tokens > 0) == (turn > 0)
            assert st.finish_reason == "length"
            msgs.append({"role": "assistant", "content": text})


def test_batches_and_reallocation_recompute(tiny):
    on, _ = _pair(tiny)
    with on:
        ids = rand_ids(20, vocab=300, seed=1)[0].tolist()
        on.generate(ids, max_new_tokens=4)
        on.generate([ids, ids[:15]], max_new_tokens=4)         # a batch: other buffers
        assert on.kv_cache_state()["cached_tokens"] == 0
        assert on.generate(ids, max_new_tokens=4).cached_tokens == 0
        on.reuse_prefix = False                                # off: nothing recorded
        on.generate(ids, max_new_tokens=4)
        on.reuse_prefix = True
        assert on.generate(ids, max_new_tokens=4).cached_tokens == 0


def test_growing_buffers_keep_the_prefix(tiny, monkeypatch):
    """Buffers sized per call (long contexts) grow with the conversation: the cached rows
    are copied into the larger ones, and the tokens stay those of a recomputation."""
    import edgeprune_runtime.generation as rg

    monkeypatch.setattr(rg, "FULL_KV_BYTES", 0)
    monkeypatch.setattr(rg, "KV_CHUNK", 16)
    on, off = _pair(tiny)
    with on, off:
        prompt = rand_ids(20, vocab=300, seed=8)[0].tolist()
        sizes = []
        for turn in range(4):
            a, b = on.generate(prompt, max_new_tokens=12), off.generate(prompt, max_new_tokens=12)
            assert a.token_ids == b.token_ids and (a.cached_tokens > 0) == (turn > 0)
            sizes.append(on._caches[1].max_length)
            prompt = prompt + a.token_ids[0] + rand_ids(9, vocab=300, seed=turn)[0].tolist()
        assert sizes == sorted(sizes) and len(set(sizes)) == 4       # grew every turn


def test_unfinished_generations_free_the_kv(tiny):
    on, _ = _pair(tiny)
    with on:
        ids = rand_ids(30, vocab=300, seed=2)[0].tolist()
        on.generate(ids, max_new_tokens=8)
        assert on.kv_cache_state()["allocated_bytes"] > 0
        it = on.stream(ids + [5], max_new_tokens=50)
        next(it)
        it.close()
        assert it.finish_reason == "cancelled"
        assert on.kv_cache_state() == {"allocated_bytes": 0, "cached_tokens": 0}
        # cancel() from another thread stops the iterating one before its next token
        it = on.stream(ids, max_new_tokens=200)
        got = [next(it)]
        t = threading.Thread(target=it.cancel)
        t.start()
        t.join()
        got += list(it)
        assert it.finish_reason == "cancelled" and len(it.result.token_ids[0]) < 200
        assert on.kv_cache_state() == {"allocated_bytes": 0, "cached_tokens": 0}
        # the session serves on, and recomputes
        assert on.generate(ids, max_new_tokens=4).cached_tokens == 0


def test_forks_generate_concurrently(tiny):
    base = runtime.load(tiny, threads=1)
    base.eos_token_ids = []
    prompts = [rand_ids(25, vocab=300, seed=s)[0].tolist() for s in (4, 5)]
    alone = [base.generate(p, max_new_tokens=30).token_ids for p in prompts]
    forks = [base.fork(), base.fork()]
    assert forks[0].sess is base.sess and forks[0]._lock is not base._lock
    got = [None, None]

    def work(i):
        got[i] = forks[i].generate(prompts[i], max_new_tokens=30).token_ids

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert got == alone
    forks[0].close()
    assert base.generate(prompts[0], max_new_tokens=30).token_ids == alone[0]
    base.close()
    assert forks[1].generate(prompts[1], max_new_tokens=30).token_ids == alone[1]
    forks[1].close()


def test_plain_graphs_and_variant_sessions_recompute(plain):
    on, off = _pair(plain)
    with on, off:
        ids = rand_ids(20, seed=6)[0].tolist()
        first = on.generate(ids, max_new_tokens=8)
        nxt = ids + first.token_ids[0] + [1, 2]
        a, b = on.generate(nxt, max_new_tokens=8), off.generate(nxt, max_new_tokens=8)
        assert a.cached_tokens == 0 and a.token_ids == b.token_ids
    for cls in (LeanKSession, CountdownSession):
        s = object.__new__(cls)
        s.fused, s.reuse_prefix = True, True
        assert not s._prefix_reuse_on()
    s = object.__new__(runtime.Session)
    s.fused, s.reuse_prefix = True, True
    assert s._prefix_reuse_on()
    s.fused = False
    assert not s._prefix_reuse_on()
