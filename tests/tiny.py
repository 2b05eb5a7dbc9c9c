"""Tiny models, tokenizers and exports for the tests (built offline, in seconds).

* :func:`tiny_model`: a random-weight decoder from any transformers config class;
  :func:`tiny_gemma3`: Gemma 3 with local and global layers.
* :func:`byte_tokenizer`: one id per byte (ids < 255, ``</s>`` = 255), for the vocab-256 tiny models.
* :func:`bpe_tokenizer` / :func:`save_bpe_tokenizer`: a byte-level BPE with merges trained on
  :data:`CORPUS` and a ChatML template, for the runtime tokenizer tests.
* :class:`CharTokenizer`: the smallest object with the HF call convention (id = byte value),
  for calibration and evaluation code that only calls the tokenizer.
* :func:`export_tiny_llama`, :func:`rand_ids`, :func:`assert_int4_export_matches`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def tiny_model(config_cls, **kw):
    """A random-weight ``*ForCausalLM`` from a transformers config class (2 layers, hidden 64,
    4 q / 2 kv heads, vocab 256 unless ``kw`` says otherwise), weights widened to N(0, 0.08)."""
    from transformers import AutoModelForCausalLM

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(kw)
    torch.manual_seed(0)
    cfg = config_cls(**base)
    model = AutoModelForCausalLM.from_config(cfg)
    # Random init gives near-zero weights; widen them so quantization/pruning errors show.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.float().eval()


def tiny_gemma3(**kw):
    """A Gemma 3 text model of 3 layers (sliding, full, sliding; window 4), one KV head,
    QK-norm and (1 + w) norms with random ``w``; ``kw`` overrides the config."""
    from transformers import Gemma3TextConfig

    cfg = dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=16, sliding_window=4,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
               query_pre_attn_scalar=24, tie_word_embeddings=True, pad_token_id=0)
    cfg.update(kw)
    m = tiny_model(Gemma3TextConfig, **cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.3)
    return m


BYTE_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def byte_tokenizer():
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
    fast.chat_template = BYTE_CHAT_TEMPLATE
    assert fast.convert_tokens_to_ids("</s>") == 255
    return fast


def rand_ids(n, vocab=255, seed=0, batch=1):
    """``int64 [batch, n]`` token ids below ``vocab`` (never the eos id 255)."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, n), dtype=np.int64)


def assert_int4_export_matches(model, quantized: dict, folder: Path, atol: float = 1e-4) -> None:
    """Export a tiny byte-vocabulary ``model`` as int4 ``MatMulNBits`` from ``quantized``
    (exact accuracy level, float head) and check the runtime's logits on 40 random ids
    against the PyTorch model's within ``atol``."""
    import edgeprune_exporters as exporters
    import edgeprune_runtime as runtime

    ids = rand_ids(40, seed=11)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).logits.float().numpy()
    exporters.export_onnx(model, byte_tokenizer(), folder, precision="int4", quantized=quantized,
                          accuracy_level=0, lm_head="fp", max_length=128, overwrite=True)
    with runtime.load(folder) as s:
        np.testing.assert_allclose(s.logits(ids), ref, atol=atol)


class CharTokenizer:
    """A deterministic byte tokenizer (id = byte value) with the HF call convention."""

    name_or_path = "bytes"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}

    def __len__(self):
        return 256


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Small language models run on phones and laptops.",
    "Pruning and quantization make models smaller and faster.",
    "Hello world! How are you today? I am fine, thank you.",
    "Edge devices have little memory and limited bandwidth.",
] * 20

BPE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def bpe_tokenizer(vocab_size: int = 320):
    """A transformers ``PreTrainedTokenizerFast`` over a byte-level BPE trained on CORPUS.

    All 256 byte symbols are in the vocabulary (any text encodes), plus the merges
    learnt on CORPUS up to ``vocab_size`` ids.

    Special tokens: ``<|endoftext|>`` (0, unk/bos), ``<|im_start|>`` (1), ``<|im_end|>`` (2, eos/pad).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = BPE_CHAT_TEMPLATE
    assert len(fast) <= vocab_size
    return fast


def save_bpe_tokenizer(folder: str | Path, vocab_size: int = 320):
    """Write the tiny tokenizer's files into ``folder``; returns transformers' tokenizer
    reloaded from that folder (the reference the runtime must match)."""
    from transformers import AutoTokenizer

    bpe_tokenizer(vocab_size).save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


def export_tiny_llama(folder: str | Path, precision: str = "fp32", max_length: int = 512):
    """Export a 2-layer random llama (hidden 64, 4 q / 2 kv heads of dim 16, vocab = the tiny
    tokenizer's) with ``exporters.export_onnx``; returns ``(folder, hf_model, hf_tokenizer)``."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import edgeprune_exporters as exporters

    tok = save_bpe_tokenizer(tempfile.mkdtemp(prefix="tinytok-"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_length,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    exporters.export_onnx(model, tok, folder, precision=precision, overwrite=True, max_length=max_length)
    return Path(folder), model, tok
