"""Self-calibration seeded with the shipped multilingual prompts (issue 29)."""

from __future__ import annotations

import pytest
import torch

from edgeprune.calibration import (SELF_MIXED, SELF_MULTILINGUAL, build_calibration, mixed_prompts,
                                  seed_prompts, self_generated, self_source_prompts)
from edgeprune.errors import ConfigError
from tiny import byte_tokenizer


def test_seed_prompts_ship_in_the_package_and_mix_the_languages():
    p = seed_prompts()
    assert len(p) >= 20 and all(isinstance(x, str) and len(x) > 40 for x in p)
    first = p[:12]      # the first round: one prompt per language, several scripts
    assert any("Die " in x for x in first) and any("图书馆" in x for x in first)
    assert any("المكتبة" in x for x in first) and any("Библиотека" in x for x in first)


def test_seeded_windows_start_with_their_prompt_and_are_full(tiny_llama):
    tok = byte_tokenizer()
    prompts = ["hello world, this is a seed", "zz"]
    a = self_generated(tiny_llama, tok, nsamples=5, seqlen=48, seed=1, batch_size=4, prompts=prompts)
    b = self_generated(tiny_llama, tok, nsamples=5, seqlen=48, seed=1, batch_size=4, prompts=prompts)
    assert a.input_ids.shape == (5, 48) and torch.equal(a.input_ids, b.input_ids)
    eos = tok.eos_token_id
    for i in range(5):       # BOS (else EOS) + window i's prompt, then sampled tokens, no padding
        seed = ([eos] + tok(prompts[i % 2], add_special_tokens=False)["input_ids"])[:24]   # seqlen // 2
        assert a.input_ids[i, :len(seed)].tolist() == seed
        assert not (a.input_ids[i, len(seed):] == eos).any()
    assert a.info["source"] == "self:T=1,prompts=2"


def test_a_long_prompt_leaves_half_the_window_to_the_model(tiny_llama):
    tok = byte_tokenizer()
    r = self_generated(tiny_llama, tok, nsamples=1, seqlen=16, prompts=["x" * 100])
    assert r.input_ids[0, :8].tolist() == [tok.eos_token_id] + [tok("x")["input_ids"][0]] * 7
    assert r.input_ids.shape == (1, 16)


def test_the_multilingual_source_is_a_calibration_source(tiny_llama):
    tok = byte_tokenizer()
    r = build_calibration(tok, SELF_MULTILINGUAL, nsamples=2, seqlen=300, model=tiny_llama)
    first = tok(seed_prompts()[0], add_special_tokens=False)["input_ids"][:149]   # 1 + 149 = seqlen // 2
    assert r.input_ids[0, 1:150].tolist() == first
    assert r.info["source"].startswith("self:T=1,prompts=")


def test_the_mixed_source_alternates_unseeded_and_seeded_windows(tiny_llama):
    tok = byte_tokenizer()
    assert mixed_prompts()[:4] == ["", seed_prompts()[0], "", seed_prompts()[1]]
    r = build_calibration(tok, SELF_MIXED, nsamples=4, seqlen=300, model=tiny_llama)
    eos = tok.eos_token_id
    for i in (1, 3):         # odd windows: BOS (else EOS) + the next shipped prompt
        seed = tok(seed_prompts()[i // 2], add_special_tokens=False)["input_ids"][:149]
        assert r.input_ids[i, :150].tolist() == [eos] + seed
    for i in (0, 2):         # even windows: BOS alone, then sampled (never the prompt text)
        assert r.input_ids[i, 0].item() == eos
        assert r.input_ids[i, 1:150].tolist() != tok(seed_prompts()[i // 2], add_special_tokens=False)["input_ids"][:149]
        assert not (r.input_ids[i, 1:] == eos).any()
    n = len(seed_prompts())
    assert r.info["source"] == f"self:T=1,prompts={n},unseeded={n}"


def test_mixed_share_spreads_the_unseeded_windows_and_uses_each_prompt_once():
    p = seed_prompts()
    q = mixed_prompts(75)
    assert q[:8] == ["", p[0], p[1], p[2], "", p[3], p[4], p[5]]
    assert [x for x in q if x] == p and q[-1] == p[-1]
    assert len(q) == len(p) * 4 // 3 and q.count("") == len(p) // 3
    assert mixed_prompts(50) == [x for s in p for x in ("", s)]
    r = mixed_prompts(10)                  # 90 % unseeded: nine BOS-only windows per prompt
    assert r[:10] == [""] * 9 + [p[0]] and [x for x in r if x] == p


@pytest.mark.parametrize("name", ["self-mixed-0", "self-mixed-100", "self-mixed-x", "self-mixed-"])
def test_mixed_share_out_of_range_is_one_clear_error(name):
    with pytest.raises(ConfigError, match="self-mixed-<pct>"):
        self_source_prompts(name)


def test_self_source_names():
    assert self_source_prompts("self") == (True, None)
    assert self_source_prompts(SELF_MULTILINGUAL) == (True, seed_prompts())
    assert self_source_prompts(SELF_MIXED) == (True, mixed_prompts())
    assert self_source_prompts("self-mixed-75") == (True, mixed_prompts(75))
    assert self_source_prompts("notes.txt") == (False, None)
    assert self_source_prompts(None) == (False, None)


def test_the_mixed_share_source_seeds_three_windows_in_four(tiny_llama):
    tok = byte_tokenizer()
    r = build_calibration(tok, "self-mixed-75", nsamples=4, seqlen=300, model=tiny_llama)
    eos = tok.eos_token_id
    assert r.input_ids[0, 0].item() == eos
    assert r.input_ids[0, 1:150].tolist() != tok(seed_prompts()[0], add_special_tokens=False)["input_ids"][:149]
    for i in (1, 2, 3):
        seed = tok(seed_prompts()[i - 1], add_special_tokens=False)["input_ids"][:149]
        assert r.input_ids[i, :150].tolist() == [eos] + seed


def test_with_forward_dtype_records_only_a_non_float32_forward_and_copies():
    from edgeprune.calibration import with_forward_dtype

    info = {"source": "c4", "nsamples": 8}
    assert with_forward_dtype(info) == info and with_forward_dtype(info) is not info
    b16 = with_forward_dtype(info, "bfloat16")
    assert b16 == {"source": "c4", "nsamples": 8, "forward_dtype": "bfloat16"}
    assert "forward_dtype" not in info          # the caller's dict is left as it was
