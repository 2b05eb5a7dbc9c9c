"""Running IG-Pruning exports: route each prompt once, decode the generation with its mask.

An IG-Pruning export (``exporters.igprune``; IG-Pruning: Qiao, Zhang, Feng, EMNLP 2025)
is a plain graph with an ``igprune_mask bool [2L]`` input (sub-block ``2i``: layer ``i``'s
attention, ``2i + 1``: its MLP; ``False`` bypasses it). :class:`IgPruneSession` feeds it
on every pass. Before a generation's prefill it routes each prompt:

1. the router pass: the prompt's first ``route_tokens`` tokens through the same graph with
   the mask that keeps only the first ``embed_layer`` layers (the rest bypassed), read
   ``igprune_embedding float32 [1, H]`` (the mean residual stream after those layers);
2. ``z = (e - center) / scale``, scaled to unit length; the nearest centroid (L2, ties:
   the lower index) names the mask (``edgeprune.igprune.router``, same arithmetic).

The router pass runs inside the prefill, so its cost is part of the time to first token
and of every latency the generation reports (``last_route["router_ms"]`` holds it alone).
The whole generation then decodes with that mask; rows of one batch must route to the
same mask. A bypassed attention layer's cache stays ``[B, KV, 0, D]`` (caches start empty
and the graph passes the past through): it writes and holds no KV bytes
(:meth:`IgPruneSession.kv_cache_bytes`).

Torch-free (onnxruntime + numpy).
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import numpy as np

from .errors import GenerationError, RuntimeLoadError
from .session import Session
from .variants import register_session, variant_records

MASK_INPUT = "igprune_mask"
EMBEDDING_OUTPUT = "igprune_embedding"


class _MaskFeed:
    """The onnxruntime session with the current mask bound on every run (``io_binding``
    and ``run``); every other attribute is the session's own."""

    def __init__(self, sess, owner: "IgPruneSession"):
        self._sess, self._owner = sess, owner

    def io_binding(self):
        bd = self._sess.io_binding()
        bd.bind_cpu_input(MASK_INPUT, self._owner.current_mask.copy())
        return bd

    def run(self, output_names, feeds, *args, **kw):
        feeds = dict(feeds)
        feeds.setdefault(MASK_INPUT, self._owner.current_mask.copy())
        return self._sess.run(output_names, feeds, *args, **kw)

    def __getattr__(self, name):
        return getattr(self._sess, name)


