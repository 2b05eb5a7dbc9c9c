"""Helpers for the exporter/runtime unit tests: a tiny byte-level tokenizer that fits the
256-token vocabulary of the ``tiny_llama`` / ``tiny_qwen2`` fixtures, and export helpers."""

from __future__ import annotations

import numpy as np

CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_tokenizer():
    """Byte-level BPE over 255 byte symbols (0xFF never occurs in UTF-8) + ``</s>`` = 255."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet)
    # bytes_to_unicode maps byte 0xFF to 'ÿ'; drop it so ids stay < 255
    byte_chars.remove("ÿ")
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT
    assert fast.convert_tokens_to_ids("</s>") == 255
    return fast


def rand_ids(n, vocab=255, seed=0, batch=1):
    """``int64 [batch, n]`` token ids below ``vocab`` (never the eos id 255)."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, n), dtype=np.int64)
