"""Calibration windows (``nsamples`` x ``seqlen`` token ids) and evaluation text.

Sources accepted by :func:`load_documents` / :func:`get_calibration`:

* ``None`` or ``"default"``: the embedded default (see below);
* a plain-text file (``.txt``, ``.raw``, anything else): one document per blank-line
  separated paragraph block is *not* assumed -- the whole file is one document stream;
* a JSONL file (``.jsonl``): one document per line, field ``text``;
* a Parquet file (``.parquet``): column ``text`` (e.g. C4 validation);
* a Hugging Face dataset name (``"hf:NAME[:CONFIG][:SPLIT]"``), only when online and the
  ``datasets`` package is installed;
* ``"self"``: text sampled from the model itself (:func:`self_generated`; pass ``model=``
  to :func:`build_calibration`). No data needed, and the windows follow the model's own
  training distribution instead of one domain's (self-calibration: Williams et al.,
  "Self-calibration for Language Model Quantization and Pruning", NAACL 2025; data-free
  generation as in LLM-QAT, Liu et al. 2023). Why it matters: on SmolLM2-135M, GPTQ int4
  g64 asym calibrated on 64 x 512 windows of the embedded documentation text scores
  WikiText-2 perplexity 40.64, on C4 36.76 (domain mismatch costs ~10%); with 16 x 512
  windows (``bench/calibration_domain.py --quick``): embedded 50.03, C4 45.24,
  self-generated 44.94. Generation costs time (~80 s for 16 x 512 tokens with the PyTorch
  model on 2 CPU cores).
* ``"self-multilingual"``: the same, each window seeded with one of the shipped prompts in
  twelve languages (``edgeprune/data/calibration_prompts.json``);
* ``"self-mixed"``: half of the windows unseeded (as ``"self"``), half seeded (as
  ``"self-multilingual"``). Unseeded, a small model writes mostly English and the
  quantizer fits English at the other languages' cost (SmolLM2-135M best-w4 int4, 32
  windows: NTREX German +29.7 % perplexity vs English +11.7 %; ``"self-mixed"`` with 64
  windows: German +17.9 %, English +12.4 %, but WikiText-2 +14.0 % vs +11.2 %).
  ``bench/calibration_languages.py`` measures each source per language
  (``docs/evaluation.md``);
* ``"self-mixed-<pct>"``: ``pct`` % of the windows seeded, the rest unseeded, evenly
  spread (:func:`mixed_prompts`; ``self-mixed`` is ``self-mixed-50``).

**The embedded default text** is the Python standard library's bundled documentation
topics (``pydoc_data.topics``: 79 topics, about 465k characters of English prose and code
that ships with every CPython). Topics are ordered by name; every third topic
(index % 3 == 2, after dropping topics whose text repeats an earlier one) forms the *held-out* part used for evaluation, the rest the
*calibration* part, so the two never share text. It is small, real and always there;
it is not a substitute for a domain corpus: calibrate on text like your application's.

**Windows.** Documents are tokenized without special tokens (no BOS) and joined with a
blank line into one token stream, which is cut into consecutive non-overlapping
``seqlen`` windows. A document longer than ``seqlen`` therefore spans several windows
(never dropped), and no search waits for a single document of ``seqlen`` tokens, so a
model with a 131k context can calibrate on ordinary text. ``nsamples`` windows are then
drawn without replacement with ``torch.Generator().manual_seed(seed)``. ``seqlen`` is
capped at :data:`MAX_SEQLEN` whatever the model's context length. The stream's tail,
shorter than one window, is not used: ``info["tail_tokens_unused"]`` counts it and
:func:`describe` says so (the CLI prints that line).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from .errors import CalibrationError, ConfigError

#: Upper bound on calibration window length, independent of the model's context length.
MAX_SEQLEN = 4096
#: Tokens read beyond what the windows need, so the random draw has room (x this factor).
_OVERSAMPLE = 4


@dataclass
class CalibrationSet:
    """Token windows plus where they came from.

    Attributes:
        input_ids: ``int64 [nsamples, seqlen]``.
        info: JSON-able provenance: source, sha256 of the text read, seed, sizes.
    """

    input_ids: torch.Tensor
    info: dict = field(default_factory=dict)


def default_documents(part: str = "calibration") -> list[str]:
    """The embedded default text (``pydoc_data.topics``), split into two disjoint parts.

    Args:
        part: ``"calibration"`` or ``"heldout"``.

    Returns:
        List of documents (one per documentation topic), in topic-name order.
    """
    if part not in ("calibration", "heldout"):
        raise ConfigError(f"unknown default text part {part!r}", "use 'calibration' or 'heldout'")
    from pydoc_data.topics import topics

    docs: list[str] = []
    for name in sorted(topics):  # some topics share one text: keep it once
        text = topics[name].strip()
        if text not in docs:
            docs.append(text)
    return [d for i, d in enumerate(docs) if (i % 3 == 2) == (part == "heldout")]


def default_text(part: str = "heldout") -> str:
    """The embedded default text part as one string (documents joined by a blank line)."""
    return "\n\n".join(default_documents(part))


def read_text_file(path: str | Path) -> str:
    """Read a text file as UTF-8 with universal newlines (CRLF becomes LF), without a
    leading byte-order mark.

    Raises:
        CalibrationError: missing or undecodable file.
    """
    p = Path(path)
    try:
        with open(p, encoding="utf-8-sig") as f:      # a leading byte-order mark is not text
            return f.read()
    except FileNotFoundError:
        raise CalibrationError(f"text file {p} does not exist", "check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"could not read {p} as UTF-8 text ({exc})",
                               "pass a UTF-8 plain-text, JSONL or Parquet file") from None


def load_documents(source: str | Path | None = None, *, part: str = "calibration") -> tuple[list[str], str]:
    """Load documents from any supported source.

    Args:
        source: see the module docstring.
        part: which part of the embedded default to use when ``source`` is None.

    Returns:
        ``(documents, description)``.

    Raises:
        CalibrationError: unreadable file, missing ``text`` field/column, offline dataset.
    """
    if source is None or str(source) == "default":
        return default_documents(part), f"default:pydoc_data.topics[{part}]"
    s = str(source)
    if s.startswith("hf:"):
        return _hf_documents(s[3:]), s
    p = Path(s).expanduser()
    if not p.exists():
        raise CalibrationError(f"calibration source {s!r} not found",
                               "pass a text/JSONL/Parquet file, 'hf:NAME' (online) or omit it for the default")
    if p.suffix.lower() == ".jsonl":
        docs = []
        # records end at "\n" only: JSON strings may hold U+2028, U+2029 or U+0085 raw,
        # which str.splitlines() would also split on
        for i, line in enumerate(read_text_file(p).split("\n")):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                raise CalibrationError(f"{p}:{i + 1} is not a JSON object with a 'text' field",
                                       "write one {\"text\": ...} object per line") from None
            if doc is not None and not isinstance(doc, str):
                raise CalibrationError(f"{p}:{i + 1}: 'text' is a {type(doc).__name__}, not a string",
                                       "write the document's text as a JSON string")
            if doc:                 # null / empty documents are skipped, as in Parquet
                docs.append(doc)
        return docs, str(p)
    if p.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p, columns=["text"])
        except Exception as exc:  # pyarrow raises several types
            raise CalibrationError(f"could not read column 'text' from {p} ({exc})",
                                   "use a Parquet file with a string column named 'text'") from None
        col = table.column("text")
        import pyarrow as pa
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            raise CalibrationError(f"column 'text' of {p} holds {col.type}, not strings",
                                   "use a Parquet file with a string column named 'text'")
        return [t for t in col.to_pylist() if t], str(p)
    return [read_text_file(p)], str(p)


def _hf_documents(spec: str) -> list[str]:
    parts = spec.split(":")
    name, config, split = parts[0], (parts[1] if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else "train")
    try:
        import datasets  # type: ignore
    except ImportError:
        raise CalibrationError("Hugging Face datasets need the 'datasets' package",
                               "pip install datasets, or pass a local text/JSONL/Parquet file") from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        raise CalibrationError(f"could not load dataset {name!r} ({type(exc).__name__}); it needs network access",
                               "pass a local text/JSONL/Parquet file instead") from None
    return [t for t in ds["text"] if t]


def token_stream(tokenizer, documents: Iterable[str], max_tokens: int | None = None) -> list[int]:
    """Tokenize documents (no special tokens) into one stream joined by a blank line.

    Stops once ``max_tokens`` tokens are collected (bounded work on huge corpora).
    """
    sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for doc in documents:
        if not doc:
            continue
        if ids:
            ids.extend(sep)
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return ids


def check_seqlen(seqlen: int, model_max: int | None = None) -> int:
    """Validate a window length: ``1 < seqlen <= min(MAX_SEQLEN, model context)``.

    Raises:
        ConfigError: out of range.
    """
    limit = min(MAX_SEQLEN, model_max) if model_max else MAX_SEQLEN
    if not isinstance(seqlen, int) or seqlen < 2 or seqlen > limit:
        raise ConfigError(f"seqlen={seqlen} is out of range",
                          f"use 2 <= seqlen <= {limit} (cap {MAX_SEQLEN}, independent of the model's context)")
    return seqlen


def _check_nsamples(nsamples) -> None:
    if not isinstance(nsamples, int) or nsamples < 1:
        raise ConfigError(f"nsamples={nsamples} must be a positive integer", "use e.g. --nsamples 128")


#: Calibration source of text sampled from the model, each window seeded with one of the
#: prompts in several languages shipped in ``edgeprune/data/calibration_prompts.json``.
SELF_MULTILINGUAL = "self-multilingual"
#: Calibration source of text sampled from the model, every other window unseeded (the
#: model's own, mostly English, text: what ``self`` fits) and the rest seeded with the
#: shipped multilingual prompts (what :data:`SELF_MULTILINGUAL` fits).
SELF_MIXED = "self-mixed"
#: The named self-generated sources (``self-mixed-<pct>`` is one too:
#: :func:`self_source_prompts` decides every name).
SELF_SOURCES = ("self", SELF_MULTILINGUAL, SELF_MIXED)
_PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "calibration_prompts.json"


def seed_prompts() -> list[str]:
    """The shipped multilingual seed prompts (:data:`SELF_MULTILINGUAL`), one round per
    prompt index, the languages in file order within a round (en, de, fr, es, it, pt, ru,
    zh, ja, ar, hi, ko), so any first N windows mix the languages."""
    by_lang = json.loads(_PROMPTS_FILE.read_text(encoding="utf-8"))["prompts"]
    rounds = max(len(v) for v in by_lang.values())
    return [v[r] for r in range(rounds) for v in by_lang.values() if r < len(v)]


def mixed_prompts(seeded_pct: int = 50) -> list[str]:
    """Seeds of :data:`SELF_MIXED` (``seeded_pct`` = 50) and of ``self-mixed-<pct>``:
    ``""`` (BOS alone) for ``100 - seeded_pct`` % of the windows, evenly spread and first
    at index 0, the :func:`seed_prompts` in order at the others (each prompt once). At 50:
    unseeded at even indices, seeded at odd ones; at 75: one unseeded window, then three
    seeded.

    Raises:
        ConfigError: ``seeded_pct`` outside 1..99.
    """
    if not isinstance(seeded_pct, int) or not 0 < seeded_pct < 100:
        raise ConfigError(f"self-mixed seeded share {seeded_pct!r} % is out of range",
                          "use self-mixed-<pct> with 1 <= pct <= 99 (self-multilingual seeds every window)")
    u, out, seeds = 100 - seeded_pct, [], seed_prompts()
    k = 0
    while k < len(seeds):                  # ends with the last prompt
        i = len(out)
        if -(-(i + 1) * u // 100) > -(-i * u // 100):      # ceil steps: an unseeded window
            out.append("")
        else:
            out.append(seeds[k])
            k += 1
    return out


def self_source_prompts(source) -> tuple[bool, list[str] | None]:
    """``(is a self-generated source, its seed prompts or None)`` for a calibration
    source name: ``self`` (no seeds), :data:`SELF_MULTILINGUAL`, :data:`SELF_MIXED`, or
    ``self-mixed-<pct>`` (``pct`` % of the windows seeded, :func:`mixed_prompts`).

    Raises:
        ConfigError: ``self-mixed-<pct>`` with a share outside 1..99 or not a number.
    """
    name = str(source) if source is not None else ""
    if name == "self":
        return True, None
    if name == SELF_MULTILINGUAL:
        return True, seed_prompts()
    if name == SELF_MIXED:
        return True, mixed_prompts()
    if name.startswith(SELF_MIXED + "-"):
        pct = name[len(SELF_MIXED) + 1:]
        if not pct.isdigit():
            raise ConfigError(f"calibration source {name!r}: {pct!r} is not a percentage",
                              "use self-mixed-<pct>, e.g. self-mixed-75 (75 % of windows seeded)")
        return True, mixed_prompts(int(pct))
    return False, None


def _seed_rows(tokenizer, start: int, prompts, nsamples: int, seqlen: int) -> list[list[int]]:
    """Each window's seed: ``[start]`` + the ids of ``prompts[i % len(prompts)]`` (no
    special tokens; an empty prompt leaves ``[start]`` alone), cut to ``seqlen // 2``
    tokens so that the model writes at least half."""
    if not prompts:
        return [[start]] * nsamples
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] if p else [] for p in prompts]
    return [([start] + ids[i % len(ids)])[: max(1, seqlen // 2)] for i in range(nsamples)]


def self_generated(model, tokenizer, *, nsamples: int = 128, seqlen: int = 512, seed: int = 0,
                   temperature: float = 1.0, batch_size: int = 16, prompts=None,
                   progress: bool = False) -> CalibrationSet:
    """Calibration windows sampled from the model itself (``source="self"``, or
    :data:`SELF_MULTILINGUAL` with ``prompts=seed_prompts()``).

    Each window starts from the tokenizer's BOS token (else its EOS token, the usual
    document separator), then the window's seed prompt when ``prompts`` are given
    (``prompts[i % len(prompts)]`` for window ``i``), and continues with tokens drawn from
    the model's own distribution up to ``seqlen`` (plain sampling at ``temperature``, no
    top-k/top-p; end-of-sequence suppressed so every window is full). Seeding with prompts
    in several languages keeps the windows from being mostly English (what an unseeded
    small model mostly writes), which the quantizer would otherwise fit at the other
    languages' cost. The draw is seeded (``seed``) inside a forked RNG, so the caller's
    random state is untouched; rows of a batch are left-padded with their attention mask.

    Args:
        model: the (dense) causal LM to calibrate; run in ``eval`` mode, no gradients.
        tokenizer: its tokenizer.
        nsamples, seqlen: windows and tokens per window.
        seed: sampling seed.
        temperature: sampling temperature (> 0).
        batch_size: sequences generated at once.
        prompts: seed texts (None: every window starts from BOS alone).
        progress: show a progress bar.

    Returns:
        :class:`CalibrationSet` with ``input_ids`` ``int64 [nsamples, seqlen]``.

    Raises:
        ConfigError: bad ``nsamples``/``seqlen``/``temperature``.
        CalibrationError: the tokenizer has neither a BOS nor an EOS token.
    """
    _check_nsamples(nsamples)
    check_seqlen(seqlen, getattr(model.config, "max_position_embeddings", None))
    if not temperature or temperature <= 0:
        raise ConfigError(f"temperature={temperature} must be > 0", "use e.g. 1.0")
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start is None:
        raise CalibrationError("the tokenizer has no BOS or EOS token to start generation from",
                               "calibrate on a text file instead of 'self'")
    eos = tokenizer.eos_token_id
    pad = eos if eos is not None else start
    dev = next(model.parameters()).device
    seeds = _seed_rows(tokenizer, int(start), list(prompts or ()), nsamples, seqlen)
    out = []
    from tqdm.auto import tqdm
    from transformers import LogitsProcessor, LogitsProcessorList

    class _Tick(LogitsProcessor):
        """Advances the progress bar by one generated position per batch (scores unchanged)."""

        def __call__(self, input_ids, scores):
            bar.update(int(input_ids.shape[0]))
            return scores

    was = model.training
    model.eval()
    bar = tqdm(total=sum(seqlen - len(r) for r in seeds), desc="self-calibration", unit="tok",
               disable=not progress, leave=False)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for b0 in range(0, nsamples, batch_size):
                rows = seeds[b0: b0 + batch_size]
                width = max(len(r) for r in rows)
                ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for b, r in enumerate(rows):
                    ids[b, width - len(r):] = torch.tensor(r)
                    mask[b, width - len(r):] = 1
                new = seqlen - min(len(r) for r in rows)
                gen = model.generate(ids.to(dev), attention_mask=mask.to(dev), do_sample=True,
                                     temperature=float(temperature), top_k=0, top_p=1.0,
                                     max_new_tokens=new, min_new_tokens=new, pad_token_id=pad,
                                     suppress_tokens=[eos] if eos is not None else None,
                                     logits_processor=LogitsProcessorList([_Tick()])).cpu()
                for b, r in enumerate(rows):      # drop the row's padding; keep seqlen tokens
                    out.append(gen[b, width - len(r): width - len(r) + seqlen])
    finally:
        bar.close()
        model.train(was)
    input_ids = torch.stack(out, 0).to(torch.long)
    seeded = sum(1 for p in (prompts or ()) if p)
    src = f"self:T={float(temperature):g}" + (
        f",prompts={seeded}" + (f",unseeded={len(prompts) - seeded}" if seeded < len(prompts) else "")
        if prompts else "")
    info = dict(source=src, sha256=hashlib.sha256(
        input_ids.numpy().tobytes()).hexdigest(), seed=seed, nsamples=nsamples, seqlen=seqlen,
        tokens_read=int(input_ids.numel()), windows_available=nsamples,
        tokens_used=int(input_ids.numel()), tail_tokens_unused=0)
    return CalibrationSet(input_ids, info)


def build_calibration(tokenizer, source: str | Path | None = None, *, nsamples: int = 128,
                      seqlen: int = 512, seed: int = 0, model_max_length: int | None = None,
                      model=None, progress: bool = False) -> CalibrationSet:
    """Build ``nsamples`` windows of ``seqlen`` tokens, seeded and reproducible.

    Args:
        tokenizer: a Hugging Face tokenizer (callable returning ``input_ids``).
        source: see the module docstring (None = embedded default, calibration part).
        nsamples: number of windows.
        seqlen: tokens per window (capped at :data:`MAX_SEQLEN`).
        seed: seed of the window draw.
        model_max_length: the model's context length, if smaller than the cap.
        model: the model, needed (only) for ``source="self"`` (:func:`self_generated`).
        progress: show a progress bar while ``source="self"`` generates (tokens).

    Returns:
        :class:`CalibrationSet` with ``input_ids`` ``int64 [nsamples, seqlen]``.

    Raises:
        ConfigError: bad ``nsamples``/``seqlen``.
        CalibrationError: unreadable source, or too little text for the requested windows
            (the message says how many tokens were found and how many are needed).
    """
    is_self, prompts = self_source_prompts(source)
    if is_self:
        if model is None:
            raise CalibrationError(f"calibration source {str(source)!r} samples text from the model",
                                   "pass model= to build_calibration (the CLI does this for --calib self)")
        return self_generated(model, tokenizer, nsamples=nsamples, seqlen=seqlen, seed=seed,
                              prompts=prompts, progress=progress)
    _check_nsamples(nsamples)
    check_seqlen(seqlen, model_max_length)
    docs, desc = load_documents(source, part="calibration")
    need = nsamples * seqlen
    ids = token_stream(tokenizer, docs, max_tokens=need * _OVERSAMPLE)
    nwin = len(ids) // seqlen
    if nwin < nsamples:
        raise CalibrationError(
            f"calibration text {desc} has {len(ids)} tokens, enough for {nwin} windows of {seqlen}; "
            f"{nsamples} windows need {need} tokens",
            "give more text, or lower --nsamples / --seqlen")
    windows = torch.tensor(ids[: nwin * seqlen], dtype=torch.long).view(nwin, seqlen)
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(nwin, generator=g)[:nsamples].sort().values
    text_hash = hashlib.sha256("\n\n".join(docs).encode()).hexdigest()
    info = dict(source=desc, sha256=text_hash, seed=seed, nsamples=nsamples, seqlen=seqlen,
                tokens_read=len(ids), windows_available=nwin, tokens_used=nsamples * seqlen,
                tail_tokens_unused=len(ids) - nwin * seqlen)
    return CalibrationSet(windows[pick].clone(), info)


def describe(info: dict) -> str:
    """One line on a :class:`CalibrationSet`'s ``info``: windows, tokens used, the source,
    and what of the text read was not used (the windows not drawn, and the stream's
    tail, shorter than one window, that no window can hold)."""
    n, L = info.get("nsamples"), info.get("seqlen")
    line = f"calibration: {n} windows x {L} tokens = {n * L:,} tokens from {info.get('source')}"
    avail, tail = info.get("windows_available"), info.get("tail_tokens_unused") or 0
    unused = []
    if avail is not None and avail > n:
        unused.append(f"{avail - n} of {avail} windows not drawn (seed {info.get('seed')})")
    if tail:
        unused.append(f"the last {tail} token{'s' if tail != 1 else ''} read, "
                      f"less than one window, unused")
    return line + (f" ({'; '.join(unused)})" if unused else "")


def with_forward_dtype(info: dict, forward_dtype: str = "float32") -> dict:
    """A copy of a calibration ``info`` that records the calibration forward passes' dtype
    (``compress(..., forward_dtype=)``) when it is not ``"float32"``: float32 runs keep the
    keys, cache entries and provenance they had before the option existed.

    Args:
        info: a :class:`CalibrationSet`'s ``info`` (or any dict describing the data).
        forward_dtype: the dtype's name, e.g. ``"bfloat16"``.
    """
    out = dict(info)
    if forward_dtype != "float32":
        out["forward_dtype"] = forward_dtype
    return out


def get_calibration(tokenizer, source: str | Path | None = None, nsamples: int = 128,
                    seqlen: int = 512, seed: int = 0, **kwargs) -> torch.Tensor:
    """Shortcut for :func:`build_calibration` returning only ``int64 [nsamples, seqlen]``;
    other keyword arguments (``model=`` for ``source="self"``, ``model_max_length=``) pass
    through."""
    return build_calibration(tokenizer, source, nsamples=nsamples, seqlen=seqlen, seed=seed,
                             **kwargs).input_ids


__all__ = ["CalibrationSet", "build_calibration", "describe", "self_generated", "seed_prompts",
           "SELF_MULTILINGUAL", "SELF_MIXED", "SELF_SOURCES", "mixed_prompts", "self_source_prompts", "get_calibration", "default_documents",
           "default_text", "load_documents", "read_text_file", "token_stream", "check_seqlen",
           "MAX_SEQLEN"]
