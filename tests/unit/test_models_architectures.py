"""The supported families (llama, qwen2, gemma3 text-only): which configs load, which are
refused and how, and the family-dependent views (describe, decoder_layers)."""

from __future__ import annotations

import json

import pytest
import torch

from edgeprune.errors import UnsupportedArchitectureError
from edgeprune.models import (ALIASES, FAMILIES, SUPPORTED_ARCHITECTURES, check_architecture,
                              check_gguf_architecture, decoder_layers, describe, load_model)
from tiny import byte_tokenizer
from tiny import tiny_gemma3 as tiny_gemma3_model


@pytest.fixture
def tiny_gemma3():
    """A 2-layer gemma3_text (head_dim 16 != hidden / heads, a sliding layer then a full one)."""
    return tiny_gemma3_model(num_hidden_layers=2, num_key_value_heads=2, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention"])


def test_the_three_families():
    assert SUPPORTED_ARCHITECTURES == ("llama", "qwen2", "gemma3_text")
    assert check_architecture("gemma3_text", "x").name == "gemma3"
    assert check_gguf_architecture("gemma3", "x").model_type == "gemma3_text"
    assert [f.name for f in FAMILIES.values() if not f.exportable] == []
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"} <= set(ALIASES)
    assert all(a.description for a in ALIASES.values())
    for alias in (ALIASES["qwen2.5-coder-0.5b"], ALIASES["gemma3-270m"]):   # pinned facts agree
        assert sum(p.size for p in alias.parts) == alias.size
        assert all(len(h) == 64 for h in [alias.sha256, *(p.sha256 for p in alias.parts)])
    assert (ALIASES["qwen2.5-coder-0.5b"].size, ALIASES["gemma3-270m"].size) == (491_400_064,
                                                                                  253_113_024)


@pytest.mark.parametrize("model_type, needle", [
    ("gpt2", "'gpt2' model, which edgeprune does not support"),
    ("gemma3", "multimodal Gemma 3"),
])
def test_other_configs_are_refused_from_config_json(tmp_path, model_type, needle):
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(folder)
    assert needle in str(err.value)
    assert "gemma3_text" in str(err.value)     # the fix names the text-only family


def test_gguf_architecture_names_the_families():
    with pytest.raises(UnsupportedArchitectureError, match="llama, qwen2, gemma3"):
        check_gguf_architecture("gpt2", "some.gguf")


def test_gemma3_text_folder_loads(tmp_path, tiny_gemma3):
    tiny_gemma3.save_pretrained(tmp_path / "g")
    byte_tokenizer().save_pretrained(tmp_path / "g")
    model, tok, src = load_model(tmp_path / "g", return_source=True)
    assert src.architecture == "gemma3_text"
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])   # past the sliding window
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, tiny_gemma3(ids).logits, atol=1e-5)


def test_describe_and_decoder_layers(tiny_llama, tiny_qwen2, tiny_gemma3):
    d = describe(tiny_gemma3)
    assert d["family"] == "gemma3" and d["architecture"] == "gemma3_text"
    assert (d["num_heads"], d["num_kv_heads"], d["head_dim"]) == (4, 2, 16)
    assert d["sliding_window"] == 8 and d["tie_word_embeddings"] is True
    assert d["parameters"] == sum(p.numel() for p in tiny_gemma3.parameters())
    assert describe(tiny_qwen2)["sliding_window"] is None    # qwen2's window is off by default
    assert describe(tiny_llama)["head_dim"] == 16 and describe(tiny_llama)["family"] == "llama"
    for m in (tiny_llama, tiny_qwen2, tiny_gemma3):
        assert decoder_layers(m) is m.model.layers and len(decoder_layers(m)) == 2
        json.dumps(describe(m))
    with pytest.raises(UnsupportedArchitectureError, match="no model.layers"):
        decoder_layers(torch.nn.Linear(2, 2))
