"""Prompt-lookup drafts for speculative decoding (numpy only, no torch).

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding",
github.com/apoorvumang/prompt-lookup-decoding; the ``prompt_lookup_num_tokens`` /
``max_matching_ngram_size`` options of Hugging Face ``generate``, llama-cpp-python's
``LlamaPromptLookupDecoding``) drafts the next tokens without a draft model: it finds
the last ``n`` tokens of the sequence earlier in the sequence (prompt and generated
text) and proposes the tokens that followed that earlier occurrence. The target model
then scores the fed token and the whole draft in one forward pass of ``1 + k``
positions (speculative decoding: Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023), and every position's token is
drawn from the model's own distribution there (:meth:`runtime.session.Session.generate`):
a draft token is kept while the draw equals it. Since the draft is deterministic, that
draw-and-compare rule keeps a draft token with probability ``p(d)`` and, on a mismatch,
yields a token distributed as ``p`` restricted to the other tokens, which is exactly the
rejection rule of speculative sampling for a one-hot draft distribution: the output
distribution is the model's, and greedy output is the argmax chain.

It pays where text repeats its context: summaries, extraction, code edits, chat that
quotes the prompt, and the loops small models fall into. Where no n-gram matches, the
step is an ordinary one-token decode step.
"""

from __future__ import annotations

import numpy as np

from .errors import GenerationError

__all__ = ["find_draft", "check_lookup_args"]


def check_lookup_args(prompt_lookup_num_tokens, max_matching_ngram_size) -> tuple[int, int]:
    """Validate the two prompt-lookup options.

    Args:
        prompt_lookup_num_tokens: most draft tokens per verification pass, ``>= 0``
            (``0`` turns prompt lookup off).
        max_matching_ngram_size: longest suffix n-gram searched for, ``>= 1``.

    Returns:
        ``(prompt_lookup_num_tokens, max_matching_ngram_size)`` as ints.

    Raises:
        GenerationError: either is not an integer in its range.
    """
    for name, v, lo, eg in (("prompt_lookup_num_tokens", prompt_lookup_num_tokens, 0, 4),
                            ("max_matching_ngram_size", max_matching_ngram_size, 1, 2)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise GenerationError(f"{name} must be an integer >= {lo}, got {v!r}",
                                  f"pass e.g. {name}={eg}")
    return int(prompt_lookup_num_tokens), int(max_matching_ngram_size)


def find_draft(tokens: np.ndarray, max_ngram_size: int, num_tokens: int) -> np.ndarray:
    """Draft up to ``num_tokens`` continuation tokens by n-gram lookup.

    For ``n = max_ngram_size`` down to 1, the *most recent* earlier occurrence of the
    last ``n`` tokens is searched for (recent context predicts a drifting text better
    than the prompt's first match, which is what Hugging Face takes); the tokens that
    followed it are the draft. Longer n-grams are tried first: a longer match is more
    likely to continue the same way.

    Args:
        tokens: ``[L]`` int token ids of the whole sequence so far (prompt + generated).
        max_ngram_size: longest suffix n-gram to match, ``>= 1``.
        num_tokens: most draft tokens to return, ``>= 0``.

    Returns:
        ``[k]`` int64 draft ids, ``0 <= k <= num_tokens`` (empty when nothing matches).

    Example:
        >>> find_draft(np.array([5, 6, 7, 8, 5, 6]), 2, 3).tolist()
        [7, 8, 5]
    """
    t = np.asarray(tokens, dtype=np.int64).ravel()
    L = t.shape[0]
    if num_tokens <= 0 or L < 2:
        return t[:0]
    for n in range(min(int(max_ngram_size), L - 1), 0, -1):
        # windows starting at 0 .. L-n-1: every earlier occurrence (the suffix itself excluded)
        win = np.lib.stride_tricks.sliding_window_view(t[:L - 1], n)
        hits = np.flatnonzero((win == t[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return t[start:start + int(num_tokens)].copy()
    return t[:0]
