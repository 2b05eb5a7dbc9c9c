"""Running a LeanK export: key caches that hold only the kept key channels (LeanK, EMNLP 2025).

:class:`LeanKSession` is a :class:`runtime.session.Session` for folders whose
``edgeprune.json`` has a ``leank`` entry (``runtime.load`` picks it automatically). Its
caches follow the graph (see ``exporters.leank``): per layer a pruned middle key cache
``[B, 1, T_mid, W_i]`` (kept channels of all KV heads concatenated), a middle value cache
of the heads that keep channels, and full-key sink + window caches. Every step feeds the
previous step's ``present*`` OrtValues back as ``past*`` (no copy through numpy); the
graph itself moves tokens leaving the window into the pruned middle.

Rows of a batch must have the same prompt length (positions are derived in the graph).
:meth:`LeanKSession.kv_cache_bytes` reports K and V bytes separately for the pruned
middle, the full sink/window part, and the dense equivalent.

Torch-free.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import onnxruntime as ort

from .errors import GenerationError, RuntimeLoadError
from .session import Session
from .variants import register_session, variant_records


@register_session("leank")
class LeanKSession(Session):
    """A loaded LeanK export folder (see module docstring); same API as ``Session``."""

    supports_prompt_lookup = False   # own cache layout / per-step statistics

    def __init__(self, folder, **session_kw):
        """``session_kw``: as :class:`runtime.session.Session` (device, threads, max_length, ...)."""
        super().__init__(folder, **session_kw)
        lk = variant_records(self.meta).get("leank")
        if not isinstance(lk, dict) or "keep" not in lk:
            raise RuntimeLoadError(f"{self.folder} has no LeanK metadata",
                                   "load it with runtime.load (plain Session)")
        self.leank = lk
        self.sink, self.window = int(lk["sink"]), int(lk["window"])
        shapes = {i.name: i.shape for i in self.sess.get_inputs()}
        self.num_layers = int(self.meta["num_layers"])
        self.kv_heads = int(self.meta["num_kv_heads"])
        self.head_dim = int(self.meta["head_dim"])
        self.key_widths = [int(shapes[f"past_key_values.{i}.key"][3]) for i in range(self.num_layers)]
        self.alive_heads = [int(shapes[f"past_key_values.{i}.value"][1])
                            for i in range(self.num_layers)]
        types = {i.name: i.type for i in self.sess.get_inputs()}
        self.cache_dtype = np.float16 if types["past_full.0.key"] == "tensor(float16)" else np.float32

    # ------------------------------------------------------------------ bytes
    def split_lengths(self, length: int) -> tuple[int, int]:
        """``(full, middle)`` tokens held for a context of ``length`` tokens."""
        length = int(length)
        ns = min(self.sink, length)
        nr = min(self.window, length - ns)
        return ns + nr, length - ns - nr

    def kv_cache_bytes(self, length: int, batch: int = 1) -> dict:
        """K and V cache bytes for ``length`` cached tokens, from the graph's cache shapes.

        Returns:
            ``{"k", "v"}`` (everything held) plus ``k_middle`` / ``v_middle`` (the pruned
            middle), ``k_full`` / ``v_full`` (sink + window, full keys), ``k_dense`` /
            ``v_dense`` (an unpruned cache of the same length), ``k_middle_dense`` and
            ``k_middle_fraction`` (pruned middle K bytes / dense K bytes of the same
            tokens), ``v_middle_fraction``, ``full_tokens`` and ``middle_tokens``.
        """
        it = np.dtype(self.cache_dtype).itemsize
        full, mid = self.split_lengths(length)
        b = int(batch) * it
        kd = self.num_layers * self.kv_heads * self.head_dim * b
        k_mid = sum(self.key_widths) * mid * b
        v_mid = sum(self.alive_heads) * self.head_dim * mid * b
        k_full = v_full = full * kd
        out = {"k": k_mid + k_full, "v": v_mid + v_full, "k_middle": k_mid, "v_middle": v_mid,
               "k_full": k_full, "v_full": v_full, "k_dense": int(length) * kd,
               "v_dense": int(length) * kd, "k_middle_dense": mid * kd,
               "k_middle_fraction": (sum(self.key_widths) /
                                     (self.num_layers * self.kv_heads * self.head_dim)),
               "v_middle_fraction": sum(self.alive_heads) / (self.num_layers * self.kv_heads),
               "full_tokens": full, "middle_tokens": mid}
        return {k: (int(v) if not isinstance(v, float) else v) for k, v in out.items()}

    # ------------------------------------------------------------------ caches
    def empty_caches(self, batch: int) -> dict:
        """Zero-length caches for ``batch`` rows: ``{input name: OrtValue}``."""
        dt, D = self.cache_dtype, self.head_dim
        c = {}
        for i in range(self.num_layers):
            shapes = {f"past_key_values.{i}.key": (batch, 1, 0, self.key_widths[i]),
                      f"past_key_values.{i}.value": (batch, self.alive_heads[i], 0, D),
                      f"past_full.{i}.key": (batch, self.kv_heads, 0, D),
                      f"past_full.{i}.value": (batch, self.kv_heads, 0, D)}
            for n, s in shapes.items():
                c[n] = ort.OrtValue.ortvalue_from_numpy(np.zeros(s, dt), self.device, 0)
        return c

    def synthetic_caches(self, length: int, batch: int = 1, seed: int = 0) -> dict:
        """Random caches holding ``length`` tokens (for decode-speed measurements)."""
        rng = np.random.default_rng(seed)
        full, mid = self.split_lengths(length)
        dt, D = self.cache_dtype, self.head_dim
        c = {}
        for i in range(self.num_layers):
            shapes = {f"past_key_values.{i}.key": (batch, 1, mid, self.key_widths[i]),
                      f"past_key_values.{i}.value": (batch, self.alive_heads[i], mid, D),
                      f"past_full.{i}.key": (batch, self.kv_heads, full, D),
                      f"past_full.{i}.value": (batch, self.kv_heads, full, D)}
            for n, s in shapes.items():
                c[n] = ort.OrtValue.ortvalue_from_numpy(
                    rng.standard_normal(s).astype(dt), self.device, 0)
        return c

    def _run(self, ids: np.ndarray, keep: int, caches: dict) -> np.ndarray:
        bd = self.sess.io_binding()
        bd.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64))
        bd.bind_cpu_input("num_logits_to_keep", np.array(keep, np.int64))
        for n, v in caches.items():
            bd.bind_ortvalue_input(n, v)
        for n in self.output_names:
            bd.bind_output(n, self.device if n != "logits" else "cpu")
        self.sess.run_with_iobinding(bd)
        outs = dict(zip(self.output_names, bd.get_outputs()))
        for i in range(self.num_layers):
            caches[f"past_key_values.{i}.key"] = outs[f"present.{i}.key"]
            caches[f"past_key_values.{i}.value"] = outs[f"present.{i}.value"]
            caches[f"past_full.{i}.key"] = outs[f"present_full.{i}.key"]
            caches[f"past_full.{i}.value"] = outs[f"present_full.{i}.value"]
        return outs["logits"].numpy()

    # ------------------------------------------------------------------ API
    def logits(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None,
               chunk: Optional[int] = None) -> np.ndarray:
        """Logits of every position ``float32 [B, S, vocab]`` (rows unpadded).

        Args:
            chunk: prefill in chunks of this many tokens (same result; bounds memory).

        Raises:
            GenerationError: padding in ``attention_mask``, or ``S > max_length``.
        """
        self._check_open()
        ids, mask = self._logits_inputs(input_ids, attention_mask)
        B, S = ids.shape
        if not np.all(mask == 1):
            raise GenerationError("LeanK sessions need unpadded rows of equal length",
                                  "run rows of different lengths one by one")
        self._acquire()
        try:
            caches = self.empty_caches(B)
            step = int(chunk or S)
            outs = []
            for a in range(0, S, step):
                part = ids[:, a:a + step]
                outs.append(self._run(part, part.shape[1], caches))
            return np.concatenate(outs, axis=1)
        finally:
            self._release()

    def _prefill(self, prompts, need=None) -> dict:
        lens = {len(p) for p in prompts}
        if len(lens) != 1:
            raise GenerationError("LeanK sessions need prompts of equal length in a batch",
                                  "generate the prompts one by one")
        B = len(prompts)
        caches = self.empty_caches(B)
        logits = self._run(np.array(prompts, np.int64), 1, caches)[:, -1]
        return {"logits": logits, "caches": caches,
                "lens": np.array([len(p) for p in prompts], np.int64),
                "tokens": [list(p) for p in prompts]}

    def _decode_step(self, st, feed: np.ndarray) -> np.ndarray:
        self._check_not_closed_mid_generation()
        over = self._check_context(st, feed)
        if over is not None:
            return over
        for b, f in enumerate(feed):
            st["tokens"][b].append(int(f))
        st["lens"] += 1
        return self._run(np.asarray(feed, np.int64)[:, None], 1, st["caches"])[:, -1]

    def decode_speed(self, context: int = 2048, steps: int = 16, warmup: int = 2,
                     seed: int = 0) -> dict:
        """Decode tokens/s with ``context`` cached tokens (random cache contents: the work
        per step does not depend on them). Returns ``{"tok_s", "step_ms" (median)}``."""
        caches = self.synthetic_caches(context - 1, 1, seed)
        ids = np.array([[1]], np.int64)
        times = []
        self._acquire()
        try:
            for s in range(warmup + steps):
                c = dict(caches)          # restart from the same length each step
                t0 = time.perf_counter()
                self._run(ids, 1, c)
                if s >= warmup:
                    times.append(time.perf_counter() - t0)
        finally:
            self._release()
        med = float(np.median(times))
        return {"tok_s": 1.0 / med, "step_ms": med * 1e3, "steps": steps, "context": context}


__all__ = ["LeanKSession"]
