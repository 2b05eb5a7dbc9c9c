"""Perplexity under one fixed, recorded protocol.

Protocol (the one the GPTQ/SparseGPT/Wanda papers use for WikiText-2, and the one the
pruning-vs-quantization study reports):

1. text -> token ids with the model's tokenizer, **no BOS** (``add_special_tokens=False``);
   text files are read as UTF-8 with universal newlines (CRLF -> LF);
2. consecutive, non-overlapping windows of ``seqlen`` tokens (a trailing partial window
   is dropped);
3. the first ``nwindows`` windows (all of them when ``nwindows=None``);
4. ``ppl = exp(mean over windows and positions of -log p(x_{t+1} | x_{<=t}))``; each
   window contributes ``seqlen - 1`` predictions, with no context carried across windows.

Defaults: ``seqlen=512``, ``nwindows=40``. Perplexities at different ``seqlen`` are not
comparable, so every result carries its :class:`Protocol` (text source and SHA-256 of
the text, tokenizer, ``seqlen``, windows, tokens scored).

Fidelity to the dense model on the same windows: :mod:`edgeprune.evaluation.fidelity`.

``model`` may be a torch causal LM or any callable ``fn(input_ids int64 [1, S]) ->
logits [1, S, V]`` (torch tensor or numpy array), so exported ONNX models and filtered
variants (COUNTDOWN, LeanK) are scored by exactly the same code.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..calibration import default_text, read_text_file
from ..errors import CalibrationError, ConfigError, EvaluationError


class Record:
    """Base of the evaluation result dataclasses: ``to_dict()`` is their JSON form
    (``dataclasses.asdict``, nested records and dicts included)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Protocol(Record):
    """How a perplexity was computed; results under different protocols are not comparable."""

    text_source: str
    text_sha256: str
    tokenizer: str
    seqlen: int
    nwindows: int
    ntokens_scored: int
    bos: bool = False


@dataclass
class PerplexityResult(Record):
    """``ppl`` (exp of mean NLL), ``nll`` (nats/token) and the :class:`Protocol`."""

    ppl: float
    nll: float
    protocol: Protocol


def _exists(text) -> bool:
    """``text`` names an existing file or folder."""
    try:
        return Path(text).expanduser().exists()
    except (OSError, ValueError):  # too long / NUL byte: a literal text, not a path
        return False


def resolve_text(text: str | Path | None) -> tuple[str, str]:
    """Return ``(text, description)`` for a file path, a literal string or None (default held-out).

    Files: plain UTF-8 text, ``.jsonl`` (one ``{"text": ...}`` per line) or ``.parquet``
    (a ``text`` column), documents joined by a blank line, as for calibration.

    Raises:
        CalibrationError: a path-like string that does not exist (short, one line, and
            with a ``/``, a text-file extension, or one word with an extension such as
            ``notes.md``), a folder, or an unreadable file.
    """
    if text is None or str(text) == "default":
        return default_text("heldout"), "default:pydoc_data.topics[heldout]"
    if isinstance(text, Path) or _exists(text):
        p = Path(text).expanduser()
        if p.is_dir():
            raise CalibrationError(f"evaluation text {p} is a folder", "pass a text, JSONL or Parquet file")
        if not p.is_file():
            raise CalibrationError(f"evaluation text file {p} does not exist", "check the path")
        if p.suffix.lower() in (".jsonl", ".parquet"):
            from ..calibration import load_documents
            return "\n\n".join(load_documents(p)[0]), str(p)   # no empty documents
        return read_text_file(p), str(p)
    t = str(text)
    if len(t) < 512 and "\n" not in t and (
            "/" in t or os.sep in t or t.lower().endswith((".txt", ".raw", ".jsonl", ".parquet"))
            or (not any(c.isspace() for c in t) and Path(t).suffix[1:].isalnum())):
        raise CalibrationError(f"evaluation text file {t} does not exist",
                               "check the path; a literal text to score must not look like one")
    return t, "literal string"


