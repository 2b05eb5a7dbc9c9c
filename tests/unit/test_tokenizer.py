"""runtime.tokenizer against transformers on small tokenizers built offline."""

from __future__ import annotations

import json

import pytest
from tiny import CORPUS, save_bpe_tokenizer

from edgeprune_runtime.errors import GenerationError, RuntimeLoadError
from edgeprune_runtime.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = ["Hello world!", "The quick brown fox", "  two  spaces\nand a newline",
         "models run on phones, laptops.", "", "<|im_start|>user\nHello<|im_end|>"]


@pytest.fixture
def tiny(tmp_path):
    hf = save_bpe_tokenizer(tmp_path)
    return hf, Tokenizer.from_folder(tmp_path)


def test_encode_decode_match_transformers(tiny):
    hf, tok = tiny
    assert tok.vocab_size == len(hf) <= 320
    for text in TEXTS:
        for special in (False, True):
            assert tok.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        ids = hf.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.encode_batch(TEXTS[:3]) == [hf.encode(t, add_special_tokens=False) for t in TEXTS[:3]]
    # Special tokens are single ids and are dropped by decode(skip_special_tokens=True).
    ids = tok.encode("<|im_start|>user\nHello<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nHello"


def test_special_token_ids(tiny):
    hf, tok = tiny
    assert tok.eos_token_ids == [hf.eos_token_id] == [2]
    assert tok.bos_token_id == hf.bos_token_id == 0
    assert tok.pad_token_id == hf.pad_token_id == 2
    assert tok.token_to_id("<|im_start|>") == 1 and tok.id_to_token(1) == "<|im_start|>"
    assert tok.token_to_id("no-such-token") is None


def test_generation_config_adds_eos_ids(tmp_path):
    save_bpe_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_folder(tmp_path).eos_token_ids == [2, 0]


def test_chat_template_matches_transformers(tiny):
    hf, tok = tiny
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "How are you?"}]
    for agp in (True, False):
        assert tok.apply_chat_template(msgs, add_generation_prompt=agp) == \
            hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
    assert tok.apply_chat_template(msgs[1:2]).endswith("<|im_start|>assistant\n")


def test_chat_template_in_tokenizer_config_and_errors(tmp_path):
    save_bpe_tokenizer(tmp_path)
    tpl = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(GenerationError, match="no chat template") as e:
        Tokenizer.from_folder(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    assert e.value.hint
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = tpl.replace("{% for", "{% if messages[0]['role'] == 'bad' %}"
                                       "{{ raise_exception('bad role') }}{% endif %}{% for")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(GenerationError, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])
    with pytest.raises(GenerationError, match="list of"):
        tok.apply_chat_template("hello")
    # The sandbox refuses attribute access to Python internals.
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(GenerationError, match="chat template failed"):
        Tokenizer.from_folder(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_or_corrupt_folder(tmp_path):
    with pytest.raises(RuntimeLoadError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(RuntimeLoadError, match="cannot parse"):
        Tokenizer.from_folder(tmp_path)
    with pytest.raises(GenerationError, match="must be a str"):
        save_bpe_tokenizer(tmp_path / "ok")
        Tokenizer.from_folder(tmp_path / "ok").encode(123)


def _byte_fallback_tokenizer(tmp_path):
    """A SentencePiece-style (Metaspace + byte fallback) tokenizer: the llama-2 layout."""
    from tokenizers import Tokenizer as T
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = T(models.BPE(unk_token="<unk>", byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.pre_tokenizer = None
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False))
    # The byte pieces are ordinary vocabulary entries (as in llama-2), not special added tokens.
    j = json.loads(t.to_str())
    j["added_tokens"] = [a for a in j["added_tokens"] if not a["content"].startswith("<0x")]
    t = T.from_str(json.dumps(j))
    PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(tmp_path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tmp_path)), Tokenizer.from_folder(tmp_path)


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece"])
def test_incremental_decoder_concatenation_equals_decode(tmp_path, kind):
    if kind == "bytelevel":
        hf, tok = save_bpe_tokenizer(tmp_path), None
        tok = Tokenizer.from_folder(tmp_path)
    else:
        hf, tok = _byte_fallback_tokenizer(tmp_path)
    # Characters outside the training corpus become several byte tokens each.
    text = "Hello wörld — 日本 😀 fox!\n  The end é"
    ids = hf.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    tail = dec.flush()
    assert "".join(pieces) + tail == tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)  # never emits half a character
    assert dec.text == tok.decode(ids)
    # An emoji split across several ids is held back until complete.
    emoji_ids = hf.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) >= 2
    d = tok.incremental_decoder()
    outs = [d.push(i) for i in emoji_ids]
    assert outs[:-1] == [""] * (len(emoji_ids) - 1) and outs[-1].endswith("😀")
    # A stream cut in the middle of a character: flush emits what decode() gives.
    d.reset()
    assert d.push_many(emoji_ids[:1]) == "" and d.flush() == tok.decode(emoji_ids[:1])


