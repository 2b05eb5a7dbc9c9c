"""The generation loop: locking, prefill, decode steps, prompt-lookup verification, results.

:class:`GenerationLoop` is the part of :class:`runtime.session.Session` that runs a
generation once the prompts are checked and encoded (``Session`` derives from it; variant
sessions such as ``runtime.leank.LeanKSession`` override its hooks ``_prefill`` and
``_decode_step``, which see and return the same decode-state dict).

Fused graphs (``GroupQueryAttention``) keep one preallocated KV buffer per layer
(``runtime.kv_cache.SharedKVCache``) bound with IOBinding once per generation, sized to
the whole ``max_length`` when that is small (:data:`FULL_KV_BYTES`) or under
``"sliding_window"``, else to the call's requested length (prompt + ``max_new_tokens``,
rounded up to :data:`KV_CHUNK` tokens; a cached prefix is copied when they grow), reused
by later calls that fit and checked against the memory available
(:func:`runtime.memory.check_memory`); each decode step
only rewrites a few preallocated numpy arrays (the next token, ``seqlens_k``,
``total_sequence_length``) that ONNX Runtime reads in place, and the logits land in a
preallocated ``[B, 1, vocab]`` buffer: no per-step allocation proportional to the context.
A batch is prefilled right-padded with per-row lengths (``seqlens_k``), which is exactly
the per-row ragged cache GQA keeps, so padding is invisible to every row. Plain graphs
use left padding with an attention mask and a growing concatenated cache.

Prefix reuse between calls (``session.reuse_prefix = True``: the KV rows of the common
prefix of the last generation and the next prompt are kept, only the rest is prefilled),
freeing the buffers of unfinished generations, and forks: :mod:`runtime.kv_reuse`.

Prompt-lookup speculative decoding (``generate(..., prompt_lookup_num_tokens=K)``, batch 1,
fused graphs; :mod:`runtime.lookup`): draft tokens found earlier in the sequence are scored
with the fed token in one multi-token pass over the same shared buffers
(:meth:`GenerationLoop._verify`); the rows written past the confirmed drafts are never
attended and are overwritten by the next pass.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import onnxruntime as ort

from . import memory
from .errors import GenerationError
from .kv_cache import ConcatKVCache, SharedKVCache
from .kv_reuse import KVReuse
from .lookup import DraftController, find_draft
from .sampling import Sampler

#: Above this many bytes of kept prefill logits (``B x (longest - shortest + 1) x vocab``
#: floats) a CPU batch is prefilled one row at a time (one 600-token row beside three
#: 1-token rows of SmolLM2 kept 461 MiB of logits).
PREFILL_LOGITS_BYTES = 64 << 20

#: KV buffers are sized in steps of this many tokens (reuse across calls of similar length).
KV_CHUNK = 256
#: Up to this many bytes the KV buffers span the whole ``max_length`` (batch 1 of SmolLM2
#: up to ~2,900 tokens): their untouched pages cost no memory (4 KiB pages, below numpy's
#: 4 MiB huge-page threshold), and one session alternating 256- and 2,048-token buffers
#: decoded ~2 % faster with the long ones (49.5 vs 50.7 tok/s at 1 thread, 64.6 vs 66.4
#: at 2; 12 rounds each, within this machine's noise). Larger caches (long contexts,
#: wide batches) are sized per call: there numpy's huge-page advice makes every touched
#: head slice a 2 MiB page (426 MiB for one row of an 8,192-token export, 22 GB for 64).
FULL_KV_BYTES = 128 << 20


@dataclass
class GenerationResult:
    """Output of :meth:`Session.generate`.

    Attributes:
        texts: generated text per row (prompt excluded).
        token_ids: generated ids per row.
        prompt_tokens: prompt length (tokens) per row, as fed to the model (after the
            ``"sliding_window"`` policy's cut of a prompt longer than ``max_length``).
        ttft_ms: time to first token (prefill + first sampling), milliseconds.
        prefill_tok_s: prompt tokens (all rows) / prefill seconds.
        decode_tok_s: generated tokens after the first (longest row) / seconds from the
            first generated token to the last one kept (a step that produced an
            end-of-sequence token is not counted).
        step_ms: wall time of every decode step, milliseconds (with prompt lookup: per
            generated token, a verification pass's time on the first token it yields and
            ~0 on the drafted tokens it confirmed).
        finish_reasons: ``"eos"``, ``"stop"`` or ``"length"`` per row.
        draft_tokens: prompt-lookup draft tokens scored (0 without prompt lookup).
        accepted_draft_tokens: of those, the ones the model's own choice confirmed.
        cached_tokens: prompt tokens whose KV rows were kept from the previous generation
            (prefix reuse; 0 when the whole prompt was prefilled).
    """

    texts: list
    token_ids: list
    prompt_tokens: list
    ttft_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    step_ms: list = field(default_factory=list)
    finish_reasons: list = field(default_factory=list)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    cached_tokens: int = 0

    @property
    def text(self) -> str:
        """The first row's text."""
        return self.texts[0]



class GenerationLoop(KVReuse):
    """The generation loop of :class:`runtime.session.Session` (a base class it derives from).

    It reads what ``Session.__init__`` sets: ``sess`` (the onnxruntime session), ``kv``
    (``KVSpec``), ``fused``, ``in_place_io``, ``device``, ``max_length``,
    ``export_max_length``, ``context_policy``, ``vocab_size``, ``pad_token_id``,
    ``eos_token_ids``, ``tokenizer``, ``_caches``, ``_lock``, ``_stream_thread`` and
    ``_closed``. Subclass hooks: ``_prefill(prompts, need) -> state`` and
    ``_decode_step(state, feed) -> logits [B, vocab]`` (a variant's own caches live in
    its state dict), ``supports_prompt_lookup``, ``supports_prefix_reuse``.
    """

    #: whether ``generate(prompt_lookup_num_tokens=...)`` may run multi-token passes over
    #: this class's cache (subclasses with their own cache layout or per-step state say no)
    supports_prompt_lookup = True

    # ------------------------------------------------------------- locking
    def _check_open(self) -> None:
        """Raises :class:`GenerationError` once :meth:`close` was called."""
        if self._closed:
            raise GenerationError("the session is closed", "load the folder again")

    def _acquire(self) -> None:
        """Take the session lock: waits for another thread's call, raises when a
        suspended ``stream()`` of this very thread holds it (waiting would never end),
        or when the session was closed meanwhile."""
        if not self._lock.acquire(blocking=self._stream_thread != threading.get_ident()):
            raise GenerationError("a stream() on this session is still open in this thread",
                                  "exhaust it or call its .close() first (or use a second session)")
        if self._closed:
            self._release()
            raise GenerationError("the session is closed", "load the folder again")

    def _release(self) -> None:
        """Let go of the session lock; the last holder after :meth:`close` frees the
        onnxruntime session and the KV buffers (never under a running call)."""
        if self._closed:
            self._free()
        self._lock.release()
        # close() may have set the flag after the check above and found the lock held:
        # look again now that it is free (whoever gets the lock frees; freeing is idempotent)
        if self._closed and self.sess is not None and self._lock.acquire(blocking=False):
            try:
                self._free()
            finally:
                self._lock.release()

    def _free(self) -> None:
        """Drop the onnxruntime session and the KV buffers (idempotent)."""
        self.free_kv_cache()
        self.sess = None

    def _check_not_closed_mid_generation(self) -> None:
        """Every decode step (subclasses' too) stops a generation that close() ended."""
        if self._closed:
            raise GenerationError("the session was closed during generation", "load the folder again")

    # ------------------------------------------------------- argument checks
    def _check_room(self, lens: list[int], max_new_tokens: int) -> int:
        """Tokens a row's cache must hold; raises when that exceeds ``max_length`` under
        the ``"error"`` policy."""
        # the last new token is sampled, never fed back: prompt + max_new_tokens - 1 cached
        need = max(lens) + max_new_tokens - 1
        if need > self.max_length and self.context_policy == "error":
            raise GenerationError(
                f"prompt ({max(lens)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"context max_length={self.max_length}",
                "lower max_new_tokens, shorten the prompt, "
                + (f"load with a larger max_length (up to the export's {self.export_max_length}), "
                   if self.max_length < self.export_max_length else
                   "re-export with a larger `edgeprune export --max-length`, ")
                + "or use context_policy='sliding_window'")
        return need

    def _check_lookup(self, batch: int) -> None:
        """Prompt lookup needs a fused graph of this class (a multi-token pass over the
        shared KV buffers) and one row."""
        if not (self.fused and self.supports_prompt_lookup):
            raise GenerationError(f"prompt lookup needs a fused GroupQueryAttention export "
                                  f"served by runtime.Session; this is a "
                                  f"{'fused' if self.fused else 'plain'} graph served by "
                                  f"{type(self).__name__}",
                                  "pass prompt_lookup_num_tokens=0, or re-export with "
                                  "`edgeprune export --graph fused` (no LeanK / COUNTDOWN)")
        if batch != 1:
            raise GenerationError(f"prompt lookup decodes one row at a time, got a batch of {batch}",
                                  "generate the rows one by one, or pass prompt_lookup_num_tokens=0")

    # ------------------------------------------------------------------ loop
    def _locked(self, prompts, max_new, sampler, stop, streaming, need, lookup=(0, 2)):
        """:meth:`_loop` under the session lock (held across the yields of a stream)."""
        me = threading.get_ident()
        self._acquire()
        finished = False
        gen = self._loop(prompts, max_new, sampler, stop, streaming, need, lookup)
        try:
            if streaming:
                self._stream_thread = me
            for item in gen:
                finished = item[1]
                yield item
        finally:
            gen.close()
            if not finished:        # closed / cancelled early, or failed: its KV rows go
                self.free_kv_cache()
            if streaming:
                self._stream_thread = None
            self._release()

    def _loop(self, prompts, max_new, sampler, stop, streaming, need=None, lookup=(0, 2)):
        """Prefill, then sample / decode up to ``max_new`` tokens per row; yields
        ``(GenerationResult, final)`` after every token when ``streaming``, else once at
        the end. ``lookup``: ``(prompt_lookup_num_tokens, max_matching_ngram_size)``."""
        B = len(prompts)
        # prompt lookup: tokens already chosen (and, but for the last, already cached) by
        # a verification pass, emitted one per step below before the next forward pass
        queued: list[int] = []
        drafted = accepted = 0
        ctrl = DraftController(lookup[0]) if lookup[0] else None
        guess = None          # a gated-off draft's first token, checked against the next choice
        eos = set(self.eos_token_ids)
        gen: list[list[int]] = [[] for _ in range(B)]
        seen = [list(p) for p in prompts]                       # for repetition penalty
        done = [False] * B
        reasons = ["length"] * B
        texts = [""] * B
        step_ms: list[float] = []
        t0 = time.perf_counter()
        try:
            state = self._prefill(prompts, need)
        finally:
            self._kv_prefix = None      # the buffers' rows are this generation's from here on
        logits = state["logits"]
        cached = int(state.get("cached_tokens", 0))
        t_prefill = time.perf_counter() - t0
        ttft = None
        t_dec0 = t_last = None    # decode time: from the first token to the last one kept
        for step in range(max_new):
            ts = time.perf_counter()
            if queued:
                # a confirmed draft needs no forward pass, but a closed session stops here too
                self._check_not_closed_mid_generation()
                nxt = [queued.pop(0)]
            else:
                nxt = sampler(logits, seen if sampler.repetition_penalty != 1.0 else None)
                if guess is not None:
                    ctrl.observe_guess(int(nxt[0]) == guess)
                    guess = None
            for b in range(B):
                if done[b]:
                    continue
                t = int(nxt[b])
                if t in eos:
                    done[b], reasons[b] = True, "eos"
                    continue
                gen[b].append(t)
                seen[b].append(t)
                t_last = time.perf_counter()
                if stop:
                    texts[b] = self.tokenizer.decode(gen[b])
                    if stop:
                        cut = min((texts[b].find(s) for s in stop if s in texts[b]), default=-1)
                        if cut >= 0:
                            texts[b] = texts[b][:cut]
                            done[b], reasons[b] = True, "stop"
            if ttft is None:
                ttft = time.perf_counter() - t0
                t_dec0 = t_last = time.perf_counter()
            if streaming:
                yield self._result(prompts, gen, texts, ttft, t_prefill, (t_dec0, t_last), step_ms,
                                   reasons, drafted, accepted, cached), False
            if all(done) or step == max_new - 1:
                break
            if queued:          # confirmed by the last verification pass: no forward pass
                step_ms.append((time.perf_counter() - ts) * 1e3)
                continue
            feed = np.array([gen[b][-1] if gen[b] else self.pad_token_id for b in range(B)],
                            np.int64)
            draft = None
            if ctrl is not None:
                # at most the tokens still to generate after the fed one, and what the cache holds
                room = min(max_new - step - 2, state["cache"].max_length - int(state["lens"][0]) - 1)
                k = min(ctrl.next_len(), room)
                draft = find_draft(np.asarray(seen[0], np.int64), lookup[1], max(k, 1 if room > 0 else 0))
                if k == 0 and len(draft):         # gated off: remember the guess, step plainly
                    guess, draft = int(draft[0]), draft[:0]
            tf = time.perf_counter()
            if draft is not None and len(draft):
                queued = self._verify(state, int(feed[0]), draft, sampler, seen[0])
                drafted += len(draft)
                accepted += len(queued) - 1
                ctrl.observe_pass(len(draft), len(queued) - 1, time.perf_counter() - tf)
            else:
                logits = self._decode_step(state, feed)
                if ctrl is not None:
                    ctrl.observe_step(time.perf_counter() - tf)
            step_ms.append((time.perf_counter() - ts) * 1e3)
        if not stop:
            texts = [self.tokenizer.decode(g) for g in gen]
        if B == 1 and self._prefix_reuse_on() and isinstance(state.get("cache"), SharedKVCache):
            self._kv_prefix = (state["cache"], state["tokens"][0])
        yield self._result(prompts, gen, texts, ttft, t_prefill, (t_dec0, t_last), step_ms,
                           reasons, drafted, accepted, cached), True

    def _verify(self, st, fed: int, draft: np.ndarray, sampler: Sampler,
                seen: list[int]) -> list[int]:
        """One speculative pass (batch 1, fused graph): the fed token and the ``k`` draft
        tokens go through the graph at once (``1 + k`` positions written to the shared KV
        buffers, ``1 + k`` logits rows kept); the sampler then draws position by position
        (the repetition penalty seeing the tokens before each), keeping draft tokens while
        its draw equals them (Leviathan et al. 2023 with a one-hot draft). The cache stays
        valid up to the fed token and the kept drafts; the rows written past them are
        never attended (``seqlens_k``) and are overwritten by the next pass.

        Args:
            st: the decode state of :meth:`_prefill`.
            fed: the token to feed (the last one generated, not yet cached).
            draft: ``[k]`` int64 draft ids, ``k >= 1``, fitting in the cache.
            sampler: the generation's sampler (its seeded draws are consumed in order).
            seen: the row's ids so far, ``fed`` included (for the repetition penalty).

        Returns:
            The tokens chosen, ``1 <= n <= k + 1``: the first ``n - 1`` are the confirmed
            drafts (cached), the last is the model's own next token (not cached yet).
        """
        self._check_not_closed_mid_generation()
        k = len(draft)
        lens = st["lens"]
        ids = np.concatenate([[fed], draft]).astype(np.int64)[None, :]
        logits = self._run_fused(ids, np.array([lens[0] + k], np.int32), int(lens[0]) + k + 1,
                                 k + 1, st["cache"])[0]
        penalty = sampler.repetition_penalty != 1.0
        chosen: list[int] = []
        for i in range(k + 1):
            t = int(sampler(logits[i:i + 1], [seen + chosen] if penalty else None)[0])
            chosen.append(t)
            if i == k or t != int(draft[i]):
                break
        # cached now: the fed token and the confirmed drafts (all chosen but the last)
        st["tokens"][0].extend([fed] + chosen[:-1])
        lens += len(chosen)
        return chosen

    def _result(self, prompts, gen, texts, ttft, t_prefill, t_dec, step_ms, reasons,
                drafted=0, accepted=0, cached=0):
        """The :class:`GenerationResult` of the tokens so far (timings in seconds in)."""
        # the pass that produced an end-of-sequence token (dropped) is not decode time
        dec_s = t_dec[1] - t_dec[0] if t_dec[0] is not None else 0.0
        n_dec = max(len(g) for g in gen) - 1 if gen else 0
        return GenerationResult(
            texts=list(texts), token_ids=[list(g) for g in gen],
            prompt_tokens=[len(p) for p in prompts], ttft_ms=(ttft or 0.0) * 1e3,
            prefill_tok_s=sum(len(p) for p in prompts) / max(t_prefill, 1e-9),
            decode_tok_s=(n_dec / dec_s) if (dec_s > 0 and n_dec > 0) else 0.0,
            step_ms=list(step_ms), finish_reasons=list(reasons), draft_tokens=drafted,
            accepted_draft_tokens=accepted, cached_tokens=cached)

    # ------------------------------------------------------ prefill / decode
    def _cache(self, B: int, need: Optional[int] = None) -> SharedKVCache:
        """The preallocated KV buffers for batch ``B``: the whole ``max_length`` when that
        takes at most :data:`FULL_KV_BYTES` (or under the sliding-window policy, or when
        ``need`` is unknown), else ``need`` tokens per row (prompt + ``max_new_tokens``)
        rounded up to a multiple of :data:`KV_CHUNK`, capped at ``max_length``. Reused by
        later calls that fit; decode steps never reallocate them.

        Raises:
            GenerationError: the buffers would not fit in the memory available now.
        """
        cap = self.max_length
        full = sum(self.kv.bytes(self.max_length, B).values())
        if need is not None and self.context_policy == "error" and full > FULL_KV_BYTES:
            cap = min(self.max_length, -(-int(need) // KV_CHUNK) * KV_CHUNK)
        c = self._caches.get(B)
        if c is None or c.max_length < cap:
            self._caches.clear()   # keep at most one set of buffers resident
            memory.check_memory(sum(self.kv.bytes(cap, B).values()),
                                f"the KV cache for {B} row(s) x {cap} tokens",
                                "generate fewer rows at once, lower max_new_tokens, or load "
                                "with a smaller max_length")
            c = self._caches[B] = SharedKVCache(self.kv, B, cap, self.device)
        return c

    def _prefill(self, prompts, need: Optional[int] = None) -> dict:
        """Run the prompts (a list of id lists) through the graph (subclass hook).

        Returns:
            The decode state: ``logits`` ``[B, vocab]`` of each row's last position,
            ``cache``, ``lens`` (int64 ``[B]`` cached tokens), ``tokens`` (the cached ids
            per row), plus the preallocated step inputs and the binding on fused graphs.
        """
        B = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int64)
        S = int(lens.max())
        if not self.fused:
            ids = np.full((B, S), self.pad_token_id, np.int64)
            mask = np.zeros((B, S), np.int64)
            for b, p in enumerate(prompts):
                ids[b, S - len(p):] = p
                mask[b, S - len(p):] = 1
            pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
            cache = ConcatKVCache(self.kv, B, self.device)
            logits = self._run_plain(ids, mask, pos, 1, cache)[:, -1]
            return {"logits": logits, "cache": cache, "mask": mask, "pos": pos[:, -1:].copy(),
                    "lens": lens.copy(), "tokens": [list(p) for p in prompts]}
        old = self._caches.get(B)
        cache = self._cache(B, need)
        if cache is not old:
            self._move_prefix(prompts, old, cache)
        start = self._reusable_rows(prompts, cache)
        ids = np.full((B, S), self.pad_token_id, np.int64)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = p
        # rows are right-padded (GroupQueryAttention's prompt layout): the graph keeps the
        # last `keep` positions so that every row's last real token is among them
        keep = int(S - lens.min() + 1)
        kept_bytes = B * keep * self.vocab_size * 4
        if start:
            # prefix reuse (batch 1): rows [0, start) are in the buffers; write the rest
            logits = self._run_fused(ids[:, start:], lens - 1, S, 1, cache)[:, -1]
        elif B > 1 and kept_bytes > PREFILL_LOGITS_BYTES and self.in_place_io:
            # rows of very different lengths: prefill each row alone into its row of the
            # buffers (keeps one position per row, not B x keep x vocab floats)
            logits = np.stack([self._run_fused(ids[b:b + 1, :int(lens[b])], np.array([lens[b] - 1], np.int32),
                                               int(lens[b]), 1, cache.row(b))[0, -1] for b in range(B)])
        else:
            if kept_bytes > PREFILL_LOGITS_BYTES:       # small ones need no /proc read
                memory.check_memory(kept_bytes, f"the prefill logits ({B} row(s) x {keep} positions x "
                                    f"{self.vocab_size} vocab)", "generate prompts of similar length "
                                    "together, or fewer rows at once")
            out = self._run_fused(ids, (lens - 1).astype(np.int32), S, keep, cache)
            idx = (lens - 1) - (S - keep)
            logits = out[np.arange(B), idx]
        # Decode-step state: preallocated inputs read in place by onnxruntime.
        st = {"cache": cache, "lens": lens.copy(), "tokens": [list(p) for p in prompts],
              "cached_tokens": start}
        st["ids"] = np.zeros((B, 1), np.int64)
        st["seqlens"] = np.zeros((B,), np.int32)
        st["total"] = np.zeros((), np.int32)
        st["keep"] = np.ones((), np.int64)
        st["logits_buf"] = np.zeros((B, 1, self.vocab_size), np.float32)
        bd = self.sess.io_binding()
        cache.bind(bd)
        if self.in_place_io:
            for name, arr in (("input_ids", st["ids"]), ("seqlens_k", st["seqlens"]),
                              ("total_sequence_length", st["total"]),
                              ("num_logits_to_keep", st["keep"])):
                bd.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
            bd.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(st["logits_buf"]))
        else:
            bd.bind_output("logits", "cpu")      # bound last: the last output (binding order)
        st["binding"] = bd
        st["logits"] = logits
        return st

    def _overflow(self, st, feed) -> Optional[np.ndarray]:
        """Sliding-window policy: the rows whose cache is full keep their last
        max_length//2 tokens, the others all of theirs (so a row's tokens do not depend on
        its neighbours), and the batch is re-prefilled."""
        keep_n = max(1, self.max_length // 2)
        rows = [(t + [int(f)])[-keep_n:] if len(t) + 1 > self.max_length else t + [int(f)]
                for t, f in zip(st["tokens"], feed)]
        new = self._prefill(rows)
        st.clear()
        st.update(new)
        return new["logits"]

    def _decode_step(self, st, feed: np.ndarray) -> np.ndarray:
        """Feed one token per row (``feed`` int64 ``[B]``) and return the next logits
        ``[B, vocab]``; updates the state ``st`` of :meth:`_prefill` (subclass hook)."""
        self._check_not_closed_mid_generation()
        over = self._check_context(st, feed)
        if over is not None:
            return over
        lens = st["lens"]
        for b, f in enumerate(feed):
            st["tokens"][b].append(int(f))
        if not self.fused:
            mask = np.concatenate([st["mask"], np.ones((len(feed), 1), np.int64)], 1)
            st["mask"] = mask
            st["pos"] = st["pos"] + 1
            lens += 1
            return self._run_plain(feed[:, None], mask, st["pos"], 1, st["cache"])[:, -1]
        st["ids"][:, 0] = feed
        st["seqlens"][:] = lens            # new total per row minus one
        lens += 1
        st["total"][()] = int(lens.max())
        bd = st["binding"]
        if not self.in_place_io:
            bd.bind_cpu_input("input_ids", st["ids"])
            bd.bind_cpu_input("seqlens_k", st["seqlens"])
            bd.bind_cpu_input("total_sequence_length", st["total"])
            bd.bind_cpu_input("num_logits_to_keep", st["keep"])
            self.sess.run_with_iobinding(bd)
            return bd.get_outputs()[-1].numpy()[:, -1]
        _run_bound(self.sess, bd)
        return st["logits_buf"][:, 0]

    def _check_context(self, st, feed) -> Optional[np.ndarray]:
        """Context-overflow policy before a decode step: raises (``"error"``), or
        re-prefills and returns the new logits (``"sliding_window"``); ``None`` when the
        step fits."""
        if int(st["lens"].max()) + 1 > self.max_length:
            if self.context_policy != "sliding_window":
                raise GenerationError(f"the context is full (max_length={self.max_length})",
                                      "use context_policy='sliding_window' or a larger max_length")
            return self._overflow(st, feed)
        return None

    # ------------------------------------------------------------ graph runs
    def _run_fused(self, ids, seqlens_k, total, keep, cache: SharedKVCache) -> np.ndarray:
        """One pass of a fused graph over ``ids`` ``[B, S]``; logits ``[B, keep, vocab]``."""
        bd = self.sess.io_binding()
        bd.bind_cpu_input("input_ids", np.ascontiguousarray(ids))
        bd.bind_cpu_input("seqlens_k", np.ascontiguousarray(seqlens_k, dtype=np.int32))
        bd.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        bd.bind_cpu_input("num_logits_to_keep", np.array(keep, np.int64))
        cache.bind(bd)
        bd.bind_output("logits", "cpu")          # bound last: the last output (binding order)
        self.sess.run_with_iobinding(bd)
        return bd.get_outputs()[-1].numpy()

    def _run_plain(self, ids, mask, pos, keep, cache: ConcatKVCache) -> np.ndarray:
        """One pass of a plain graph (the cache grows by ``S``); logits ``[B, keep, vocab]``."""
        bd = self.sess.io_binding()
        bd.bind_cpu_input("input_ids", np.ascontiguousarray(ids))
        bd.bind_cpu_input("attention_mask", np.ascontiguousarray(mask))
        bd.bind_cpu_input("position_ids", np.ascontiguousarray(pos))
        bd.bind_cpu_input("num_logits_to_keep", np.array(keep, np.int64))
        cache.bind(bd)
        bd.bind_output("logits", "cpu")          # bound last: the last output (binding order)
        self.sess.run_with_iobinding(bd)
        outs = bd.get_outputs()
        cache.update(outs[:-1])
        return outs[-1].numpy()


def _run_bound(sess, bd) -> None:
    """``sess.run_with_iobinding(bd)`` for a binding whose outputs are all preallocated
    CPU buffers (the decode step), without the Python wrapper's per-call WebGPU
    graph-capture bookkeeping (it calls exactly the same bound ``run_with_iobinding``);
    falls back to the public call if onnxruntime's internals differ."""
    try:
        inner, binding = sess._sess, bd._iobinding
    except AttributeError:
        sess.run_with_iobinding(bd)
        return
    inner.run_with_iobinding(binding, None)


__all__ = ["GenerationLoop", "GenerationResult", "FULL_KV_BYTES", "KV_CHUNK", "PREFILL_LOGITS_BYTES"]
