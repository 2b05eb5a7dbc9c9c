"""Next-token selection for the runtime (numpy only, no torch).

The pipeline applied to each row of logits follows the order used by the common
generation libraries (Hugging Face ``generate``, llama.cpp's default chain):

1. repetition penalty (CTRL, Keskar et al. 2019, Eq. 1 as implemented in practice):
   for every token already seen in the row, a positive logit is divided by the
   penalty and a negative one multiplied by it;
2. temperature 0 -> greedy ``argmax`` (steps 3-5 skipped);
3. temperature scaling ``logits / T``;
4. top-k filtering: keep the ``k`` largest logits (Fan et al. 2018);
5. top-p / nucleus filtering: keep the smallest set of most-probable tokens whose
   cumulative probability reaches ``p`` (Holtzman et al. 2020, "The Curious Case of
   Neural Text Degeneration"); the most probable token is always kept;
6. softmax and a categorical draw from a seeded ``numpy.random.Generator``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import numpy as np

from edgeprune_runtime.errors import GenerationError

__all__ = ["Sampler", "apply_repetition_penalty"]

_F32_MAX = float(np.finfo(np.float32).max)


def apply_repetition_penalty(logits: np.ndarray, generated: Sequence[Sequence[int]] | None,
                             penalty: float) -> np.ndarray:
    """Return a copy of ``logits`` with the CTRL repetition penalty applied.

    Args:
        logits: ``[B, V]`` float32 next-token logits.
        generated: per row, the token ids seen so far (prompt and/or generated);
            duplicates count once, ids outside ``[0, V)`` raise.
        penalty: ``> 0``; ``1.0`` is a no-op, ``> 1`` discourages repetition.

    Returns:
        ``[B, V]`` float32: seen tokens' positive logits divided by ``penalty``,
        negative ones multiplied by it (Keskar et al. 2019).

    Raises:
        GenerationError: a token id is out of the vocabulary range.
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if penalty == 1.0 or generated is None:
        return out
    vocab = out.shape[1]
    for row, seen in enumerate(generated):
        if len(seen) == 0:
            continue
        ids = np.unique(np.asarray(seen, dtype=np.int64))
        if ids[0] < 0 or ids[-1] >= vocab:
            raise GenerationError(
                f"token id {int(ids[0] if ids[0] < 0 else ids[-1])} in row {row} is outside the vocabulary [0, {vocab})",
                "pass the ids produced by this model's tokenizer")
        vals = out[row, ids].astype(np.float64)
        new = np.where(vals > 0, vals / penalty, vals * penalty)
        # an extreme penalty (1e-300, 1e300) saturates at float32's range instead of
        # overflowing to inf (then NaN after the softmax's shift)
        out[row, ids] = np.where(np.isfinite(vals), np.clip(new, -_F32_MAX, _F32_MAX), vals)
    return out


