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
step is an ordinary one-token decode step. A rejected draft token still costs its share
of the pass (on a CPU the multi-token pass is compute-bound: ~30 % of a one-token step
per extra token at one thread on a Zen 3), so the draft length adapts
(:func:`adapt_draft_len`) and a cost gate measured on the run itself decides whether a
draft is worth a pass at all (:class:`DraftController`).
"""

from __future__ import annotations

import math

import numpy as np

from .errors import GenerationError

__all__ = ["find_draft", "check_lookup_args", "adapt_draft_len", "DraftController"]


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


def adapt_draft_len(current: int, maximum: int, drafted: int, accepted: int) -> int:
    """The draft length for the next pass: two longer after a pass that confirmed its whole
    draft, one shorter (at least 1) after one that did not, never above ``maximum`` (the
    "heuristic" schedule of Hugging Face assisted generation,
    ``num_assistant_tokens_schedule="heuristic"``). Long drafts then run while the text
    repeats and short ones where it drifts, so a large ``maximum`` costs little on text
    that rarely matches.

    Args:
        current: the length the last pass was allowed (``>= 1``).
        maximum: the user's ``prompt_lookup_num_tokens`` (``>= 1``).
        drafted: draft tokens the last pass scored (``>= 1``; a draft may be shorter than
            ``current`` when the match ran out).
        accepted: of those, the confirmed ones.

    Returns:
        The next pass's allowed draft length, in ``[1, maximum]``.
    """
    if accepted >= drafted:
        return min(int(maximum), int(current) + 2)
    return max(1, int(current) - 1)


class DraftController:
    """How many draft tokens the next pass should carry: the :func:`adapt_draft_len`
    schedule, capped by a cost gate from the run's own timings.

    With ``q`` the chance that a draft token is confirmed (each, given the ones before),
    ``t1`` the time of a one-token step and ``c`` the extra time a draft token adds to a
    pass, the ``i``-th draft token saves ``q**i * t1`` on average and costs ``c``, so the
    pass should carry ``k* = floor(log(c / t1) / log(q))`` of them, none when
    ``q <= c / t1``: drafting would slow decoding down. ``t1`` and ``c`` are exponential
    moving averages of the measured forward passes (``c / t1`` starts at 0.3, what a pass
    costs per extra token at one thread on a 2-core Zen 3 at short context; at two it is
    ~0.1). Since a draft can be found at nearly every step, ``t1`` is probed: the first
    step, and one in every :attr:`PROBE_EVERY` tokens, is a plain one-token step. ``q`` is a
    decayed count of confirmed over tried draft tokens, starting at 1/2 and also fed, while
    the gate keeps drafts off, by whether the would-be first draft token was the token
    the model then chose (free to check), so drafting comes back when the text starts to
    repeat; while it is off, one 1-token pass every :attr:`PROBE_EVERY` steps re-measures
    ``c`` (one bad measurement must not keep it off), and a pass whose draft tokens seem to
    cost more than a step each (a pause of the machine) is not taken as a measurement.

    Args:
        maximum: the user's ``prompt_lookup_num_tokens`` (``>= 1``).
    """

    #: c / t1 before both have been measured
    PRIOR_COST_RATIO = 0.3
    #: weight of the newest timing in the moving averages
    ALPHA = 0.2
    #: decay of the confirmation counts per observed draft token (~20-token memory)
    DECAY = 0.95
    #: a plain step (to time ``t1``, which grows with the context) at least this often, in tokens
    PROBE_EVERY = 48

    def __init__(self, maximum: int):
        self.maximum = int(maximum)
        self.scheduled = int(maximum)
        self.hits, self.tries = 1.0, 2.0
        self.t_step: float | None = None      # seconds, one-token step
        self.t_extra: float | None = None     # seconds per draft token in a pass
        self.since_step = 0                   # tokens generated since the last plain step
        self.since_pass = 0                   # plain steps since the last pass

    @property
    def confirm_rate(self) -> float:
        """``q``: the estimated chance that a draft token is confirmed."""
        return self.hits / self.tries

    @property
    def cost_ratio(self) -> float:
        """``c / t1``: a draft token's share of a one-token step."""
        if self.t_step and self.t_extra is not None:
            return max(self.t_extra / self.t_step, 1e-3)
        return self.PRIOR_COST_RATIO

    def next_len(self) -> int:
        """Draft tokens for the next pass, ``0 <= k <= maximum`` (0: a plain step)."""
        if self.t_step is None or self.since_step >= self.PROBE_EVERY:
            return 0
        q, r = self.confirm_rate, self.cost_ratio
        best = 0 if q <= r else self.maximum if q >= 1.0 else int(math.log(r) / math.log(q))
        if best < 1:
            # gated off: still one 1-token pass every PROBE_EVERY steps, or a c measured in a
            # bad moment (a pause of the machine) would keep drafting off for good
            return 1 if self.since_pass >= self.PROBE_EVERY else 0
        return min(self.scheduled, best)

    def _count(self, confirmed: int, tried: int) -> None:
        for i in range(tried):
            self.hits = self.hits * self.DECAY + (1.0 if i < confirmed else 0.0)
            self.tries = self.tries * self.DECAY + 1.0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ALPHA) * old + self.ALPHA * new

    def observe_pass(self, drafted: int, accepted: int, seconds: float) -> None:
        """A verification pass of ``drafted`` tokens confirmed ``accepted`` in ``seconds``."""
        self.scheduled = adapt_draft_len(self.scheduled, self.maximum, drafted, accepted)
        self.since_step += accepted + 1
        self.since_pass = 0
        # tried: the confirmed ones and the first rejected one (the rest says nothing)
        self._count(accepted, min(drafted, accepted + 1))
        if self.t_step:
            # a draft token costs at most a step of its own (k tokens could always be k
            # steps): more is a pause of the machine, not a cost, and is left out
            extra = max(seconds - self.t_step, 0.0) / drafted
            if extra <= self.t_step:
                self.t_extra = self._ema(self.t_extra, extra)

    def observe_step(self, seconds: float) -> None:
        """A one-token step took ``seconds``."""
        self.since_step = 0
        self.since_pass += 1
        if self.t_step is None or seconds < 4 * self.t_step:     # a re-prefill is no step
            self.t_step = self._ema(self.t_step, seconds)

    def observe_guess(self, right: bool) -> None:
        """A draft kept off by the gate would have had its first token ``right``."""
        self._count(1 if right else 0, 1)