@register_session("igprune")
class IgPruneSession(Session):
    """A :class:`runtime.session.Session` over an IG-Pruning export.

    Attributes:
        masks: ``bool [K, 2L]`` the export's masks.
        current_mask: ``bool [2L]`` the mask of the last (or running) generation.
        last_route: ``{"mask", "cluster", "router_ms", "routed"}`` of the last generation
            or :meth:`logits` call.

    Raises:
        RuntimeLoadError: the folder is not an IG-Pruning export.
    """

    supports_prompt_lookup = False

    def __init__(self, folder, **session_kw):
        """``session_kw``: as :class:`runtime.session.Session` (device, threads, max_length, ...)."""
        super().__init__(folder, **session_kw)
        rec = variant_records(self.meta).get("igprune")
        if not rec or self.fused:
            raise RuntimeLoadError(f"{self.folder} is not an IG-Pruning export",
                                   "export one with `edgeprune igprune` + `edgeprune export --variant`, "
                                   "or load this folder with runtime.load")
        self.igprune = rec
        self.masks = np.asarray(rec["masks"], bool)
        self.centroids = np.asarray(rec["centroids"], np.float64)
        self._center = np.asarray(rec["center"], np.float64)
        self._scale = np.asarray(rec["scale"], np.float64)
        self.embed_layer, self.route_tokens = int(rec["embed_layer"]), int(rec["route_tokens"])
        n = self.masks.shape[1]
        self._router_mask = np.arange(n) < 2 * self.embed_layer
        self.current_mask = np.ones(n, bool)
        self._fixed: Optional[np.ndarray] = None
        self.last_route: Optional[dict] = None
        self._ort = self.sess
        self.sess = _MaskFeed(self.sess, self)

    # -------------------------------------------------------------- routing
    def embed(self, ids) -> np.ndarray:
        """Router-space embedding ``float64 [H]`` of one prompt (token ids): the router
        pass over its first ``route_tokens`` tokens, standardised and unit-normed."""
        ids = np.asarray(ids, np.int64).reshape(-1)[:self.route_tokens]
        if ids.size == 0:
            raise GenerationError("cannot route an empty prompt", "pass at least one token")
        n = ids.size
        feeds = {"input_ids": ids[None], "attention_mask": np.ones((1, n), np.int64),
                 "position_ids": np.arange(n, dtype=np.int64)[None],
                 "num_logits_to_keep": np.array(1, np.int64), MASK_INPUT: self._router_mask}
        for i in range(self.kv.num_layers):
            for kind, d in (("key", self.kv.key_dims[i]), ("value", self.kv.value_dims[i])):
                feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, self.kv.kv_heads[i], 0, d), self.kv.dtype)
        e = self._ort.run([EMBEDDING_OUTPUT], feeds)[0][0].astype(np.float64)
        z = (e - self._center) / self._scale
        return z / max(float(np.linalg.norm(z)), 1e-12)

    def route(self, ids) -> int:
        """The mask index of one prompt (token ids): its nearest centroid."""
        if len(self.masks) == 1:
            return 0
        d = ((self.centroids - self.embed(ids)[None]) ** 2).sum(-1)
        return int(np.argmin(d))

    def _route_rows(self, rows) -> None:
        """Set :attr:`current_mask` for the rows of one pass (routed unless fixed)."""
        t = time.perf_counter()
        if self._fixed is not None:
            self.current_mask = self._fixed
            self.last_route = {"mask": self._fixed.astype(int).tolist(), "cluster": None,
                               "router_ms": 0.0, "routed": False}
            return
        ks = sorted({self.route(r) for r in rows})
        if len(ks) > 1:
            raise GenerationError(f"the prompts of this batch route to different masks {ks}",
                                  "generate them one at a time (each prompt decodes with its own mask)")
        self.current_mask = self.masks[ks[0]]
        self.last_route = {"mask": self.current_mask.astype(int).tolist(), "cluster": ks[0],
                           "router_ms": (time.perf_counter() - t) * 1e3, "routed": True}

    @contextlib.contextmanager
    def using_mask(self, mask):
        """Within it, every pass uses ``mask`` (an index into :attr:`masks` or ``2L``
        0/1 values) instead of routing.

        Raises:
            GenerationError: a mask of the wrong length or one that skips everything.
        """
        m = self.masks[int(mask)] if np.ndim(mask) == 0 else np.asarray(mask).astype(bool)
        if m.shape != self.masks.shape[1:] or not m.any():
            raise GenerationError(f"mask of shape {m.shape} with {int(m.sum())} kept sub-blocks",
                                  f"pass {self.masks.shape[1]} values, at least one 1")
        saved, self._fixed = self._fixed, m
        try:
            yield self
        finally:
            self._fixed = saved

    # -------------------------------------------------------------- passes
    def _prefill(self, prompts, need=None) -> dict:
        self._route_rows(prompts)
        return super()._prefill(prompts, need)

    def logits(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None) -> np.ndarray:
        """:meth:`Session.logits` with each row's real tokens routed first (all rows must
        route to one mask)."""
        ids, mask = self._logits_inputs(input_ids, attention_mask)
        self._route_rows([ids[b][mask[b] == 1] for b in range(len(ids))])
        return super().logits(input_ids, attention_mask)

    # -------------------------------------------------------------- reporting
    def kv_cache_bytes(self, length: int, batch: int = 1, mask=None) -> dict:
        """``{"k", "v"}`` bytes of the cache holding ``length`` tokens per row under
        ``mask`` (default :attr:`current_mask`): bypassed attention layers hold none."""
        m = self.current_mask if mask is None else np.asarray(mask, bool)
        item = np.dtype(self.kv.dtype).itemsize
        out = {}
        for kind, dims in (("k", self.kv.key_dims), ("v", self.kv.value_dims)):
            out[kind] = int(sum(h * d for i, (h, d) in enumerate(zip(self.kv.kv_heads, dims))
                                if m[2 * i]) * length * batch * item)
        return out


def load(folder, device: str = "cpu", threads: Optional[int] = None,
         max_length: Optional[int] = None, context_policy: str = "error",
         huge_pages: bool = True) -> IgPruneSession:
    """Load an IG-Pruning export (see :class:`IgPruneSession`)."""
    return IgPruneSession(folder, device=device, threads=threads, max_length=max_length,
                          context_policy=context_policy, huge_pages=huge_pages)


__all__ = ["IgPruneSession", "load", "MASK_INPUT", "EMBEDDING_OUTPUT"]
