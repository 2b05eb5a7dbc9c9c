"""Torch-free tokenizer for exported folders (``tokenizers`` + ``jinja2`` only, no transformers).

An exported folder carries the files written by a Hugging Face tokenizer's
``save_pretrained``: ``tokenizer.json`` (the fast tokenizer: normalizer,
pre-tokenizer, model, post-processor, decoder), ``tokenizer_config.json`` (special
tokens, cleanup flag, possibly the chat template) and optionally
``chat_template.jinja`` / ``generation_config.json``. :class:`Tokenizer` reproduces
transformers' ``encode`` / ``decode`` / ``apply_chat_template`` on them, and
:class:`IncrementalDecoder` turns a stream of token ids into text pieces whose
concatenation equals ``decode`` of all ids (multi-token UTF-8 characters included), over
``tokenizers.decoders.DecodeStream``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from edgeprune_runtime.errors import GenerationError, RuntimeLoadError

__all__ = ["Tokenizer", "IncrementalDecoder", "clean_up_tokenization", "check_text", "load_backend",
           "COMPACT_LOAD_MIN_BYTES"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: drop spaces before punctuation/contractions."""
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
            .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
            .replace(" 've", "'ve").replace(" 're", "'re"))


def check_text(text: str, what: str = "the text") -> str:
    """``text`` unchanged when the tokenizer can take it: a ``str`` whose characters are all
    Unicode scalar values. A lone surrogate cannot be encoded as UTF-8 (``tokenizers``
    fails with a bare ``TypeError``); one in ``U+DC80..U+DCFF`` is a byte that was not
    UTF-8, smuggled in by Python's ``surrogateescape`` (a command-line argument or file
    name in another encoding).

    Args:
        text: the string to check.
        what: how the message names it (``"the prompt"``, ``"prompt row 2"``).

    Raises:
        GenerationError: ``text`` is not a ``str``, or holds a lone surrogate; the message
            gives its position.
    """
    if not isinstance(text, str):
        raise GenerationError(f"{what} must be a str, got {type(text).__name__}", "pass a string prompt")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        if 0xDC80 <= code <= 0xDCFF:
            raise GenerationError(f"{what} is not UTF-8 text: it holds the byte 0x{code - 0xDC00:02x} "
                                  f"(character {e.start})",
                                  "pass UTF-8 text (on a command line: a UTF-8 terminal and locale, "
                                  "or re-encode the file the text came from)") from None
        raise GenerationError(f"{what} is not valid text: it holds the lone surrogate U+{code:04X} "
                              f"(character {e.start})",
                              "pass a str of whole characters (decode bytes with "
                              ".decode('utf-8', errors='replace'))") from None
    return text


