"""Prompt-lookup speculative decoding: drafts, exactness against plain decoding, limits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime
from edgeprune_runtime.errors import GenerationError
from edgeprune_runtime.lookup import DraftController, adapt_draft_len, check_lookup_args, find_draft

from tiny import rand_ids, byte_tokenizer


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


def test_draft_length_schedule():
    assert adapt_draft_len(4, 8, drafted=4, accepted=4) == 6          # all confirmed: +2
    assert adapt_draft_len(7, 8, drafted=7, accepted=7) == 8          # capped
    assert adapt_draft_len(6, 8, drafted=3, accepted=3) == 8          # a short match, all kept
    assert adapt_draft_len(6, 8, drafted=6, accepted=2) == 5          # a rejection: -1
    assert adapt_draft_len(1, 8, drafted=1, accepted=0) == 1          # never below 1


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
    from tiny import tiny_model
    model = tiny_model(LlamaConfig)
    base = tmp_path_factory.mktemp("lookup")
    out = {}
    for graph in ("fused", "plain"):
        exporters.export_onnx(model, byte_tokenizer(), base / graph, graph=graph, max_length=160,
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


@pytest.fixture
def no_gate(monkeypatch):
    """Draft whenever the schedule allows: the cost gate (whose figures on a tiny model are
    all Python overhead) would keep most drafts off, and the output must not depend on
    which steps draft, so these tests exercise as many passes as they can."""
    monkeypatch.setattr(DraftController, "next_len", lambda self: self.scheduled)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_lookup_equals_plain_and_torch(folders, k, no_gate):
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


def test_sampling_with_lookup_draws_what_plain_decoding_draws(folders, no_gate):
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


def test_lookup_respects_context_stop_and_eos(folders, no_gate):
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


def test_close_mid_generation_stops_confirmed_drafts_too(folders, no_gate):
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


def test_draft_length_adapts_pass_by_pass(folders, monkeypatch, no_gate):
    """Each pass drafts at most what the schedule allows after the previous pass: the
    full prompt_lookup_num_tokens after confirmed drafts, fewer after rejections."""
    import edgeprune_runtime.generation as rg
    import edgeprune_runtime.session as rs
    _, f = folders
    ids = _repetitive()
    asked, passes = [], []
    real_find, real_verify = rg.find_draft, rs.Session._verify

    def find(tokens, n, num):
        asked.append(num)
        return real_find(tokens, n, num)

    def verify(self, st, fed, draft, sampler, seen):
        out = real_verify(self, st, fed, draft, sampler, seen)
        passes.append((len(asked) - 1, len(draft), len(out) - 1))
        return out

    monkeypatch.setattr(rg, "find_draft", find)
    monkeypatch.setattr(rs.Session, "_verify", verify)
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        r = s.generate(ids, max_new_tokens=80, prompt_lookup_num_tokens=6)
    assert asked[0] == 6 and r.draft_tokens == sum(p[1] for p in passes)
    rejected = [p for p in passes if p[2] < p[1]]
    assert rejected and any(p[2] == p[1] for p in passes)     # both kinds of pass happened
    allowed = 6
    for i, n in enumerate(asked):
        assert n <= allowed                      # (less near the end: room left)
        done = [p for p in passes if p[0] == i]
        if done:
            allowed = adapt_draft_len(allowed, 6, done[0][1], done[0][2])
    assert min(asked[1:]) < 6


def test_cost_gate_turns_drafting_off_and_back_on():
    c = DraftController(8)
    assert c.next_len() == 0                       # no one-token step timed yet: probe one
    c.observe_step(0.010)                          # a one-token step: 10 ms
    # q = 1/2, prior c/t1 = 0.3: one draft token is worth it (0.5 > 0.3), two not (0.25)
    assert c.next_len() == 1
    c.observe_pass(8, 8, 0.010 + 8 * 0.001)        # all confirmed, 1 ms per draft token
    assert abs(c.cost_ratio - 0.1) < 1e-9 and c.next_len() == 8
    lens = []
    for _ in range(60):                            # the text stops repeating
        lens.append(c.next_len())
        c.observe_pass(1, 0, 0.011)
    # one fewer after each rejection, down to 1, then none once q < c / t1
    assert lens[:4] == [8, 7, 6, 5] and 1 in lens and lens[-1] == 0
    assert all(a >= b for a, b in zip(lens, lens[1:]))
    assert c.confirm_rate < c.cost_ratio and c.next_len() == 0
    for _ in range(40):                            # the gated-off guesses start coming true
        c.observe_step(0.010)                      # (gated off: plain steps)
        c.observe_guess(True)
    assert c.confirm_rate > 0.8 and c.next_len() >= 1
    # expensive draft tokens (a pass of 1 costs 1.5 steps): only a sure draft is worth it
    d = DraftController(4)
    d.observe_step(0.010)
    d.observe_pass(2, 1, 0.020)                    # 5 ms per draft token
    assert d.cost_ratio == pytest.approx(0.5) and d.next_len() == 0      # q ~ 0.5
    for _ in range(20):
        d.observe_step(0.010)
        d.observe_guess(True)
    assert d.next_len() >= 1
    # a re-prefill inside a "step" (sliding window) is not a step time
    d.observe_step(1.0)
    assert d.t_step == pytest.approx(0.010)
    # a plain step is probed every PROBE_EVERY tokens, however well drafts do
    e = DraftController(4)
    e.observe_step(0.010)
    ks = []
    for _ in range(40):
        ks.append(e.next_len())
        if ks[-1]:
            e.observe_pass(ks[-1], ks[-1], 0.012)
        else:
            e.observe_step(0.010)
    assert 0 in ks[1:] and ks.count(0) <= 40 * 5 // DraftController.PROBE_EVERY + 1 and max(ks) == 4


def test_cost_gate_keeps_the_output(folders):
    """With the gate on (the default) drafts are fewer, the tokens the same."""
    _, f = folders
    ids = _repetitive()
    with runtime.load(f["fused"]) as s:
        s.eos_token_ids = []
        loop = ids + s.generate(ids, max_new_tokens=44).token_ids[0]
        plain = s.generate(loop, max_new_tokens=60, temperature=0.6, seed=4)
        got = s.generate(loop, max_new_tokens=60, temperature=0.6, seed=4, prompt_lookup_num_tokens=6)
    assert got.token_ids == plain.token_ids and got.draft_tokens > 0


def test_cost_gate_recovers_from_one_slow_pass():
    """A pass slowed by a pause of the machine must not keep drafting off for good: the
    per-token cost is bounded by a step, and while gated off a 1-token pass every
    PROBE_EVERY steps re-measures it (it stayed off for 5,000 perfect guesses)."""
    c = DraftController(10)
    c.observe_step(0.016)
    c.observe_pass(1, 1, 0.016 + 0.060)             # 60 ms late: not a cost
    assert c.cost_ratio == DraftController.PRIOR_COST_RATIO
    c.observe_pass(1, 1, 0.016 + 0.012)             # a slow, plausible one: it counts
    assert c.cost_ratio == pytest.approx(0.75)
    ks = []
    for _ in range(300):
        k = c.next_len()
        ks.append(k)
        if k:
            c.observe_pass(k, k, 0.016 + 0.002 * k)  # the machine is quiet again
        else:
            c.observe_step(0.016)
            c.observe_guess(True)
    assert sum(ks) > 100 and max(ks) == 10 and c.cost_ratio < 0.3
