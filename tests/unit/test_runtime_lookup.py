"""Prompt-lookup speculative decoding: drafts, exactness against plain decoding, limits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import exporters
import runtime
from runtime.errors import GenerationError
from runtime.lookup import check_lookup_args, find_draft

from _h3_tiny import rand_ids, tiny_tokenizer


# ----------------------------------------------------------------------------- find_draft
def test_find_draft_takes_the_most_recent_longest_match():
    t = np.array([1, 2, 3, 9, 9, 1, 2, 4, 5, 7, 2])
    # suffix 2-gram [7, 2] never occurred before; 1-gram [2]: last earlier 2 is at 6 -> 4, 5
    assert find_draft(t, 2, 2).tolist() == [4, 5]
    # a 2-gram match wins over a more recent 1-gram match
    t = np.array([8, 1, 2, 6, 6, 2, 3, 1, 2])
    assert find_draft(t, 2, 3).tolist() == [6, 6, 2]           # [1, 2] at 1 -> 6, 6, 2
    assert find_draft(t, 1, 3).tolist() == [3, 1, 2]           # [2] at 5 -> 3, 1, 2
    # the draft stops at the end of the sequence, and at num_tokens
    assert find_draft(np.array([5, 6, 7, 5]), 2, 10).tolist() == [6, 7, 5]
    assert find_draft(np.array([5, 6, 7, 5]), 2, 1).tolist() == [6]
    # the suffix itself is no match; nothing repeats -> empty
    assert find_draft(np.array([1, 2, 3, 4]), 3, 4).tolist() == []
    assert find_draft(np.array([4]), 2, 4).tolist() == []
    assert find_draft(np.array([4, 4]), 2, 0).tolist() == []
    assert find_draft(np.array([4, 4]), 2, 3).tolist() == [4]


def test_lookup_arguments_are_checked():
    assert check_lookup_args(0, 1) == (0, 1)
    for bad in ((-1, 2), (True, 2), (2.0, 2), (3, 0), (3, None)):
        with pytest.raises(GenerationError, match="prompt_lookup_num_tokens|max_matching_ngram_size"):
            check_lookup_args(*bad)


# ----------------------------------------------------------------------- on tiny exports
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny llama exported fused and plain (fp32: one- and multi-token passes agree to
    ~1e-6, so lookup must reproduce plain decoding token for token)."""
    from transformers import LlamaConfig
    from conftest import _tiny
    model = _tiny(LlamaConfig)
    base = tmp_path_factory.mktemp("lookup")
    out = {}
    for graph in ("fused", "plain"):
        exporters.export_onnx(model, tiny_tokenizer(), base / graph, graph=graph, max_length=160,
                              validate=False)
        out[graph] = base / graph
    return model, out


def _repetitive(n=24, seed=0):
    """A prompt that repeats a 6-token phrase: drafts from the first pass on."""
    phrase = rand_ids(6, seed=seed)[0].tolist()
    return (phrase * 10)[:n]


def _torch_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_lookup_equals_plain_and_torch(folders, k):
    model, f = folders
    ids = _repetitive()
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        plain = s.generate(ids, max_new_tokens=48)
        got = s.generate(ids, max_new_tokens=48, prompt_lookup_num_tokens=k)
    assert got.token_ids == plain.token_ids == [_torch_greedy(model, ids, 48)]
    assert plain.draft_tokens == 0 and plain.accepted_draft_tokens == 0
    # drafts were scored, some confirmed, never more than asked for per pass
    assert got.draft_tokens > 0 and 0 < got.accepted_draft_tokens <= got.draft_tokens
    assert len(got.step_ms) == 47 and got.finish_reasons == ["length"]
    # no draft past the tokens still wanted: 2 new tokens = 1 fed, nothing to draft for
    # (the prompt ends inside the loop the model fell into: every step finds a match)
    loop = ids + plain.token_ids[0][:44]
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        ref = s.generate(loop, max_new_tokens=8).token_ids
        assert s.generate(loop, max_new_tokens=2, prompt_lookup_num_tokens=k).draft_tokens == 0
        three = s.generate(loop, max_new_tokens=3, prompt_lookup_num_tokens=k)
        assert three.draft_tokens == 1 and three.token_ids == [ref[0][:3]]
        eight = s.generate(loop, max_new_tokens=8, prompt_lookup_num_tokens=k)
        assert eight.draft_tokens > 0 and eight.token_ids == ref