class Sampler:
    """Chooses the next token of each sequence from its logits.

    Args:
        temperature: ``>= 0``; ``0`` means greedy ``argmax`` (deterministic).
        top_k: ``>= 0``; ``0`` disables top-k filtering.
        top_p: in ``(0, 1]``; ``1.0`` disables nucleus filtering.
        repetition_penalty: ``> 0``; ``1.0`` disables it (CTRL, Keskar et al. 2019).
        seed: seed of the ``numpy.random.Generator`` used for the draws
            (``None``: fresh OS entropy). Two samplers with the same seed and the
            same inputs draw the same tokens.

    Raises:
        GenerationError: an argument is out of range or not a number.

    Example:
        >>> s = Sampler()                       # greedy
        >>> s(np.array([[0.1, 2.0, -1.0]], np.float32), [[]])
        array([1])
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, seed: int | None = None):
        def _num(name, v):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(float(v)):
                raise GenerationError(f"{name} must be a finite number, got {v!r}",
                                      f"pass a number for {name}")
            return float(v)

        temperature = _num("temperature", temperature)
        top_p = _num("top_p", top_p)
        repetition_penalty = _num("repetition_penalty", repetition_penalty)
        if temperature < 0:
            raise GenerationError(f"temperature must be >= 0, got {temperature}",
                                  "use 0 for greedy decoding or a positive value such as 0.7")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0, got {top_k!r}",
                                  "use 0 to disable top-k, or e.g. 40")
        if not 0.0 < top_p <= 1.0:
            raise GenerationError(f"top_p must be in (0, 1], got {top_p}",
                                  "use 1.0 to disable nucleus sampling, or e.g. 0.9")
        if repetition_penalty <= 0:
            raise GenerationError(f"repetition_penalty must be > 0, got {repetition_penalty}",
                                  "use 1.0 to disable it, or e.g. 1.1")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise GenerationError(f"seed must be a non-negative integer or None, got {seed!r}",
                                  "pass e.g. seed=0")
        self.temperature = temperature
        self.top_k = int(top_k)
        self.top_p = top_p
        self.repetition_penalty = repetition_penalty
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        """True when the choice is a deterministic argmax (temperature 0)."""
        return self.temperature == 0.0

    def __repr__(self) -> str:  # noqa: D105
        return (f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
                f"repetition_penalty={self.repetition_penalty}, seed={self.seed})")

    def probabilities(self, logits: np.ndarray,
                      generated: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """The distribution the sampler draws from, after all filters.

        Args:
            logits: ``[B, V]`` (or ``[V]``) float next-token logits.
            generated: per row, the ids seen so far (for the repetition penalty).

        Returns:
            ``[B, V]`` float64 probabilities (rows sum to 1); for greedy sampling a
            one-hot row at the argmax.
        """
        x = self._prepare(logits, generated)
        if self.greedy:
            p = np.zeros(x.shape, dtype=np.float64)
            p[np.arange(x.shape[0]), np.argmax(x, axis=1)] = 1.0
            return p
        return self._filtered_probs(x)

    def __call__(self, logits: np.ndarray,
                 generated: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """Pick one token per row.

        Args:
            logits: ``[B, V]`` float32 next-token logits (a ``[V]`` vector is taken as B=1).
            generated: ``B`` lists of the token ids seen so far in each row (used by
                the repetition penalty only; ``None`` or empty lists when unused).

        Returns:
            ``[B]`` int64 token ids.

        Raises:
            GenerationError: logits are not 1-D/2-D, contain NaN or +inf, or every logit of a
                row is ``-inf``; ``generated`` has a different number of rows than ``logits``.
        """
        if self.greedy and self.repetition_penalty == 1.0:
            fast = _greedy_fast(logits)
            if fast is not None:
                return fast
        x = self._prepare(logits, generated)
        if self.greedy:
            return np.argmax(x, axis=1).astype(np.int64)
        probs = self._filtered_probs(x)
        # Inverse-CDF draw, one uniform per row (reproducible with the seed).
        u = self._rng.random(probs.shape[0])
        cdf = np.cumsum(probs, axis=1)
        idx = (cdf < (u * cdf[:, -1])[:, None]).sum(axis=1)
        idx = np.minimum(idx, probs.shape[1] - 1)
        # Never land on a zero-probability token through rounding at the boundary.
        bad = probs[np.arange(len(idx)), idx] == 0
        if bad.any():
            idx[bad] = np.argmax(probs[bad], axis=1)
        return idx.astype(np.int64)

    # -- internals -------------------------------------------------------------------------

    def _prepare(self, logits, generated) -> np.ndarray:
        x = np.asarray(logits)
        if x.ndim == 1:
            x = x[None, :]
        if x.ndim != 2 or x.shape[1] == 0:
            raise GenerationError(f"logits must have shape [batch, vocab], got {tuple(np.shape(logits))}",
                                  "pass the last position's logits, e.g. logits[:, -1, :]")
        x = x.astype(np.float32, copy=False)
        if np.isnan(x).any():
            raise GenerationError("logits contain NaN", "check the model export / inputs (overflow in fp16?)")
        if np.isposinf(x).any():
            raise GenerationError("logits contain +inf", "check the model export / inputs (overflow in fp16?)")
        if (x.max(axis=1) == -np.inf).any():
            raise GenerationError("every logit of a row is -inf; nothing can be sampled",
                                  "check masks or logit processors applied before the sampler")
        if generated is not None and len(generated) != x.shape[0]:
            raise GenerationError(f"generated has {len(generated)} rows but logits have {x.shape[0]}",
                                  "pass one list of seen token ids per batch row")
        if self.repetition_penalty != 1.0:
            x = apply_repetition_penalty(x, generated, self.repetition_penalty)
        return x

    def _filtered_probs(self, x: np.ndarray) -> np.ndarray:
        # shift before scaling: (x - max) / T stays <= 0, so a tiny T cannot overflow to
        # inf - inf = NaN (it tends to greedy instead); same distribution otherwise
        x = x.astype(np.float64)
        with np.errstate(over="ignore"):          # -> -inf: probability 0, as meant
            z = (x - x.max(axis=1, keepdims=True)) / self.temperature
        vocab = z.shape[1]
        if 0 < self.top_k < vocab:
            # k-th largest value per row; ties at the threshold are kept (as HF does).
            kth = np.partition(z, vocab - self.top_k, axis=1)[:, vocab - self.top_k][:, None]
            z = np.where(z < kth, -np.inf, z)
        z = z - z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        if self.top_p < 1.0:
            order = np.argsort(-p, axis=1, kind="stable")
            sorted_p = np.take_along_axis(p, order, axis=1)
            # Mass strictly before each token (descending order): keep while it is < top_p,
            # so the kept set is the smallest one whose mass reaches top_p; index 0 is always kept.
            before = np.cumsum(sorted_p, axis=1) - sorted_p
            keep_sorted = before < self.top_p
            keep_sorted[:, 0] = True
            keep = np.zeros_like(keep_sorted)
            np.put_along_axis(keep, order, keep_sorted, axis=1)
            p = np.where(keep, p, 0.0)
            p /= p.sum(axis=1, keepdims=True)
        return p


def _greedy_fast(logits) -> Optional[np.ndarray]:
    """Greedy pick in one pass over the logits (the per-token hot path of decoding).

    ``np.argmax`` returns the first NaN when there is one, and the value it points at is
    NaN, +inf or -inf exactly when :meth:`Sampler._prepare` would raise; so a finite
    value at every argmax proves the row clean. Returns ``None`` (take the checked path,
    which raises the precise error) for anything else, including non-2-D input.
    """
    x = logits if isinstance(logits, np.ndarray) else np.asarray(logits)
    if x.ndim != 2 or x.shape[1] == 0 or x.dtype != np.float32:
        return None
    if x.shape[0] == 1:   # batch 1: two C calls (runs right after the graph, cold caches)
        i = int(x[0].argmax())
        return np.array([i], np.int64) if math.isfinite(float(x[0, i])) else None
    idx = np.argmax(x, axis=1)
    if not np.isfinite(x[np.arange(x.shape[0]), idx]).all():
        return None
    return idx.astype(np.int64)