def _token_text(v: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


def _check_side_fields(folder: Path, config: dict, gen: dict | None, template) -> None:
    """Types of the fields :class:`Tokenizer` reads from ``tokenizer_config.json``,
    ``generation_config.json`` and the chat template files (a damaged or hand-edited file
    gives one clear error naming it, not a TypeError in a later call).

    Raises:
        RuntimeLoadError: naming the file and the field.
    """
    def bad(name, field, v, want):
        return RuntimeLoadError(f"{folder / name}: field {field!r} = {str(v)[:80]!r} is not {want}",
                                "re-export the folder; the file is corrupt or was edited")

    for key in _SPECIAL_KEYS:
        v = config.get(key)
        if v is not None and not isinstance(v, str) and not (
                isinstance(v, dict) and isinstance(v.get("content"), str)):
            raise bad("tokenizer_config.json", key, v, "a token string or an AddedToken object")
    ct = config.get("chat_template")
    if ct is not None and not isinstance(ct, str) and not (isinstance(ct, list) and all(
            isinstance(t, dict) and isinstance(t.get("template"), (str, type(None))) for t in ct)):
        raise bad("tokenizer_config.json", "chat_template", ct, "a template string or a list of "
                  "{name, template} objects")
    if template is not None and not isinstance(template, str):
        raise bad("chat_template.json", "chat_template", template, "a template string")
    eos = (gen or {}).get("eos_token_id")
    if eos is not None and not (_whole(eos) or (isinstance(eos, list) and all(_whole(e) for e in eos))):
        raise bad("generation_config.json", "eos_token_id", eos, "a token id or a list of them")


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


#: :func:`load_backend` builds BPE models itself from files of at least this many bytes
#: (a few hundred thousand tokens and merges); smaller ones go through ``from_file``: the
#: saving grows with the vocabulary, and SmolLM2's 49,152 tokens (a 1.4 MB file) take
#: the same memory either way, the parse's Python leftovers then adding ~4 MiB to the job.
COMPACT_LOAD_MIN_BYTES = 4 << 20


def load_backend(path: str | Path, min_bytes: int = COMPACT_LOAD_MIN_BYTES):
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json``, the same object
    ``tokenizers.Tokenizer.from_file`` returns, built so that it stays small in memory.

    ``from_file`` parses a BPE model's vocabulary and merges with transient strings
    interleaved with the ones it keeps, and the heap stays fragmented after they are
    freed: Gemma 3's tokenizer (262,144 tokens, 514,906 merges) held 90.7 MiB resident
    (68 MiB of it live: two vocabulary maps, their strings, the merge map). For a BPE
    model this reads the JSON with :mod:`json`, builds the model with
    ``tokenizers.models.BPE(vocab, merges, **options)`` (the library's own constructor,
    the same options), the rest of the pipeline with ``Tokenizer.from_str`` (the file
    with a model that holds only the added tokens, at their ids) and puts the model in
    (``Tokenizer.model``): 76.4 MiB resident for Gemma 3 (Qwen2.5's 151,936 tokens: 33
    instead of 47), the same ids and text (``tests/unit/test_tokenizer.py``). Files under
    ``min_bytes`` go through ``from_file``. Its parse peaks higher (+268 vs +162 MiB above the
    process for Gemma 3), before the session is built. Any other model (Unigram,
    WordPiece, WordLevel), or a file this path does not read exactly as ``from_file``
    would (merges that are not pairs, a model option it does not know), goes through
    ``from_file``.

    Args:
        path: a ``tokenizer.json``.
        min_bytes: files smaller than this many bytes always go through ``from_file``
            (:data:`COMPACT_LOAD_MIN_BYTES`; 0: every BPE file is built here).

    Raises:
        Exception: what ``tokenizers`` raises for a file it cannot parse (a bare
            ``Exception``), ``OSError`` for one that cannot be read, ``ValueError``
            (``json.JSONDecodeError``, ``UnicodeDecodeError``) for one that is not JSON.
    """
    from tokenizers import Tokenizer as _HFTok

    path = Path(path)
    backend = _compact_bpe(path) if path.stat().st_size >= min_bytes else None
    # a file _compact_bpe does not build has had its parse freed on return
    return backend if backend is not None else _HFTok.from_file(str(path))


def _compact_bpe(path: Path):
    """:func:`load_backend`'s own build of a BPE ``tokenizer.json``; ``None`` for any file
    it does not read exactly as ``from_file`` would (another model type, an unknown model
    option, dropout, merges that are not pairs, malformed added tokens)."""
    from tokenizers import Tokenizer as _HFTok
    from tokenizers import models

    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    model = data.get("model") if isinstance(data, dict) else None
    known = {"type", "vocab", "merges", "dropout", "unk_token", "continuing_subword_prefix",
             "end_of_word_suffix", "fuse_unk", "byte_fallback", "ignore_merges"}
    added = data.get("added_tokens") if isinstance(data, dict) else None
    if not (isinstance(model, dict) and model.get("type") == "BPE" and set(model) <= known
            and isinstance(model.get("vocab"), dict) and isinstance(model.get("merges"), list)
            and isinstance(added, list) and model.get("dropout") is None):
        return None
    vocab, merges = model.pop("vocab"), model.pop("merges")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
        return None
    for i, m in enumerate(merges):          # in place: each "a b" string freed as it is split
        pair = m.split(" ") if isinstance(m, str) else m
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            return None
        merges[i] = (pair[0], pair[1])
    try:
        placeholder = {a["content"]: a["id"] for a in added}
    except (KeyError, TypeError):
        return None
    opts = {k: model[k] for k in ("unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                                  "fuse_unk", "byte_fallback", "ignore_merges")
            if model.get(k) is not None}
    data["model"] = dict(model, vocab=placeholder, merges=[])
    backend = _HFTok.from_str(json.dumps(data))
    del data
    bpe = models.BPE(vocab, merges, **opts)
    del vocab, merges
    backend.model = bpe
    return backend


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template of a folder.

    Build it with :meth:`from_folder`. Attributes:

    * ``eos_token_ids``: list of ids that end generation (the tokenizer's
      ``eos_token`` plus ``generation_config.json``'s ``eos_token_id`` if present);
    * ``bos_token_id``, ``pad_token_id``, ``unk_token_id``: ids or ``None``;
    * ``chat_template``: the Jinja source or ``None``;
    * ``vocab_size``: size including added tokens.
    """

    def __init__(self, backend, config: dict | None = None, chat_template: str | None = None,
                 generation_config: dict | None = None):
        self._tok = backend
        self.config = dict(config or {})
        self.chat_template = chat_template if chat_template is not None else self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        # transformers >= 5 ignores the cleanup flag for BPE models (it corrupts their output)
        # unless explicitly forced; mirror that so decode() matches it.
        self.clean_up_tokenization_spaces = bool(self.config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(self.config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            t = _token_text(self.config.get(key))
            if t is not None:
                self.special_tokens[key] = t
        self.bos_token_id = self.token_to_id(self.special_tokens.get("bos_token"))
        self.pad_token_id = self.token_to_id(self.special_tokens.get("pad_token"))
        self.unk_token_id = self.token_to_id(self.special_tokens.get("unk_token"))
        eos: list[int] = []
        eid = self.token_to_id(self.special_tokens.get("eos_token"))
        if eid is not None:
            eos.append(eid)
        gen_eos = (generation_config or {}).get("eos_token_id")
        for e in ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])):
            if int(e) not in eos:
                eos.append(int(e))
        self.eos_token_ids: list[int] = eos

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json`` when present) from ``folder``.

        Raises:
            RuntimeLoadError: ``tokenizer.json`` is missing or cannot be parsed, or a
                JSON side file is corrupt.
        """
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise RuntimeLoadError(f"no tokenizer.json in {folder}",
                                   "export the model with its tokenizer (tokenizer.save_pretrained(folder))")
        try:
            backend = load_backend(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise RuntimeLoadError(f"cannot parse {path}: {e}", "re-export the folder; the file is corrupt") from e

        def _json(name):
            p = folder / name
            if not p.is_file():
                return None
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise RuntimeLoadError(f"cannot read {p}: {e}", "re-export the folder; the file is corrupt") from e
            if not isinstance(data, dict):
                raise RuntimeLoadError(f"cannot read {p}: a JSON object expected, found "
                                       f"{type(data).__name__}", "re-export the folder; the file is corrupt")
            return data

        config = _json("tokenizer_config.json") or {}
        gen = _json("generation_config.json")
        template = None
        tp = folder / "chat_template.jinja"
        try:
            if tp.is_file():
                template = tp.read_text(encoding="utf-8")
            elif (folder / "chat_template.json").is_file():
                tp = folder / "chat_template.json"
                template = (_json("chat_template.json") or {}).get("chat_template")
        except (OSError, ValueError) as e:       # UnicodeDecodeError is a ValueError
            raise RuntimeLoadError(f"cannot read {tp}: {e}", "re-export the folder; the file is corrupt") from e
        _check_side_fields(folder, config, gen, template)
        return cls(backend, config, template, gen)

    # -- basic API ---------------------------------------------------------------------------

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer`` (its decoder pipeline drives streaming)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        """Id of a token string, or ``None`` if absent."""
        if token is None:
            return None
        return self._tok.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        """Token string of an id, or ``None``."""
        return self._tok.id_to_token(int(idx))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (as transformers' ``tokenizer.encode``).

        Args:
            text: the string to tokenize.
            add_special_tokens: let the post-processor add BOS/EOS as the model's
                tokenizer defines (transformers' default is True; the runtime's is False
                because chat templates already contain the special tokens).

        Raises:
            GenerationError: ``text`` is not a string, or not valid text (:func:`check_text`).
        """
        check_text(text, "text to encode")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """:meth:`encode` for several strings (no padding).

        Raises:
            GenerationError: a string that :func:`check_text` refuses.
        """
        for i, t in enumerate(texts):
            check_text(t, f"text {i} to encode")
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (as transformers' ``tokenizer.decode``).

        Args:
            ids: token ids (ints or numpy integers).
            skip_special_tokens: drop special/added-special tokens (e.g. ``<|im_end|>``).
        """
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            text = clean_up_tokenization(text)
        return text

    # -- chat --------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """Render a conversation with the folder's Jinja chat template.

        The environment matches transformers': ``ImmutableSandboxedEnvironment`` with
        ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
        filter, ``raise_exception`` and ``strftime_now`` globals, and the special tokens
        (``bos_token``, ``eos_token``...) as variables.

        Args:
            messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
            add_generation_prompt: append the assistant turn header.
            **kwargs: extra template variables (e.g. ``tools``).

        Returns:
            The prompt string (encode it with ``add_special_tokens=False``).

        Raises:
            GenerationError: the folder has no chat template, ``messages`` is malformed,
                or the template raises.
        """
        if not self.chat_template:
            raise GenerationError("this tokenizer has no chat template",
                                  "pass a plain prompt with chat=False (CLI: --no-chat), or export from a "
                                  "model whose tokenizer has one")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise GenerationError("messages must be a list of {'role': ..., 'content': ...} dicts",
                                  "e.g. [{'role': 'user', 'content': 'Hello'}]")
        variables = dict(self.special_tokens)
        variables.update(kwargs)
        try:
            template = self._compiled_template()
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except GenerationError:
            raise
        except Exception as e:  # jinja2 errors, TemplateError from raise_exception
            raise GenerationError(f"chat template failed: {type(e).__name__}: {e}",
                                  "check the messages' roles and order, or the folder's "
                                  "chat_template (pass chat=False / --no-chat to skip it)") from e

    def _compiled_template(self):
        cached = getattr(self, "_template_cache", None)
        if cached is not None and cached[0] == self.chat_template:
            return cached[1]
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise GenerationError(f"chat template refused the messages: {message}",
                                  "check the messages' roles and order")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(fmt):
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        compiled = env.from_string(self.chat_template)
        self._template_cache = (self.chat_template, compiled)
        return compiled

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh :class:`IncrementalDecoder` bound to this tokenizer."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Streams text from token ids, one token at a time, over ``tokenizers``' own
    streaming decoder (:class:`tokenizers.decoders.DecodeStream`).

    Byte-level BPE (GPT-2 style) splits one UTF-8 character (emoji, CJK) across
    several tokens, and SentencePiece-style decoders strip a leading space only at
    the start of a text; decoding token by token is therefore wrong. ``DecodeStream``
    keeps a short window of ids, decodes it with the tokenizer's decoder pipeline and
    emits the new text once it ends in a complete character (the scheme of Hugging Face
    TGI / vLLM's ``detokenize_incrementally``). :meth:`flush` emits what is still held
    back (an incomplete character at the end of the stream), from one full decode.

    Invariant: ``"".join(pieces) + flush() == tokenizer.decode(all_ids)`` (for folders
    whose ``clean_up_tokenization_spaces`` applies, each piece is cleaned up on its own:
    a space and the punctuation after it in two different pieces stay apart).

    Args:
        tokenizer: a :class:`Tokenizer`.
        skip_special_tokens: as in ``decode``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._read = 0     # ids[:read] have been emitted
        self._emitted: list[str] = []
        self._stream = self._new_stream()

    def _new_stream(self):
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def _emit(self, piece: str) -> str:
        if self.tokenizer.clean_up_tokenization_spaces:
            piece = clean_up_tokenization(piece)
        if piece:
            self._emitted.append(piece)
        return piece

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly ``""``)."""
        self.ids.append(int(token_id))
        piece = self._stream.step(self.tokenizer.backend, int(token_id))
        if piece is None:
            return ""
        self._read = len(self.ids)
        return self._emit(piece)

    def push_many(self, token_ids: Iterable[int]) -> str:
        """Push several ids; return the concatenated pieces."""
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Emit any text held back (e.g. an incomplete character at the end of the stream)."""
        if self._read >= len(self.ids):
            return ""
        # One full decode at the end keeps the invariant for the held-back tail.
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        done = self.text
        piece = full[len(done):] if full.startswith(done) else ""
        self._read = len(self.ids)
        self._stream = self._new_stream()     # a later push starts a fresh window
        if piece:
            self._emitted.append(piece)
        return piece

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def reset(self) -> None:
        """Forget every id (start a new stream)."""
        self.ids.clear()
        self._read = 0
        self._emitted.clear()
        self._stream = self._new_stream()
