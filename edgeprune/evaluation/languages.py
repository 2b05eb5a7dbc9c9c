"""Per-language perplexity on parallel text (the same sentences in every language, so
languages compare fairly), and its relative change against the dense model.

The input is one text file per language, line ``i`` of every file the same sentence
(NTREX-128's layout: ``newstest2019-src.eng.txt``, ``newstest2019-ref.deu.txt``...). A
file's language code is the last dot-separated part of its name before ``.txt``
(``deu``, ``zho-CN``); the reference language is English (``eng`` / ``en``, else the file
whose name holds ``-src.``, else the first). Every file must have the reference's line
count: a file that does not is not parallel, and is refused naming both counts.

Each language's text is its first ``lines`` lines joined by ``\\n`` and scored under the
perplexity protocol (:mod:`~edgeprune.evaluation.perplexity`: no BOS, windows of
``seqlen`` tokens, a trailing partial window dropped). Token counts differ between
languages (a tokenizer built for English splits Arabic finer), so perplexities of
different languages are not comparable with each other; the relative change of one
language between a compressed model and its dense one is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import CalibrationError, ConfigError

#: Names of the language codes of NTREX-128 and common ISO 639 codes.
LANGUAGE_NAMES = {"eng": "English", "en": "English", "deu": "German", "de": "German", "fra": "French",
                  "fr": "French", "spa": "Spanish", "es": "Spanish", "zho-CN": "Chinese", "zh": "Chinese",
                  "rus": "Russian", "ru": "Russian", "arb": "Arabic", "ar": "Arabic", "hin": "Hindi",
                  "hi": "Hindi", "tha": "Thai", "th": "Thai"}
_ENGLISH = ("eng", "en")


@dataclass
class LanguageText:
    """One language of a parallel set: ``code`` (from the file name), ``name``, ``path``
    and its ``lines`` (UTF-8, universal newlines, the trailing empty line dropped)."""

    code: str
    name: str
    path: Path
    lines: list

    def text(self, lines: Optional[int] = None) -> str:
        """The first ``lines`` lines (all when None) joined by newlines."""
        return "\n".join(self.lines[:lines] if lines else self.lines)


def language_code(path: Path) -> str:
    """``newstest2019-ref.zho-CN.txt`` -> ``zho-CN``; ``de.txt`` -> ``de``."""
    stem = path.name[: -len(path.suffix)] if path.suffix else path.name
    return stem.rsplit(".", 1)[-1]


def _read_lines(path: Path) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:     # universal newlines: CRLF read as LF
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"cannot read language file {path}: {e}", "pass UTF-8 text files") from None
    return lines[:-1] if lines and lines[-1] == "" else lines


def _files(spec) -> list[Path]:
    items = spec.split(",") if isinstance(spec, str) else [str(s) for s in spec]
    files: list[Path] = []
    for it in (i.strip() for i in items):
        if not it:
            continue
        p = Path(it).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix == ".txt")
            if not found:
                raise CalibrationError(f"--langs folder {p} holds no .txt file",
                                       "pass a folder of parallel .txt files (one per language) or the files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise CalibrationError(f"language file {p} does not exist", "check the --langs path")
    if not files:
        raise ConfigError("--langs names no file", "pass a folder of parallel .txt files or comma-separated files")
    return files


def load_languages(spec, only: Optional[list[str]] = None) -> list[LanguageText]:
    """Read a parallel set and check it is parallel.

    Args:
        spec: a folder of ``.txt`` files, comma-separated files, or a list of paths.
        only: language codes to keep (None: all), in the order given.

    Returns:
        The languages, the reference (English) first.

    Raises:
        CalibrationError: a missing or unreadable file; a file whose line count differs
            from the reference's; two files of one language code.
        ConfigError: nothing given; an unknown code in ``only``.
    """
    langs: list[LanguageText] = []
    for f in _files(spec):
        code = language_code(f)
        if any(lt.code == code for lt in langs):
            raise CalibrationError(f"two language files for {code!r} ({f})", "pass one file per language")
        langs.append(LanguageText(code, LANGUAGE_NAMES.get(code, code), f, _read_lines(f)))
    ref = next((lt for lt in langs if lt.code in _ENGLISH), None) or \
        next((lt for lt in langs if "-src." in lt.path.name), langs[0])
    langs = [ref] + [lt for lt in langs if lt is not ref]
    for lt in langs[1:]:
        if len(lt.lines) != len(ref.lines):
            raise CalibrationError(
                f"language file {lt.path} has {len(lt.lines)} lines but {ref.path.name} ({ref.name}) has "
                f"{len(ref.lines)}: the files are not parallel (line i must be the same sentence in every language)",
                "use the files of one parallel set (e.g. NTREX-128), or fix the file's line breaks")
    if only:
        by_code = {lt.code: lt for lt in langs}
        unknown = [c for c in only if c not in by_code]
        if unknown:
            raise ConfigError(f"no language file for {', '.join(unknown)}",
                              f"use codes from: {', '.join(by_code)}")
        langs = [by_code[c] for c in only]
    return langs


@dataclass
class LanguageResult:
    """One language's perplexity (``ppl``, ``nll`` nats/token) with its protocol, and its
    relative change against the dense model (``(ppl - ppl_dense) / ppl_dense``) when known."""

    code: str
    name: str
    ppl: float
    nll: float
    protocol: dict
    ppl_dense: Optional[float] = None
    rel_change: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def language_perplexity(model, tokenizer, languages: list[LanguageText], *, lines: Optional[int] = 200,
                        seqlen: int = 512, dense: Optional[dict] = None,
                        progress: bool = True) -> dict[str, LanguageResult]:
    """Perplexity of ``model`` on each language's first ``lines`` lines.

    Args:
        model: torch causal LM, export :class:`~edgeprune.evaluation.backends.RuntimeModel`
            or logits callable.
        tokenizer: its tokenizer.
        languages: from :func:`load_languages`.
        lines: first lines of each file (None: all).
        seqlen: window length in tokens.
        dense: ``{code: ppl}`` of the dense model, for the relative change.
        progress: progress bars.

    Returns:
        ``{code: LanguageResult}`` in the order of ``languages``.

    Raises:
        CalibrationError: a language's text is shorter than one window.
        ConfigError: ``lines`` below 1.
    """
    from .perplexity import perplexity

    if lines is not None and lines < 1:
        raise ConfigError(f"lines={lines} must be positive or None (all)", "pass e.g. --lang-lines 200")
    out: dict[str, LanguageResult] = {}
    for lt in languages:
        try:
            r = perplexity(model, tokenizer, lt.text(lines), seqlen=seqlen, nwindows=None, progress=progress)
        except CalibrationError as e:
            raise CalibrationError(f"{lt.name} ({lt.path.name}): {e.message}",
                                   "score more lines (--lang-lines) or shorter windows (--lang-seqlen)") from None
        proto = r.protocol.to_dict()
        proto["text_source"] = f"{lt.path} (first {lines} lines)" if lines else str(lt.path)
        base = (dense or {}).get(lt.code)
        out[lt.code] = LanguageResult(lt.code, lt.name, r.ppl, r.nll, proto, base,
                                      (r.ppl - base) / base if base else None)
    return out


__all__ = ["LanguageText", "LanguageResult", "LANGUAGE_NAMES", "load_languages", "language_code",
           "language_perplexity"]