def test_sampling_with_lookup_draws_what_plain_decoding_draws(folders):
    """Same seed, same sampler: every position's draw comes from the same distribution
    with the same uniform, so the tokens are the plain run's (fp32 graph)."""
    _, f = folders
    ids = _repetitive(30, seed=3)
    kw = dict(max_new_tokens=60, temperature=0.7, top_k=20, top_p=0.9,
              repetition_penalty=1.15, seed=11)
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        plain = s.generate(ids, **kw)
        got = s.generate(ids, **kw, prompt_lookup_num_tokens=4, max_matching_ngram_size=3)
        assert got.token_ids == plain.token_ids and got.draft_tokens > 0
        other = s.generate(ids, **{**kw, "seed": 12}, prompt_lookup_num_tokens=4)
        assert other.token_ids != plain.token_ids
        # streaming with lookup gives the same text
        text = "".join(s.stream(ids, **kw, prompt_lookup_num_tokens=4, max_matching_ngram_size=3))
        assert text == got.text


def test_lookup_respects_context_stop_and_eos(folders):
    model, f = folders
    ids = _repetitive(20, seed=5)
    # the cache exactly full at the end: drafts are cut to what it holds
    with runtime.load(f["fused"], max_length=32) as s:
        s.eos_token_ids = []
        full = s.generate(ids, max_new_tokens=13, prompt_lookup_num_tokens=8)
        assert full.token_ids == [_torch_greedy(model, ids, 13)]
    # sliding window: the re-prefill after a full cache happens as without lookup
    with runtime.load(f["fused"], max_length=32, context_policy="sliding_window") as s:
        s.eos_token_ids = []
        plain = s.generate(ids, max_new_tokens=50)
        got = s.generate(ids, max_new_tokens=50, prompt_lookup_num_tokens=5)
        assert got.token_ids == plain.token_ids and len(got.token_ids[0]) == 50
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        plain = s.generate(ids, max_new_tokens=40)
        assert plain.token_ids[0] == _torch_greedy(model, ids, 40)
        # a stop string inside a confirmed draft ends the text there
        stop = plain.text[9:11]
        cut = s.generate(ids, max_new_tokens=40, stop=[stop])
        got = s.generate(ids, max_new_tokens=40, stop=[stop], prompt_lookup_num_tokens=6)
        assert got.text == cut.text and got.finish_reasons == ["stop"]
        # an eos token in the middle of a confirmed draft ends the row before it
        eos = plain.token_ids[0][10]
        first = plain.token_ids[0].index(eos)
        s.eos_token_ids = [eos]
        got = s.generate(ids, max_new_tokens=40, prompt_lookup_num_tokens=6)
        assert got.token_ids == [plain.token_ids[0][:first]] and got.finish_reasons == ["eos"]


def test_lookup_refuses_what_it_cannot_serve(folders):
    _, f = folders
    ids = _repetitive()
    with runtime.load(f["fused"]) as s:
        with pytest.raises(GenerationError, match="one row at a time"):
            s.generate([ids, ids[:10]], max_new_tokens=4, prompt_lookup_num_tokens=2)
        with pytest.raises(GenerationError, match="prompt_lookup_num_tokens must be"):
            s.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=-1)
        with pytest.raises(GenerationError, match="max_matching_ngram_size must be"):
            s.stream(ids, max_new_tokens=4, prompt_lookup_num_tokens=2, max_matching_ngram_size=0)
        # a batch without lookup still works
        assert len(s.generate([ids, ids[:10]], max_new_tokens=4).token_ids) == 2
    with runtime.load(f["plain"]) as s:
        with pytest.raises(GenerationError, match="fused GroupQueryAttention export"):
            s.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=2)


def test_close_mid_generation_stops_confirmed_drafts_too(folders):
    """close() during a generation stops it at the next token, also when the tokens left
    were already confirmed by a verification pass (no forward pass needed for them): they
    used to be emitted from a closed session, and a generation they completed ended
    normally."""
    _, f = folders
    ids = _repetitive()
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        loop = ids + s.generate(ids, max_new_tokens=44).token_ids[0]     # the model's loop
    for k in (0, 8):
        s = runtime.load(f["fused"])
        s.eos_token_ids = []
        it = s.stream(loop, max_new_tokens=6, prompt_lookup_num_tokens=k)
        next(it), next(it)
        s.close()
        with pytest.raises(GenerationError, match="closed during generation"):
            list(it)
