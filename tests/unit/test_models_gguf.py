"""GGUF files: the header reader, refusal of unsupported architectures before any work, and
the float cache (model and tokenizer) with its keying and damage handling."""

from __future__ import annotations

import os

import pytest
import torch

import edgeprune.models.convert as convert
from edgeprune.errors import ModelLoadError, UnsupportedArchitectureError
from edgeprune.models import load_model
from edgeprune.models.cache import entry_for_file, entry_problem
from edgeprune.models.gguf_header import GGUFHeaderError, read_gguf_metadata, read_gguf_parameter_count


def _no_conversion(monkeypatch):
    monkeypatch.setattr(convert, "_convert", lambda *a: pytest.fail("converted"))


def test_header_reader_walks_past_arrays(tiny_gguf):
    path = tiny_gguf()
    meta = read_gguf_metadata(path, ["general.architecture", "llama.block_count",
                                     "tokenizer.ggml.tokens", "tokenizer.ggml.eos_token_id",
                                     "no.such.key"])
    # the vocabulary (an array) is skipped, the id written after it is read
    assert meta == {"general.architecture": "llama", "llama.block_count": 1,
                    "tokenizer.ggml.eos_token_id": 1}


def test_parameter_count_walks_every_tensor_info(tiny_gguf):
    """Embedding and head 257 x 32 each, 2 norms of 32 per layer and one final norm, and per
    layer q/o 32 x 32, k/v 16 x 32 (2 KV heads of 8), gate/up/down 64 x 32."""
    per_layer = 2 * 32 * 32 + 2 * 16 * 32 + 3 * 64 * 32 + 2 * 32
    assert read_gguf_parameter_count(tiny_gguf()) == 2 * 257 * 32 + 32 + per_layer
    assert read_gguf_parameter_count(tiny_gguf("three.gguf", layers=3)) == 2 * 257 * 32 + 32 + 3 * per_layer


@pytest.mark.parametrize("cut", [3, 30, 200])
def test_header_reader_refuses_a_cut_file(tiny_gguf, cut):
    path = tiny_gguf()
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(GGUFHeaderError):
        read_gguf_metadata(path, ["general.architecture", "tokenizer.ggml.eos_token_id"])
    with pytest.raises(GGUFHeaderError):
        read_gguf_parameter_count(path)


def test_unsupported_gguf_refused_before_any_work(tiny_gguf, edgeprune_cache, monkeypatch):
    """A gpt2 GGUF is refused from its header, naming the supported families; nothing is
    converted or written."""
    path = tiny_gguf("gpt2.gguf", arch="gpt2")
    _no_conversion(monkeypatch)
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(path)
    msg = str(err.value)
    assert "'gpt2'" in msg and str(path) in msg
    assert "llama, qwen2, gemma3" in msg
    assert not edgeprune_cache.exists()


def test_gguf_converted_once_then_read_from_the_cache(tiny_gguf, edgeprune_cache, monkeypatch):
    path = tiny_gguf()
    model, tok, src = load_model(path, return_source=True)
    assert (src.kind, src.architecture) == ("gguf", "llama")
    entry = entry_for_file(path)
    assert entry.parent == edgeprune_cache / "models" and entry_problem(entry) is None
    assert (entry / "tokenizer.json").is_file()
    ids = torch.tensor([tok("tiny test").input_ids])
    with torch.no_grad():
        ref = model(ids).logits

    _no_conversion(monkeypatch)
    model2, tok2 = load_model(path, dtype=torch.bfloat16)
    assert model2.dtype == torch.bfloat16 and tok2("tiny test").input_ids == ids[0].tolist()
    with torch.no_grad():
        assert torch.allclose(model2.float()(ids).logits, ref, atol=0.05)
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no temp folders


def test_a_changed_file_is_converted_again(tiny_gguf, edgeprune_cache):
    path = tiny_gguf()
    load_model(path)
    before = entry_for_file(path)
    st = path.stat()
    os.utime(path, (st.st_atime, st.st_mtime + 10))
    assert entry_for_file(path) != before
    load_model(path)
    assert entry_problem(entry_for_file(path)) is None


def test_a_truncated_cache_entry_is_rebuilt(tiny_gguf, edgeprune_cache):
    path = tiny_gguf()
    load_model(path)
    weights = entry_for_file(path) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "model.safetensors is truncated" in entry_problem(weights.parent)
    with pytest.warns(UserWarning, match="was damaged .*converting again"):
        load_model(path)
    assert entry_problem(weights.parent) is None


def test_a_damaged_entry_that_cannot_go_names_the_folder(tiny_gguf, edgeprune_cache, monkeypatch):
    path = tiny_gguf()
    load_model(path)
    entry = entry_for_file(path)
    (entry / "model.safetensors").write_bytes(b"\x00" * 16)
    monkeypatch.setattr(convert, "discard", lambda e: False)  # e.g. a read-only cache
    with pytest.raises(ModelLoadError, match="delete the folder") as err:
        load_model(path)
    assert f"cached conversion {entry} is damaged" in str(err.value)


def test_an_entry_that_looks_complete_but_does_not_load(tiny_gguf, edgeprune_cache):
    path = tiny_gguf()
    load_model(path)
    entry = entry_for_file(path)
    (entry / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=f"cached conversion {entry} cannot be loaded") as err:
        load_model(path)
    assert f"delete the folder {entry}" in str(err.value)


def test_use_cache_false_writes_nothing(tiny_gguf, edgeprune_cache):
    model, tok = load_model(tiny_gguf(), use_cache=False)
    assert model.config.vocab_size == 257 and not (edgeprune_cache / "models").exists()
