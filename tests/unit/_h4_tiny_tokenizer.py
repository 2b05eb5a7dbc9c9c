"""A tiny byte-level BPE tokenizer (vocab <= 256) for tests of the runtime, built offline."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Small language models run on phones and laptops.",
    "Pruning and quantization make models smaller and faster.",
    "Hello world! How are you today? I am fine, thank you.",
    "Edge devices have little memory and limited bandwidth.",
] * 20

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_tokenizer(vocab_size: int = 320):
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
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) <= vocab_size
    return fast


def save_tiny_tokenizer(folder: str | Path, vocab_size: int = 320):
    """Write the tiny tokenizer's files into ``folder``; returns transformers' tokenizer
    reloaded from that folder (the reference the runtime must match)."""
    from transformers import AutoTokenizer

    make_tiny_tokenizer(vocab_size).save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


def export_tiny_llama(folder: str | Path, precision: str = "fp32", max_length: int = 512):
    """Export a 2-layer random llama (hidden 64, 4 q / 2 kv heads of dim 16, vocab = the tiny
    tokenizer's) with ``exporters.export_onnx``; returns ``(folder, hf_model, hf_tokenizer)``."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import exporters

    tok = save_tiny_tokenizer(tempfile.mkdtemp(prefix="tinytok-"))
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
