"""The two real models of the new families, installed by `make models`: Gemma 3 270M (gemma3)
and Qwen2.5-Coder-0.5B-Instruct (qwen2). Each loads from its split GGUF (assembled,
checked, converted once, then cached), has the published shape, generates sensibly, and
loads again from the cache in seconds. Skipped, saying why, when the wheels are absent."""

from __future__ import annotations

import time

import pytest
import torch

from edgeprune.models import ALIASES, decoder_layers, describe, load_model
from edgeprune.models.cache import entry_for_digest, entry_problem

pytestmark = pytest.mark.integration

#: alias -> (fixture, config facts, prompt, words one of which the 8 greedy tokens hold)
CASES = {
    "gemma3-270m": ("gemma3_270m", dict(
        model_type="gemma3_text", hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, intermediate_size=2048, vocab_size=262_144,
        sliding_window=512, tie_word_embeddings=True),
        "The capital of France is", ("Paris", "France", "capital", "city")),
    "qwen2.5-coder-0.5b": ("qwen25_coder", dict(
        model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, vocab_size=151_936,
        tie_word_embeddings=False),
        "def fibonacci(n):", ("if", "return", "n")),
}


@pytest.mark.parametrize("alias", list(CASES))
def test_loads_with_its_shape_and_generates(alias, request):
    fixture, facts, prompt, words = CASES[alias]
    model, tok = request.getfixturevalue(fixture)
    cfg = model.config
    assert {k: getattr(cfg, k) for k in facts} == facts
    assert model._edgeprune_source["architecture"] == facts["model_type"]
    assert len(decoder_layers(model)) == facts["num_hidden_layers"]
    assert describe(model)["family"] == ("gemma3" if "gemma" in alias else "qwen2")
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    text = tok.decode(new, skip_special_tokens=True)
    assert len(new) == 8 and len(set(new)) >= 4, f"degenerate continuation {text!r} ({new})"
    assert any(w in text for w in words), f"{prompt!r} -> {text!r}"


@pytest.mark.parametrize("alias", list(CASES))
def test_second_load_comes_from_the_cache(alias, request, monkeypatch):
    """After the fixture's load, loading again reads the cache entry (no conversion) in
    under a minute, tokenizer included."""
    import edgeprune.models.convert as convert

    fixture = CASES[alias][0]
    model, tok = request.getfixturevalue(fixture)
    monkeypatch.setattr(convert, "_convert", lambda *a: pytest.fail("converted again"))
    t0 = time.perf_counter()
    again, tok2 = load_model(alias)
    seconds = time.perf_counter() - t0
    assert seconds < 60, f"{alias}: second load took {seconds:.0f} s"
    text = "Hello world, def main():"
    assert tok2(text).input_ids == tok(text).input_ids
    name = next(n for n, _ in model.named_parameters())
    assert torch.equal(dict(again.named_parameters())[name], dict(model.named_parameters())[name])
    entry = entry_for_digest(ALIASES[alias].file_name, ALIASES[alias].sha256)
    assert entry_problem(entry) is None and (entry / "tokenizer.json").is_file()
    del again
