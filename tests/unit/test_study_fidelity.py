"""Fidelity's additions for the study: per-layer activation SNR and greedy-continuation change."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from edgeprune.evaluate import continuation_prompts, fidelity, snr_db
from tiny import byte_tokenizer

TEXT = "abcdefgh ijklmnop qrstuvwxyz " * 60


def test_snr_of_a_model_to_itself_is_infinite_and_nothing_changes(tiny_llama):
    r = fidelity(tiny_llama, tiny_llama, byte_tokenizer(), TEXT, seqlen=32, nwindows=2, progress=False,
                 continuations=3, prompt_len=8, new_tokens=6)
    assert r.snr_db == math.inf and r.snr_db_layers == [math.inf, math.inf]
    assert r.continuation_change == 0.0 and 0 < r.continuation_agree_tokens <= 6   # <: end-of-sequence
    assert r.continuation_prompts == 3 and r.continuation_tokens == 6
    d = r.to_dict()
    assert d["snr_db"] == math.inf and d["protocol"]["seqlen"] == 32


def test_snr_follows_the_definition(tiny_llama):
    """Noise on the last layer's output only: SNR_l = 10 log10(sum h^2 / sum (h - h~)^2)."""
    other = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(1.3)
    tok = byte_tokenizer()
    r = fidelity(tiny_llama, other, tok, TEXT, seqlen=32, nwindows=2, progress=False)
    assert r.snr_db_layers[0] == math.inf and math.isfinite(r.snr_db_layers[1])
    assert r.snr_db == pytest.approx(r.snr_db_layers[1])
    assert snr_db(1.0, 0.0) == math.inf and snr_db(0.0, 1.0) == -math.inf and snr_db(100.0, 1.0) == 20.0


def test_continuation_change_detects_a_changed_model(tiny_llama):
    other = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        other.lm_head.weight.add_(torch.randn_like(other.lm_head.weight))
    r = fidelity(tiny_llama, other, byte_tokenizer(), TEXT, seqlen=32, nwindows=2, progress=False,
                 continuations=4, prompt_len=8, new_tokens=8)
    assert r.continuation_change > 0 and r.continuation_agree_tokens < 8
    # a logits callable (no torch module) is scored by the plain greedy loop, SNR left out
    r2 = fidelity(tiny_llama, lambda ids: other(ids).logits, byte_tokenizer(), TEXT, seqlen=32, nwindows=2,
                  progress=False, continuations=4, prompt_len=8, new_tokens=8)
    assert r2.snr_db is None and r2.continuation_change > 0


def test_prompts_need_enough_tokens():
    from edgeprune.errors import ConfigError

    w = torch.arange(64).view(2, 32)
    assert continuation_prompts(w, 4, 16).tolist()[1] == list(range(16, 32))
    with pytest.raises(ConfigError, match="need 80 tokens"):
        continuation_prompts(w, 5, 16)


def test_batched_greedy_equals_one_prompt_at_a_time(tiny_llama):
    """``greedy_many`` (one batch for prompts of one length) gives each prompt's own greedy
    tokens, ends a row at end-of-sequence as ``greedy`` does, and falls back to one prompt
    at a time for prompts of different lengths."""
    from edgeprune.evaluation.backends import TorchBackend

    b = TorchBackend(tiny_llama)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 250, (6, 8), generator=g).tolist()
    one = [b.greedy(p, 12) for p in prompts]
    assert b.greedy_many(prompts, 12) == one
    # an end-of-sequence token chosen early by some rows: their lists stop there
    first = [t[0] for t in one]
    b.eos_token_ids = {first[0], first[3]}
    ends = [b.greedy(p, 12) for p in prompts]
    assert ends[0] == [] and b.greedy_many(prompts, 12) == ends
    assert b.greedy_many([prompts[0], prompts[1][:5]], 4) == [b.greedy(prompts[0], 4), b.greedy(prompts[1][:5], 4)]