def _tokenizer_name(tokenizer) -> str:
    """``"NAME (vocab N, sha256 XXXX)"``: the hash of the tokenizer's own definition, so one
    tokenizer reads the same from a model folder and from its export folder (the names
    differ: a path, or a class name)."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    digest = ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest = ", sha256 " + hashlib.sha256(backend.to_str().encode()).hexdigest()[:12]
    return f"{name} (vocab {len(tokenizer)}{digest})" if hasattr(tokenizer, "__len__") else str(name)


def eval_windows(tokenizer, text: str | Path | None = None, *, seqlen: int = 512,
                 nwindows: int | None = 40) -> tuple[torch.Tensor, Protocol]:
    """Tokenize ``text`` and cut the protocol's windows.

    Returns:
        ``(windows int64 [n, seqlen], protocol)``.

    Raises:
        ConfigError: ``seqlen < 2`` or ``nwindows < 1``.
        CalibrationError: the text is too short for one window, or for ``nwindows``.
    """
    if seqlen < 2:
        raise ConfigError(f"seqlen={seqlen} must be at least 2", "use e.g. --seqlen 512")
    if nwindows is not None and nwindows < 1:
        raise ConfigError(f"nwindows={nwindows} must be positive or None (all)", "use e.g. --nwindows 40")
    body, desc = resolve_text(text)
    ids = tokenizer(body, add_special_tokens=False)["input_ids"]
    avail = len(ids) // seqlen
    if avail == 0 or (nwindows is not None and avail < nwindows):
        raise CalibrationError(
            f"evaluation text {desc} has {len(ids)} tokens: {avail} windows of {seqlen}, "
            f"{nwindows or 1} needed", "use a longer text, or lower --nwindows / --seqlen")
    n = avail if nwindows is None else nwindows
    windows = torch.tensor(ids[: n * seqlen], dtype=torch.long).view(n, seqlen)
    proto = Protocol(text_source=desc, text_sha256=hashlib.sha256(body.encode()).hexdigest(),
                     tokenizer=_tokenizer_name(tokenizer), seqlen=seqlen, nwindows=n,
                     ntokens_scored=n * (seqlen - 1))
    return windows, proto


LogitsFn = Callable[[torch.Tensor], Any]


def _logits_fn(model) -> LogitsFn:
    if isinstance(model, torch.nn.Module):
        device = next(model.parameters()).device

        def fn(ids):
            return model(ids.to(device), use_cache=False).logits

        return fn
    if callable(model):
        return model
    raise ConfigError(f"cannot evaluate a {type(model).__name__}", "pass a torch model or a logits function")


def _as_tensor(x) -> torch.Tensor:
    return (x if isinstance(x, torch.Tensor) else torch.from_numpy(x)).float().cpu()


def _check_context(seqlen: int, *models) -> None:
    """Refuse windows longer than a torch model's trained context: positions past
    ``max_position_embeddings`` are untrained, and their perplexity would mislead."""
    for m in models:
        ctx = getattr(getattr(m, "config", None), "max_position_embeddings", None)
        if isinstance(ctx, int) and isinstance(seqlen, int) and seqlen > ctx:
            raise ConfigError(f"seqlen={seqlen} exceeds the model's context "
                              f"(max_position_embeddings={ctx})", f"use --seqlen {ctx} or less")


@torch.no_grad()
def perplexity(model, tokenizer, text: str | Path | None = None, *, seqlen: int = 512,
               nwindows: int | None = 40, progress: bool = True) -> PerplexityResult:
    """Perplexity of ``model`` on ``text`` under the module's protocol.

    Args:
        model: torch causal LM, or callable ``ids [1, S] -> logits [1, S, V]``.
        tokenizer: Hugging Face tokenizer.
        text: file path, literal text, or None for the embedded held-out default text.
        seqlen: window length in tokens.
        nwindows: first windows to score (None = all).
        progress: show a progress bar.

    Returns:
        :class:`PerplexityResult`.

    Raises:
        ConfigError, CalibrationError: see :func:`eval_windows`; ``seqlen`` above a torch
            model's ``max_position_embeddings``.
    """
    _check_context(seqlen, model)
    windows, proto = eval_windows(tokenizer, text, seqlen=seqlen, nwindows=nwindows)
    fn = _logits_fn(model)
    total = 0.0
    for w in tqdm(windows, desc="perplexity", unit="win", disable=not progress, leave=False):
        logits = _as_tensor(fn(w[None]))[0, :-1]
        total += F.cross_entropy(logits, w[1:], reduction="sum").item()
    nll = total / proto.ntokens_scored
    return PerplexityResult(ppl=_exp_nll(nll), nll=nll, protocol=proto)


def _exp_nll(nll: float) -> float:
    """``exp(nll)``: ``inf`` past float range (no OverflowError losing the other figures).

    Raises:
        EvaluationError: ``nll`` is NaN (the model's logits hold NaN).
    """
    if math.isnan(nll):
        raise EvaluationError("the model's logits hold NaN: its perplexity is undefined",
                              "check the model (a failed compression or export); re-run it")
    return math.exp(nll) if nll < 709.0 else math.inf


__all__ = ["Protocol", "PerplexityResult", "perplexity", "eval_windows", "resolve_text"]
