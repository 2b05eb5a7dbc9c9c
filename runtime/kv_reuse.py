"""What a session's KV buffers keep between calls: prefix reuse, freeing them, forks.

:class:`KVReuse` is a base of :class:`runtime.generation.GenerationLoop` (and so of
``Session``). Prefix reuse (``session.reuse_prefix = True``; batch 1, fused graphs of the
plain :class:`~runtime.session.Session`): after a generation the shared KV buffers still
hold the rows of every token fed (the prompt and the generated tokens but the last one,
which was sampled, never fed). The next generation keeps the rows of the longest common
prefix of those ids and its prompt, and prefills only the rest in one multi-token pass
(``seqlens_k`` / ``total_sequence_length`` say where it starts; GroupQueryAttention's
cache is already in place, so this is bookkeeping). When the buffers are sized per call
and must grow, the kept rows are copied into the new ones. Plain graphs and variant
sessions (LeanK: its own caches; COUNTDOWN: dense prefill, sparse decode, so reused rows
would differ from recomputed ones) recompute the whole prompt. A generation that does not
finish (a stream closed or cancelled early, an error) frees the buffers.

It reads what ``Session.__init__`` sets: ``fused``, ``_caches`` (batch -> the
``SharedKVCache`` kept between calls), ``_lock``, ``_stream_thread``; the generation loop
calls ``_reusable_rows`` / ``_move_prefix`` in its prefill and records ``_kv_prefix``
when a generation ends.
"""

from __future__ import annotations

import copy
import threading
from typing import Optional

import numpy as np

from .kv_cache import SharedKVCache


def common_prefix_length(a, b, limit: Optional[int] = None) -> int:
    """Length of the longest common prefix of the id sequences ``a`` and ``b`` (at most
    ``limit``)."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), max(int(limit), 0))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if len(diff) else n


class KVReuse:
    """Prefix reuse and the ownership of the KV buffers kept between calls (see the module
    docstring)."""

    #: whether batch-1 generations may start from the cached prefix of the previous one
    #: (see the module docstring); ``None``: yes on fused graphs, unless the class is a
    #: registered variant session (``runtime.variants``), which recomputes
    supports_prefix_reuse: Optional[bool] = None
    #: turn prefix reuse on for this session (off by default: outputs then never depend
    #: on an earlier call; on int8-activation int4 graphs a reused prefix rounds like the
    #: decode steps that wrote it, a recomputed one like a prefill)
    reuse_prefix: bool = False
    #: ``(cache, token ids)``: the rows of a finished batch-1 generation that the next
    #: one may keep (``None``: nothing reusable)
    _kv_prefix = None

    def _prefix_reuse_on(self) -> bool:
        """Prefix reuse is asked for (:attr:`reuse_prefix`) and this class and graph allow it."""
        ok = self.supports_prefix_reuse
        if ok is None:
            ok = getattr(type(self), "variant_name", None) is None
        return bool(self.reuse_prefix and ok and self.fused)

    def _reusable_rows(self, prompts, cache: SharedKVCache) -> int:
        """Rows of ``cache`` a batch-1 prefill of ``prompts`` may keep: the longest common
        prefix of the ids they hold and the prompt, less the prompt's last token (its
        logits are needed); 0 when prefix reuse is off or the buffers were reallocated."""
        rec = self._kv_prefix
        if rec is None or len(prompts) != 1 or rec[0] is not cache:
            return 0
        return self.reusable_prefix_length(prompts[0])

    def _move_prefix(self, prompts, old: Optional[SharedKVCache], new: SharedKVCache) -> None:
        """The buffers grew (a longer conversation than the last call's buffers hold):
        copy the rows of the prefix a batch-1 prompt would keep into the new ones (CPU)."""
        rec = self._kv_prefix
        if rec is None or old is None or rec[0] is not old or len(prompts) != 1 \
                or not (old.arrays and new.arrays):
            return
        n = self.reusable_prefix_length(prompts[0])
        if n:
            for a, b in zip(old.arrays, new.arrays):
                b[:, :, :n] = a[:, :, :n]
            self._kv_prefix = (new, rec[1][:n])

    def reusable_prefix_length(self, ids) -> int:
        """Tokens of the prompt ``ids`` whose KV rows the next batch-1 generation on this
        session would keep (prefix reuse: all but the prompt's last token at most; 0 when
        reuse is off or nothing is cached)."""
        rec = self._kv_prefix
        if rec is None or not self._prefix_reuse_on():
            return 0
        return common_prefix_length(rec[1], ids, len(ids) - 1)

    def kv_cache_state(self) -> dict:
        """What this session's KV buffers hold between calls.

        Returns:
            ``{"allocated_bytes": bytes of the preallocated KV buffers kept for the next
            call, "cached_tokens": tokens whose rows a next batch-1 generation may keep
            (prefix reuse; 0 when off or after an unfinished generation)}``.
        """
        rec = self._kv_prefix
        return {"allocated_bytes": int(sum(c.nbytes for c in self._caches.values())),
                "cached_tokens": len(rec[1]) if rec is not None else 0}

    def free_kv_cache(self) -> None:
        """Drop the KV buffers kept between calls and the cached prefix (the next call
        allocates again and prefills its whole prompt). Safe to call at any time from
        the thread that holds the session, or when no call runs."""
        self._kv_prefix = None
        self._caches.clear()

    def fork(self):
        """Another handle on this loaded model for a concurrent generation: the same
        onnxruntime session (its ``Run`` is thread-safe; weights loaded once), tokenizer
        and settings, with its own KV buffers, prefix cache and lock. Generations on the
        fork and on this session run at the same time in two threads. Closing one does
        not close the other; the onnxruntime session is freed when neither uses it.

        Raises:
            GenerationError: the session is closed.
        """
        self._check_open()
        twin = copy.copy(self)
        twin._caches = {}
        twin._lock = threading.Lock()
        twin._stream_thread = None
        twin._kv_prefix = None
        return twin


__all__ = ["KVReuse", "common_prefix_length"]
