"""Perplexity and fidelity (re-exported from :mod:`edgeprune.evaluation`, their home)."""

from __future__ import annotations

from .evaluation.fidelity import FidelityResult, continuation_prompts, fidelity, snr_db  # noqa: F401
from .evaluation.perplexity import (PerplexityResult, Protocol, eval_windows, perplexity,  # noqa: F401
                                    resolve_text)

__all__ = ["Protocol", "PerplexityResult", "FidelityResult", "perplexity", "fidelity", "eval_windows",
           "resolve_text", "snr_db", "continuation_prompts"]