def _backend_pair(path):
    """``(runtime.tokenizer.load_backend(path), tokenizers' own from_file(path))``."""
    from tokenizers import Tokenizer as T

    from edgeprune_runtime.tokenizer import load_backend
    return load_backend(path, min_bytes=0), T.from_file(str(path))


def _assert_same_backend(a, b, texts):
    """Same ids (with and without special tokens), offsets, text back, vocabulary."""
    assert a.get_vocab(with_added_tokens=True) == b.get_vocab(with_added_tokens=True)
    assert a.get_vocab_size(True) == b.get_vocab_size(True) and \
        a.get_vocab_size(False) == b.get_vocab_size(False)
    assert [str(x) for x in a.get_added_tokens_decoder().values()] == \
        [str(x) for x in b.get_added_tokens_decoder().values()]
    for text in texts:
        for special in (False, True):
            ea, eb = a.encode(text, add_special_tokens=special), b.encode(text, add_special_tokens=special)
            assert ea.ids == eb.ids and ea.offsets == eb.offsets, text[:80]
            for skip in (True, False):
                assert a.decode(ea.ids, skip_special_tokens=skip) == b.decode(eb.ids, skip_special_tokens=skip)
    ids = list(range(a.get_vocab_size(True)))
    assert [a.id_to_token(i) for i in ids] == [b.id_to_token(i) for i in ids]
    assert a.decode(ids, skip_special_tokens=False) == b.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece"])
def test_load_backend_equals_from_file(tmp_path, kind):
    """The runtime builds a BPE tokenizer's model with ``tokenizers.models.BPE`` (less heap
    left fragmented than ``Tokenizer.from_file``: Gemma 3 76 vs 91 MiB), and it is the same
    tokenizer: vocabulary, added/special tokens, ids and offsets, decoded text, on the tiny
    byte-level (GPT-2 / Qwen layout, "a b" merges) and SentencePiece-style (Metaspace, byte
    fallback) tokenizers, both merge formats, and whatever the runtime's Tokenizer adds on
    top (chat template, streaming) through it."""
    if kind == "bytelevel":
        save_bpe_tokenizer(tmp_path)
    else:
        _byte_fallback_tokenizer(tmp_path)
    path = tmp_path / "tokenizer.json"
    texts = TEXTS + CORPUS + ["naïve café 日本語 😀 \t tabs", "<s> </s> <unk> inside text"]
    a, b = _backend_pair(path)
    assert type(a.model).__name__ == "BPE"
    _assert_same_backend(a, b, texts)
    # the other merge format ([["a", "b"], ...], transformers 5's) reads the same
    j = json.loads(path.read_text())
    merges = j["model"]["merges"]
    j["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in merges]
    (tmp_path / "pairs.json").write_text(json.dumps(j, ensure_ascii=False))
    a2, b2 = _backend_pair(tmp_path / "pairs.json")
    _assert_same_backend(a2, b, texts)
    _assert_same_backend(a2, b2, texts)


def test_load_backend_builds_bpe_without_from_file(tmp_path, monkeypatch):
    """A BPE file of at least ``min_bytes`` never goes through ``from_file`` (whose parse
    leaves the heap fragmented); a smaller one (the default threshold), a model of another
    type (WordLevel here) and a file whose merges are not pairs do, unchanged (its error
    included)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    from edgeprune_runtime.tokenizer import COMPACT_LOAD_MIN_BYTES, load_backend

    save_bpe_tokenizer(tmp_path)
    path = tmp_path / "tokenizer.json"
    calls = []
    RealT = tokenizers.Tokenizer

    class Spy:
        def __getattr__(self, name):
            return getattr(RealT, name)

        @staticmethod
        def from_file(p):
            calls.append(p)
            return RealT.from_file(p)

    monkeypatch.setattr(tokenizers, "Tokenizer", Spy())
    assert type(load_backend(path, min_bytes=0).model).__name__ == "BPE" and calls == []
    # a small file (under COMPACT_LOAD_MIN_BYTES) goes through from_file
    assert path.stat().st_size < COMPACT_LOAD_MIN_BYTES
    assert type(load_backend(path).model).__name__ == "BPE" and calls == [str(path)]
    calls.clear()
    t = RealT(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "wl.json"))
    assert load_backend(tmp_path / "wl.json", min_bytes=0).encode("a b c").ids == [0, 1, 2]
    assert calls == [str(tmp_path / "wl.json")]
    j = json.loads(path.read_text())
    j["model"]["merges"] = ["a b c"] + j["model"]["merges"]
    (tmp_path / "bad.json").write_text(json.dumps(j))
    with pytest.raises(Exception, match="(?i)merge"):
        load_backend(tmp_path / "bad.json", min_bytes=0)
    assert calls[-1] == str(tmp_path / "bad.json")
