"""LeanK: static key-channel pruning of the KV cache (Zhang et al., "LeanK: Learnable K
Cache Channel Pruning for Efficient Decoding", EMNLP 2025).

What is pruned
    Per layer and KV head, a static mask over the ``head_dim`` channels of the keys
    *after* rotary embedding. Queries are rotated in full; only their kept channels meet
    the kept key channels. With GQA the query heads of a group share their KV head's
    mask. The first ``sink`` tokens (attention sinks) and the most recent ``window``
    tokens keep full keys; only the middle of the cache is pruned. A KV head whose
    channels all go ("dead" head) attends only to its sink + window tokens, so its middle
    V cache is dropped too. Attention scores keep the ``1/sqrt(head_dim)`` scale.

    For a query at position ``p`` and a key at position ``j <= p`` of KV head ``h``::

        score = q_p . k_j / sqrt(D)                     if j < sink or j > p - window
        score = (q_p * s_h)[kept_h] . k_j[kept_h] / sqrt(D)   otherwise (-inf if h is dead)

    where ``s_h`` are the per-channel scales learned in stage 2 (1 for the magnitude mask).
    This per-query rule is exactly what a decoder sees token after token, so prefill
    perplexity under the rule equals the perplexity of decoding with a LeanK cache.

Defaults (:data:`DEFAULT_SINK` = 64, :data:`DEFAULT_WINDOW` = 448): sink + window = 512
    tokens, as the issue's protocol asks (at 512-token windows nothing is pruned; at 2,048
    the last query sees 1,536 pruned middle tokens). LeanK itself keeps a few sink tokens
    and a recent window of a few hundred tokens; a 135M model with 64-dim heads has little
    key redundancy to spare, so a wide window protects local syntax, which is what
    perplexity mostly measures; the middle is where long contexts spend their bytes.

How the mask is chosen (:func:`learn_mask`)
    * ``method="learned"`` (LeanK's two stages): stage 1 (:func:`learn_scales`) trains
      per-channel scales ``alpha in [0, 1]`` (init 1) applied to the pruned-region query
      channels, with the model frozen, by distillation plus ``l1 * mean(alpha)`` (L1
      ramped from 0); the importance of a channel is its mean ``alpha`` over the ramp.
      Stage 2 keeps the ``k_keep`` fraction of channels with the largest importance
      (global quantile over all layers and heads, in blocks of ``alignment`` channels so
      every head keeps a multiple of ``alignment``), then fine-tunes the kept scales from 1
      for a few steps with the binary mask fixed (no L1; :func:`finetune_scales`).
      Training regime: calibration windows of 2,048 tokens (:data:`DEFAULT_CALIB_SEQLEN`)
      with the deployment sink / window, so the pruned keys are as far from the queries
      as at inference (channel importance depends on that distance through the rotary
      frequencies); the loss covers ``train_queries`` query positions per window.
      Deviation from the paper: the distillation target is each layer's attention output
      (after ``o_proj``) from the dense model's inputs to that layer, not the model's
      output (no backward pass through the network, ~10 min on one CPU thread).
    * ``method="magnitude"`` (training-free baseline): importance of channel ``c`` of KV
      head ``h`` is ``||q_c|| * ||k_c||`` over calibration tokens (q aggregated over the
      group's query heads), normalised to each head's total, then the same global aligned
      selection; kept scales are 1.

    Measured (SmolLM2-135M-Instruct, keep 0.3, sink 64 / window 448, WikiText-2 2,048-token
    windows 1-3, dense 23.06; masks learned on C4, 4 x 2,048 tokens): the old regime (2 x 256 tokens, train window 32) 24.39
    (+5.7%); the 2,048-token regime with stage 2 started from the stage-1 importances
    23.90 (+3.6%); binary mask, no stage 2: 23.32 (+1.1%); stage 2 from 1 (default):
    23.37 (+1.3%); magnitude (2 x 256 tokens) 26.43 (+14.6%). See README (LeanK) for the 10-window figures.

Evaluation: :func:`long_perplexity` (2,048-token windows) and :func:`retrieval_eval`
(a key-value fact at depths 0..100% of ~2,000 tokens of real text, asked at the end).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .errors import CalibrationError, CheckpointError, ConfigError

DEFAULT_SINK = 64
DEFAULT_WINDOW = 448
DEFAULT_ALIGNMENT = 8
DEFAULT_CALIB_NSAMPLES = 4   # calibration windows for learned masks (CLI / export) ...
DEFAULT_CALIB_SEQLEN = 2048  # ... of this many tokens: longer than sink + window
ATTN_NAME = "edgeprune_leank"
MASK_FORMAT = "edgeprune.leank.v1"
QUERY_CHUNK = 256        # reference attention: queries per chunk (causal key ranges)

__all__ = ["LeanKMask", "learn_mask", "learn_scales", "magnitude_scores", "select_channels",
           "finetune_scales", "apply_reference", "long_perplexity", "retrieval_eval", "retrieval_prompts",
           "check_leank_args", "kv_geometry", "DEFAULT_SINK", "DEFAULT_WINDOW",
           "DEFAULT_ALIGNMENT", "DEFAULT_CALIB_NSAMPLES", "DEFAULT_CALIB_SEQLEN"]


# ------------------------------------------------------------------------------------------
# argument checks and geometry
# ------------------------------------------------------------------------------------------

def check_leank_args(k_keep: Optional[float] = None, alignment: Optional[int] = None,
                     head_dim: Optional[int] = None, sink: Optional[int] = None,
                     window: Optional[int] = None, context: Optional[int] = None) -> None:
    """Validate LeanK options; every argument is optional.

    Raises:
        ConfigError: ``k_keep`` outside (0, 1]; ``alignment`` < 1 or not dividing
            ``head_dim``; negative ``sink``/``window``; ``sink + window`` larger than the
            ``context`` (tokens) the model or evaluation uses.
    """
    if k_keep is not None:
        if not isinstance(k_keep, (int, float)) or not (0.0 < float(k_keep) <= 1.0) \
                or math.isnan(float(k_keep)):
            raise ConfigError(f"k_keep={k_keep!r} is outside (0, 1]",
                              "use e.g. --k-keep 0.3 to keep 30% of the key channels")
    if alignment is not None:
        if not isinstance(alignment, (int, np.integer)) or alignment < 1:
            raise ConfigError(f"alignment={alignment!r} must be a positive integer",
                              "use e.g. --alignment 8")
        if head_dim is not None and head_dim % alignment:
            raise ConfigError(f"alignment={alignment} does not divide head_dim={head_dim}",
                              f"use a divisor of {head_dim} (e.g. 1, 2, 4, 8, 16)")
    for name, v in (("sink", sink), ("window", window)):
        if v is not None and (not isinstance(v, (int, np.integer)) or v < 0):
            raise ConfigError(f"{name}={v!r} must be a non-negative integer",
                              f"use e.g. --{name} {DEFAULT_SINK if name == 'sink' else DEFAULT_WINDOW}")
    if context is not None and sink is not None and window is not None and sink + window > context:
        raise ConfigError(f"sink + window = {sink + window} tokens exceed the context of "
                          f"{context} tokens: nothing would be pruned",
                          f"use sink + window < {context} (defaults: sink {DEFAULT_SINK}, "
                          f"window {DEFAULT_WINDOW})")


def kv_geometry(model) -> tuple[int, int, int, int]:
    """``(num_layers, num_heads, num_kv_heads, head_dim)`` of an HF llama/qwen2 model."""
    cfg = model.config
    n = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // n
    return cfg.num_hidden_layers, n, getattr(cfg, "num_key_value_heads", None) or n, d


def _context_of(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048) or 2048)


# ------------------------------------------------------------------------------------------
# the mask
# ------------------------------------------------------------------------------------------

@dataclass
class LeanKMask:
    """A static key-channel mask (+ per-channel scales) for every layer and KV head.

    Attributes:
        keep: ``[layer][kv_head] -> sorted list of kept channel indices`` (post-rotary
            channel numbering, ``0 <= c < head_dim``; rotate-half layout as in HF).
        scales: same nesting, one float per kept channel: the query channel multiplier
            used in the pruned region (learned in stage 2; 1.0 for magnitude masks).
        head_dim: channels per key head (``D``).
        k_keep: the requested keep ratio in (0, 1].
        alignment: every head keeps a multiple of this many channels.
        method: ``"learned"`` | ``"magnitude"`` | ``"full"``.
        meta: provenance (calibration, steps, losses, timings).
    """

    keep: list
    scales: list
    head_dim: int
    k_keep: float
    alignment: int = DEFAULT_ALIGNMENT
    method: str = "learned"
    meta: dict = field(default_factory=dict)

    # -------------------------------------------------------------- geometry
    @property
    def num_layers(self) -> int:
        return len(self.keep)

    @property
    def num_kv_heads(self) -> int:
        return len(self.keep[0]) if self.keep else 0

    def counts(self) -> np.ndarray:
        """Kept channels per (layer, KV head): ``int [layers, kv_heads]``."""
        return np.array([[len(h) for h in layer] for layer in self.keep], dtype=np.int64)

    @property
    def fraction(self) -> float:
        """Kept key channels / all key channels (the pruned-middle K-cache fraction)."""
        c = self.counts()
        return float(c.sum() / (c.size * self.head_dim))

    def dead_heads(self, layer: int) -> list[int]:
        """KV heads of ``layer`` with no kept channel (their middle V cache is dropped)."""
        return [h for h, ch in enumerate(self.keep[layer]) if len(ch) == 0]

    def v_fraction(self) -> float:
        """Fraction of the middle V cache kept (1 - dead heads / all heads)."""
        c = self.counts()
        return float((c > 0).sum() / c.size)

    def dense_scales(self, layer: int) -> np.ndarray:
        """``float32 [kv_heads, head_dim]``: scale on kept channels, 0 on pruned ones."""
        out = np.zeros((self.num_kv_heads, self.head_dim), np.float32)
        for h, (ch, sc) in enumerate(zip(self.keep[layer], self.scales[layer])):
            out[h, list(ch)] = sc
        return out

    def summary(self) -> str:
        c = self.counts()
        return (f"LeanK {self.method} mask: keep {self.fraction:.1%} of key channels "
                f"(target {self.k_keep:g}, alignment {self.alignment}), per-head kept "
                f"min {c.min()} / max {c.max()} of {self.head_dim}, "
                f"{int((c == 0).sum())} dead heads (middle V dropped)")

    # ------------------------------------------------------------ validation
    def validate(self, num_layers: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None) -> "LeanKMask":
        """Check the structure (and, optionally, that it matches a model).

        Raises:
            ConfigError: ragged/duplicate/out-of-range channels, scales of the wrong length,
                a head count that is not a multiple of ``alignment``, or a mismatch with
                the given model geometry.
        """
        check_leank_args(self.k_keep, self.alignment, self.head_dim)
        if not self.keep or any(len(layer) != len(self.keep[0]) for layer in self.keep):
            raise ConfigError("LeanK mask has no layers or a varying number of KV heads",
                              "re-learn the mask with `edgeprune leank`")
        for i, (lk, ls) in enumerate(zip(self.keep, self.scales)):
            if len(lk) != len(ls):
                raise ConfigError(f"LeanK mask layer {i}: scales and keep differ in heads",
                                  "re-learn the mask")
            for h, (ch, sc) in enumerate(zip(lk, ls)):
                if len(ch) != len(sc) or len(set(ch)) != len(ch) or \
                        any(not (0 <= int(c) < self.head_dim) for c in ch):
                    raise ConfigError(f"LeanK mask layer {i} head {h}: bad channel list",
                                      "re-learn the mask")
                if len(ch) % self.alignment:
                    raise ConfigError(f"LeanK mask layer {i} head {h} keeps {len(ch)} channels, "
                                      f"not a multiple of alignment {self.alignment}",
                                      "re-learn the mask with the alignment you export with")
        for name, want, got in (("layers", num_layers, self.num_layers),
                                ("KV heads", num_kv_heads, self.num_kv_heads),
                                ("head_dim", head_dim, self.head_dim)):
            if want is not None and want != got:
                raise ConfigError(f"LeanK mask has {got} {name}, the model has {want}",
                                  "use a mask learned on this model")
        return self

    def check_model(self, model) -> "LeanKMask":
        """:meth:`validate` against ``model``'s geometry."""
        L, _, KV, D = kv_geometry(model)
        return self.validate(L, KV, D)

    # -------------------------------------------------------------- (de)serialize
    def to_dict(self) -> dict:
        """JSON-ready dict (also the ``leank`` entry of ``edgeprune.json``)."""
        return {"format": MASK_FORMAT, "method": self.method, "k_keep": float(self.k_keep),
                "alignment": int(self.alignment), "head_dim": int(self.head_dim),
                "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "kept_fraction": self.fraction, "v_fraction": self.v_fraction(),
                "keep": [[[int(c) for c in h] for h in layer] for layer in self.keep],
                "scales": [[[round(float(s), 6) for s in h] for h in layer]
                           for layer in self.scales],
                "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> "LeanKMask":
        """Inverse of :meth:`to_dict`. Raises :class:`CheckpointError` on a foreign dict."""
        if not isinstance(d, dict) or d.get("format") != MASK_FORMAT:
            raise CheckpointError("not an edgeprune LeanK mask (missing format "
                                  f"'{MASK_FORMAT}')", "pass a file written by LeanKMask.save")
        try:
            m = cls(keep=[[sorted(int(c) for c in h) for h in layer] for layer in d["keep"]],
                    scales=[[[float(s) for s in h] for h in layer] for layer in d["scales"]],
                    head_dim=int(d["head_dim"]), k_keep=float(d["k_keep"]),
                    alignment=int(d.get("alignment", 1)), method=str(d.get("method", "?")),
                    meta=dict(d.get("meta") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"corrupt LeanK mask: {e}", "re-learn the mask") from e
        # sorting the channels must keep each scale with its channel
        for i, layer in enumerate(d["keep"]):
            for h, ch in enumerate(layer):
                order = np.argsort(np.asarray(ch, dtype=np.int64), kind="stable")
                m.scales[i][h] = [float(d["scales"][i][h][j]) for j in order]
        return m.validate()

    def save(self, path) -> Path:
        """Write JSON atomically (temp file + rename); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f)
        from exporters.folder import plain_modes
        plain_modes(Path(tmp))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path) -> "LeanKMask":
        """Read a mask saved by :meth:`save`.

        Raises:
            CheckpointError: missing/unreadable/foreign file.
        """
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read LeanK mask {path}: {e}",
                                  "learn one with `edgeprune leank MODEL --k-keep R -o mask.json`"
                                  ) from e
        return cls.from_dict(d)

    @classmethod
    def full(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> "LeanKMask":
        """The keep-everything mask (``k_keep=1``): LeanK reduces to dense attention."""
        keep = [[list(range(head_dim)) for _ in range(num_kv_heads)] for _ in range(num_layers)]
        return cls(keep=keep, scales=[[[1.0] * head_dim for _ in range(num_kv_heads)]
                                      for _ in range(num_layers)],
                   head_dim=head_dim, k_keep=1.0, alignment=1, method="full")


# ------------------------------------------------------------------------------------------
# budgeted, aligned, global channel selection
# ------------------------------------------------------------------------------------------

def select_channels(scores: np.ndarray, k_keep: float, alignment: int = DEFAULT_ALIGNMENT,
                    min_per_head: Optional[int] = None) -> list:
    """Keep the ``k_keep`` fraction of channels with the largest scores, globally.

    Each head's channels are sorted by score and cut into blocks of ``alignment``; a
    block's value is the mean score of its channels (non-increasing along the head), and
    the ``round(k_keep * L * KV * D / alignment)`` best blocks over all heads and layers
    are kept. Every head thus keeps a multiple of ``alignment`` channels (possibly 0)
    and the total meets the budget exactly (to one block).

    Args:
        scores: ``float [layers, kv_heads, head_dim]`` channel importances (larger = keep).
        k_keep: keep ratio in (0, 1].
        alignment: channels per block; must divide ``head_dim``.
        min_per_head: channels every head keeps at least (rounded up to ``alignment``;
            default ``alignment``: no head loses all its channels). ``0`` lets whole heads
            go ("dead" heads attend only to sink + window; their middle V is dropped).
            The training objective scores a fully scaled-down head as uniform attention
            over the middle, not as a dropped middle, so dead heads are opt-in.

    Returns:
        ``keep[layer][kv_head]`` sorted channel lists.

    Raises:
        ConfigError: bad ``k_keep``/``alignment`` or non-finite scores.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 3:
        raise ConfigError(f"scores must be [layers, kv_heads, head_dim], got {scores.shape}",
                          "pass one score per channel")
    L, KV, D = scores.shape
    check_leank_args(k_keep, alignment, D)
    if not np.isfinite(scores).all():
        raise ConfigError("channel scores contain NaN/inf", "check the calibration run")
    nb = D // alignment
    units = int(round(float(k_keep) * L * KV * D / alignment))
    order = np.argsort(-scores, axis=-1, kind="stable")                 # [L,KV,D]
    srt = np.take_along_axis(scores, order, -1)
    block_val = srt.reshape(L, KV, nb, alignment).mean(-1)              # [L,KV,nb]
    # enforce non-increasing along the head so the global top-k takes prefixes
    block_val = np.minimum.accumulate(block_val, axis=-1)
    mb = 1 if min_per_head is None else -(-int(min_per_head) // alignment)
    mb = min(mb, nb)
    if mb * L * KV > units:
        raise ConfigError(f"k_keep={k_keep} keeps {units * alignment} channels, fewer than "
                          f"min_per_head x heads = {mb * alignment * L * KV}",
                          "raise k_keep or pass min_per_head=0 (allow dead heads)")
    forced = np.zeros((L, KV, nb), bool)
    forced[..., :mb] = True
    flat = np.where(forced, np.inf, block_val).reshape(-1)
    # tie-break: earlier block of a head first (lexsort: last key primary)
    idx = np.lexsort((np.tile(np.arange(nb), L * KV), -flat))[:units]
    taken = np.zeros(L * KV * nb, bool)
    taken[idx] = True
    nblocks = taken.reshape(L, KV, nb).sum(-1)
    keep = [[sorted(int(c) for c in order[i, h, :nblocks[i, h] * alignment])
             for h in range(KV)] for i in range(L)]
    return keep


# ------------------------------------------------------------------------------------------
# reference attention (torch): the exact function the export computes
# ------------------------------------------------------------------------------------------

def leank_scores(query, key, scaling, st, qpos, kpos):
    """Attention logits ``[B, N, S, T]`` under LeanK's per-query regions.

    Args:
        query: ``[B, N, S, D]`` post-rotary queries; key: ``[B, KV, T, D]`` post-rotary keys.
        scaling: ``1/sqrt(D)``.
        st: state dict (``scale [KV, D]`` or ``idx``/``sc`` per head, ``sink``, ``window``,
            ``dead``) or ``None`` for dense attention.
        qpos, kpos: absolute positions ``[S]``, ``[T]``.

    Pruned-region logits use only each head's kept channels (gathered, so they cost
    ``kept/D`` of a dense product); causal masking is applied (``-inf``).
    """
    B, N, S, D = query.shape
    KV, T = key.shape[1], key.shape[2]
    rep = N // KV
    qg = query.reshape(B, KV, rep * S, D)
    kt = key.transpose(2, 3)
    s = torch.matmul(qg, kt).mul_(scaling) if not query.requires_grad else \
        torch.matmul(qg, kt) * scaling                                    # [B,KV,rep*S,T]
    s = s.view(B, N, S, T)
    allowed = kpos[None, :] <= qpos[:, None]                               # [S,T]
    if st is not None:
        full = (kpos[None, :] < st["sink"]) | (kpos[None, :] > qpos[:, None] - st["window"])
        if "scale" in st:        # training: a scale on every channel (differentiable)
            sc = st["scale"].to(query.dtype)                               # [KV,D]
            s_pr = torch.matmul(qg * sc[:, None, :], kt) * scaling
            s_pr = s_pr.view(B, N, S, T)
            if st.get("dead_q") is not None:
                s_pr = s_pr.masked_fill(st["dead_q"][None, :, None, None], float("-inf"))
        else:                    # inference: gathered kept channels per head
            parts = []
            for h in range(KV):
                idx = st["idx"][h]
                if idx is None:
                    parts.append(torch.full((B, rep * S, T), float("-inf"), dtype=s.dtype,
                                            device=s.device))
                    continue
                qh = qg[:, h].index_select(-1, idx) * st["sc"][h]
                kh = key[:, h].index_select(-1, idx)
                parts.append(torch.matmul(qh, kh.transpose(1, 2)).mul_(scaling))
            s_pr = torch.stack(parts, 1).view(B, N, S, T)
        s = torch.where(full[None, None], s, s_pr)
    return s.masked_fill(~allowed[None, None], float("-inf"))


def _gathered(query, key, st):
    """Per KV head: kept query channels (scaled) ``[B, rep, S, W_h]`` and kept key channels
    ``[B, T, W_h]`` (``None`` for a dead head), gathered once per layer call."""
    B, N, S, D = query.shape
    KV = key.shape[1]
    qv = query.view(B, KV, N // KV, S, D)
    out = []
    for h in range(KV):
        idx = st["idx"][h]
        if idx is None:
            out.append(None)
            continue
        out.append((qv[:, h].index_select(-1, idx) * st["sc"][h],
                    key[:, h].index_select(-1, idx)))
    return out


def _chunk_scores_infer(query, key, scaling, st, gq, a, b, T, S):
    """LeanK logits of queries ``a:b`` (absolute positions ``T-S+a ..``) against keys
    ``0..Tb`` (inference): pruned-channel scores everywhere, full scores only on the
    sink and on the keys some query of the chunk sees within its window."""
    B, N, _, D = query.shape
    KV = key.shape[1]
    rep = N // KV
    Tb = T - S + b
    q0 = T - S + a
    sink, window = st["sink"], st["window"]
    parts = []
    for h in range(KV):
        if gq[h] is None:
            parts.append(torch.full((B, rep, b - a, Tb), float("-inf"), dtype=query.dtype,
                                    device=query.device))
        else:
            qh, kh = gq[h]
            parts.append(torch.matmul(qh[:, :, a:b], kh[:, :Tb].transpose(1, 2)[:, None]))
    s = torch.cat(parts, 1).mul_(scaling)                                   # [B,N,c,Tb]
    qc = query[:, :, a:b]
    lo = max(0, q0 - window + 1)                   # first key inside any query's window
    ns = min(sink, lo)
    qpos = torch.arange(q0, T - S + b, device=query.device)
    kpos = torch.arange(Tb, device=query.device)
    qg = qc.reshape(B, KV, rep * (b - a), D)
    if ns > 0:                                     # sink keys: full for every query
        sf = torch.matmul(qg, key[:, :, :ns].transpose(2, 3)).view(B, N, b - a, ns)
        s[..., :ns] = sf.mul_(scaling)
    if lo < Tb:
        kb = kpos[lo:]
        sf = torch.matmul(qg, key[:, :, lo:Tb].transpose(2, 3)).view(B, N, b - a, Tb - lo)
        sf.mul_(scaling)
        full = (kb[None, :] < sink) | (kb[None, :] > qpos[:, None] - window)
        s[..., lo:] = torch.where(full[None, None], sf, s[..., lo:])
        s[..., lo:].masked_fill_((kb[None, :] > qpos[:, None])[None, None], float("-inf"))
    return s


def _leank_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """HF attention function with LeanK's per-query full/pruned regions.

    ``query [B, N, S, D]`` and ``key/value [B, KV, T, D]`` are post-rotary; the ``S``
    queries are the last ``S`` of the ``T`` positions (batch rows unpadded). Returns
    ``(out [B, S, N, D], None)`` as HF attention functions do.
    """
    st = getattr(module, "_leank", None)
    B, N, S, D = query.shape
    KV, T = key.shape[1], key.shape[2]
    rep = N // KV
    if scaling is None:
        scaling = D ** -0.5
    dev = query.device
    qpos = torch.arange(T - S, T, device=dev)
    kpos = torch.arange(T, device=dev)
    if st is not None and "stats" in st:
        stats = st["stats"]
        with torch.no_grad():
            q2 = query.float().pow(2).sum((0, 2)).view(KV, rep, D).sum(1)   # [KV,D]
            k2 = key.float().pow(2).sum((0, 2))                             # [KV,D]
            stats["q2"][module.layer_idx] += q2.cpu().double()
            stats["k2"][module.layer_idx] += k2.cpu().double()
        st = None
    infer = st is not None and "idx" in st and not torch.is_grad_enabled()
    gq = _gathered(query, key, st) if infer else None
    chunk = S if (query.requires_grad or S <= QUERY_CHUNK) else QUERY_CHUNK
    outs = []
    for a in range(0, S, chunk):
        b = min(S, a + chunk)
        Tb = T - S + b                  # causal: keys after the chunk's last query are unused
        if infer:
            s = _chunk_scores_infer(query, key, scaling, st, gq, a, b, T, S)
        else:
            s = leank_scores(query[:, :, a:b], key[:, :, :Tb], scaling, st, qpos[a:b],
                             kpos[:Tb])
        if attention_mask is not None and attention_mask.dim() == 4:
            am = attention_mask[..., a:b, :Tb]
            s = s.masked_fill(~am, float("-inf")) if am.dtype == torch.bool else s + am
        p = torch.softmax(s, dim=-1, dtype=torch.float32)
        if st is not None and st.get("sink", 1) + st.get("window", 1) == 0:
            p = torch.nan_to_num(p, nan=0.0)   # a dead head with no full-region key: output 0
        o = torch.matmul(p.to(value.dtype).view(B, KV, rep * (b - a), Tb), value[:, :, :Tb])
        outs.append(o.view(B, N, b - a, D))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
    return out.transpose(1, 2).contiguous(), None


def _register():
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, _leank_attention)


def _attn_modules(model):
    layers = model.model.layers
    return [layer.self_attn for layer in layers]


@contextlib.contextmanager
def _attention_state(model, states: Optional[Sequence[Optional[dict]]]):
    """Route every attention module through :func:`_leank_attention` with ``states``."""
    _register()
    mods = _attn_modules(model)
    old_impl = model.config._attn_implementation
    try:
        model.config._attn_implementation = ATTN_NAME
        for i, m in enumerate(mods):
            m._leank = None if states is None else states[i]
        yield model
    finally:
        model.config._attn_implementation = old_impl
        for m in mods:
            if hasattr(m, "_leank"):
                del m._leank


def _states_from_scales(model, scales: Sequence[torch.Tensor], sink: int, window: int) -> list:
    """Training states: a differentiable scale ``[KV, D]`` per layer."""
    return [{"scale": sc, "sink": int(sink), "window": int(window)} for sc in scales]


def _states_from_mask(model, mask: "LeanKMask", sink: int, window: int) -> list:
    """Inference states: kept channel indices and scales per KV head (None = dead head)."""
    dev = next(model.parameters()).device
    out = []
    for i in range(mask.num_layers):
        idx, sc = [], []
        for ch, s in zip(mask.keep[i], mask.scales[i]):
            if len(ch):
                idx.append(torch.tensor(ch, dtype=torch.long, device=dev))
                sc.append(torch.tensor(s, dtype=torch.float32, device=dev))
            else:
                idx.append(None)
                sc.append(None)
        out.append({"idx": idx, "sc": sc, "sink": int(sink), "window": int(window)})
    return out


@contextlib.contextmanager
def apply_reference(model, mask: Optional[LeanKMask], sink: int = DEFAULT_SINK,
                    window: int = DEFAULT_WINDOW):
    """Context manager: ``model`` computes attention with the LeanK cache semantics.

    Inside the block every forward pass (prefill or decoding with HF's cache) scores
    pruned-region keys on the mask's kept channels only (scaled by the mask's scales),
    full-region keys (first ``sink`` tokens, last ``window`` before each query) in full;
    dead heads ignore their pruned region. ``mask=None`` gives dense attention through
    the same code path. Batch rows must be unpadded (no attention_mask padding).

    Args:
        model: HF llama/qwen2 causal LM (fp32, eval).
        mask: :class:`LeanKMask` matching the model, or ``None``.
        sink, window: tokens kept with full keys at the start / before each query.

    Raises:
        ConfigError: the mask does not fit the model, or bad sink/window.

    Example::

        with apply_reference(model, mask, sink=64, window=448):
            logits = model(ids).logits
    """
    check_leank_args(sink=sink, window=window)
    if mask is None:
        with _attention_state(model, None):
            yield model
        return
    mask.check_model(model)
    states = _states_from_mask(model, mask, sink, window)
    with _attention_state(model, states):
        yield model


# ------------------------------------------------------------------------------------------
# magnitude baseline
# ------------------------------------------------------------------------------------------

@torch.no_grad()
def magnitude_scores(model, calib_ids: torch.Tensor, normalize: bool = True) -> np.ndarray:
    """Training-free importance ``||q_c|| * ||k_c||`` per post-rotary key channel.

    ``||q_c||`` is the L2 norm of channel ``c`` over all calibration tokens and the
    group's query heads; ``||k_c||`` over the tokens of the KV head.

    Args:
        model: HF llama/qwen2 causal LM.
        calib_ids: ``int64 [nsamples, seqlen]`` calibration windows.
        normalize: divide each head's scores by their sum (so heads of layers with large
            activations do not take the whole global budget).

    Returns:
        ``float64 [layers, kv_heads, head_dim]``.
    """
    L, N, KV, D = kv_geometry(model)
    stats = {"q2": torch.zeros(L, KV, D, dtype=torch.float64),
             "k2": torch.zeros(L, KV, D, dtype=torch.float64)}
    dev = next(model.parameters()).device
    with _attention_state(model, [{"stats": stats} for _ in range(L)]):
        for row in _as_ids(calib_ids):
            model(row[None].to(dev), use_cache=False)
    sc = (stats["q2"].sqrt() * stats["k2"].sqrt()).numpy()
    if normalize:
        sc = sc / np.maximum(sc.sum(-1, keepdims=True), 1e-30)
    return sc


def _as_ids(calib_ids) -> torch.Tensor:
    ids = calib_ids.input_ids if hasattr(calib_ids, "input_ids") else calib_ids
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise CalibrationError(f"calibration ids must be [nsamples, seqlen >= 2], got "
                               f"{tuple(ids.shape)}", "build them with build_calibration()")
    return ids


# ------------------------------------------------------------------------------------------
# learned mask (LeanK two-stage training)
# ------------------------------------------------------------------------------------------

@torch.no_grad()
def _capture(model, ids: torch.Tensor) -> tuple[list, list, tuple]:
    """Dense forward of ``ids [n, S]``: per layer, the attention input (post-norm hidden
    ``[n, S, H]``) and the residual-stream energy ``mean(x^2)`` at the layer input; plus
    the rotary ``(cos, sin)``."""
    layers = model.model.layers
    h_in: list = [None] * len(layers)
    energy: list = [None] * len(layers)
    rope: dict = {}
    hooks = []

    def attn_hook(i):
        def fn(mod, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            h_in[i] = h.detach().clone()
            if "pe" not in rope:
                rope["pe"] = kwargs.get("position_embeddings")
        return fn

    def layer_hook(i):
        def fn(mod, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            energy[i] = float(x.float().pow(2).mean())
        return fn

    for i, layer in enumerate(layers):
        hooks.append(layer.self_attn.register_forward_pre_hook(attn_hook(i), with_kwargs=True))
        hooks.append(layer.register_forward_pre_hook(layer_hook(i), with_kwargs=True))
    try:
        dev = next(model.parameters()).device
        model.model(input_ids=ids.to(dev), use_cache=False)
    finally:
        for hk in hooks:
            hk.remove()
    return h_in, energy, rope["pe"]


def _qkv(attn, h, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    n, S, _ = h.shape
    D = attn.head_dim
    q = attn.q_proj(h).view(n, S, -1, D).transpose(1, 2)
    k = attn.k_proj(h).view(n, S, -1, D).transpose(1, 2)
    v = attn.v_proj(h).view(n, S, -1, D).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q.contiguous(), k.contiguous(), v.contiguous()


def _train_regime(S: int, train_sink: Optional[int], train_window: Optional[int],
                  train_queries: Optional[int]) -> tuple[int, int, torch.Tensor]:
    """Sink, window and query positions used to train on calibration windows of ``S``
    tokens.

    The default (``None``) is the deployment regime: :data:`DEFAULT_SINK` /
    :data:`DEFAULT_WINDOW`, so the pruned keys a query meets in training are as far away
    as at inference (channel importance depends on the query-key distance through the
    rotary frequencies: channels that rotate fast carry near-range position, not far-range
    content). Windows too short for it (``S <= sink + window``, e.g. tiny test models)
    fall back to ``sink = S // 32``, ``window = S // 4`` (recorded in the mask's meta).

    Only queries at ``p >= sink + window`` meet a pruned key; ``train_queries`` of them
    (evenly spaced; all if ``None``) enter the loss: each query's output depends only on
    the keys, so the subset is an unbiased, cheaper estimate of the full loss.

    Raises:
        CalibrationError: explicit ``train_sink + train_window >= S`` (nothing pruned).
    """
    sink = DEFAULT_SINK if train_sink is None else int(train_sink)
    window = DEFAULT_WINDOW if train_window is None else int(train_window)
    if sink + window >= S:
        if train_sink is not None and train_window is not None:
            raise CalibrationError(f"training sink + window = {sink + window} tokens leave no "
                                   f"pruned key in calibration windows of {S} tokens",
                                   "use longer calibration windows (e.g. seqlen 2048) or a "
                                   "smaller train_sink / train_window")
        if train_sink is None:
            sink = S // 32
        if train_window is None:
            window = max(1, S // 4)
        if sink + window >= S:
            raise CalibrationError(f"training sink + window = {sink + window} tokens leave no "
                                   f"pruned key in calibration windows of {S} tokens",
                                   "use longer calibration windows or a smaller train_window")
    pos = torch.arange(sink + window, S)
    if train_queries is not None and 0 < int(train_queries) < len(pos):
        pick = torch.linspace(0, len(pos) - 1, int(train_queries)).round().long()
        pos = pos[pick]
    return sink, window, pos


class _LayerProblem:
    """One layer's training problem on calibration windows (dense parts precomputed).

    For the selected query positions ``P`` (``[Q]``) of every window: the dense logits
    ``s_full [n, N, Q, S]`` (``-inf`` on future keys), which of them stay full-channel
    (sink, window, future) ``use_full [Q, S]``, the rotated queries ``q [n, N, Q, D]``,
    keys/values ``[n, KV, S, D]`` and the dense attention output after ``o_proj``
    ``target [n, Q, H]`` with its energy ``mean(target^2)``.
    """

    def __init__(self, attn, h, cos, sin, pos: torch.Tensor, sink: int, window: int):
        with torch.no_grad():
            q, k, v = _qkv(attn, h, cos, sin)
            n, N, S, D = q.shape
            self.attn, self.k, self.v = attn, k, v
            self.q = q[:, :, pos].contiguous()
            self.scaling = D ** -0.5
            kpos = torch.arange(S, device=q.device)
            future = kpos[None, :] > pos[:, None]
            self.use_full = (kpos[None, :] < sink) | (kpos[None, :] > pos[:, None] - window) \
                | future
            self.s_full = self._scores(self.q).masked_fill_(future[None, None], float("-inf"))
            self.target = self._out(self.s_full)
            self.energy = float(self.target.pow(2).mean())

    def _scores(self, q):
        n, N, Q, D = q.shape
        KV = self.k.shape[1]
        s = torch.matmul(q.reshape(n, KV, -1, D), self.k.transpose(2, 3)) * self.scaling
        return s.view(n, N, Q, -1)

    def _out(self, s):
        n, N, Q, S = s.shape
        KV = self.k.shape[1]
        p = torch.softmax(s, dim=-1, dtype=torch.float32)
        o = torch.matmul(p.view(n, KV, -1, S), self.v).view(n, N, Q, -1)
        return self.attn.o_proj(o.transpose(1, 2).reshape(n, Q, -1))

    def output(self, alpha: torch.Tensor, dead_q: Optional[torch.Tensor] = None,
               rows: slice = slice(None)) -> torch.Tensor:
        """``o_proj`` output ``[n', Q, H]`` of windows ``rows`` with pruned-region query
        channels scaled by ``alpha [KV, D]`` (differentiable in ``alpha``)."""
        q = self.q[rows]
        n, N, Q, D = q.shape
        KV = self.k.shape[1]
        qs = (q.view(n, KV, N // KV, Q, D) * alpha[None, :, None, None, :]).view(n, N, Q, D)
        kk = self.k[rows]
        s_pr = torch.matmul(qs.reshape(n, KV, -1, D), kk.transpose(2, 3)).view(n, N, Q, -1) \
            * self.scaling
        if dead_q is not None and bool(dead_q.any()):
            s_pr = s_pr.masked_fill(dead_q[None, :, None, None], float("-inf"))
        s = torch.where(self.use_full[None, None], self.s_full[rows], s_pr)
        p = torch.softmax(s, dim=-1, dtype=torch.float32)
        if dead_q is not None and bool(dead_q.any()):
            p = torch.nan_to_num(p, nan=0.0)
        o = torch.matmul(p.view(n, KV, -1, s.shape[-1]), self.v[rows]).view(n, N, Q, D)
        return self.attn.o_proj(o.transpose(1, 2).reshape(n, Q, -1))

    def rel_mse(self, alpha, dead_q=None, backward: bool = False) -> float:
        """Relative squared error of the output vs dense (mean over windows); with
        ``backward`` the gradient of it is accumulated one window at a time (bounded
        memory)."""
        n = self.q.shape[0]
        tot = 0.0
        for r in range(n):
            out = self.output(alpha, dead_q, slice(r, r + 1))
            mse = (out - self.target[r:r + 1]).pow(2).mean() / (self.energy * n)
            if backward:
                mse.backward()
            tot += float(mse.detach())
        return tot


def _train_layer(prob: _LayerProblem, alpha, steps, lr, l1_max, free=None, dead_q=None,
                 max_scale: float = 1.0):
    """Adam on ``alpha [KV, D]`` for one layer; returns (mean alpha over the run, losses).

    Loss: ``mean((o_proj(attn_alpha) - o_proj(attn_dense))^2) / mean(o_proj(attn_dense)^2)
    + l1 * mean(alpha)`` on the problem's query positions, with ``l1`` ramped linearly
    from 0 to ``l1_max`` (a regularisation path: channels the layer needs least reach 0
    first). ``alpha`` is clamped to ``[0, max_scale]`` after each step; ``free`` (0/1)
    freezes the pruned channels at 0 (stage 2).
    """
    opt = torch.optim.Adam([alpha], lr=lr)
    area = torch.zeros_like(alpha.detach())
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        mse = prob.rel_mse(alpha, dead_q, backward=True)
        l1 = l1_max * (step + 1) / steps
        if l1:
            (l1 * alpha.abs().mean()).backward()
        if free is not None:
            alpha.grad.mul_(free)
        opt.step()
        with torch.no_grad():
            alpha.clamp_(0.0, max_scale)
            if free is not None:
                alpha.mul_(free)
            area += alpha
        losses.append(mse)
    return (area / max(1, steps)).cpu().numpy(), losses


def learn_scales(model, calib_ids, *, steps: int = 25, lr: float = 0.05, l1: float = 0.05,
                 train_sink: Optional[int] = None, train_window: Optional[int] = None,
                 train_queries: Optional[int] = 384, seed: int = 0,
                 progress: bool = False) -> tuple[np.ndarray, dict]:
    """LeanK stage 1: continuous channel importances ``[layers, kv_heads, head_dim]``.

    Per layer, scales ``alpha in [0, 1]`` (init 1) multiply the query channels that meet
    pruned-region keys (keys older than ``train_window`` tokens, except the first
    ``train_sink``; default: the deployment :data:`DEFAULT_SINK` / :data:`DEFAULT_WINDOW`,
    see :func:`_train_regime`); the model is frozen. Loss (L2 distillation + L1, LeanK
    stage 1): the squared error of the layer's attention output after ``o_proj`` against
    the dense one, relative to the dense output's energy (a relative error, comparable
    across layers, so one global quantile can rank all channels), plus ``l1 * mean(alpha)``
    with ``l1`` ramped from 0 to ``l1`` over ``steps``. The returned importance is the mean
    of ``alpha`` over the ramp (channels that survive stronger L1 rank higher; no ties at 0).

    Calibration windows should be longer than ``sink + window`` by the span that will be
    pruned at inference (e.g. 2,048 tokens for the defaults); ``train_queries`` query
    positions per window enter the loss.

    Deviation from the paper: LeanK distils end to end (the model's outputs); here each
    layer is distilled locally from the dense model's own inputs to that layer, which
    needs no backward pass through the network (the end-to-end version costs about a
    minute per step on the 2-core machine this was written on).

    Returns:
        ``(importance float32 [L, KV, D], info)``.

    Raises:
        CalibrationError: malformed ids, or windows too short for the training regime.
    """
    ids = _as_ids(calib_ids)
    L, N, KV, D = kv_geometry(model)
    torch.manual_seed(seed)
    sink, window, pos = _train_regime(ids.shape[1], train_sink, train_window, train_queries)
    t0 = time.perf_counter()
    h_in, _, (cos, sin) = _capture(model, ids)
    req = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    imp = np.zeros((L, KV, D), np.float32)
    first, last = [], []
    from tqdm.auto import tqdm
    try:
        for i, layer in enumerate(tqdm(model.model.layers, desc="leank stage 1",
                                       disable=not progress, leave=False)):
            prob = _LayerProblem(layer.self_attn, h_in[i], cos, sin, pos.to(h_in[i].device),
                                 sink, window)
            h_in[i] = None
            alpha = torch.ones(KV, D, device=prob.q.device, requires_grad=True)
            imp[i], losses = _train_layer(prob, alpha, steps, lr, l1)
            first.append(losses[0] if losses else 0.0)
            last.append(losses[-1] if losses else 0.0)
            del prob
    finally:
        for p, r in zip(model.parameters(), req):
            p.requires_grad_(r)
    info = {"objective": "layer-local relative L2 distillation of the o_proj output + L1 ramp",
            "stage1_steps": steps, "lr": lr, "l1": l1, "train_sink": sink,
            "train_window": window, "train_queries": int(len(pos)), "seed": seed,
            "nsamples": int(ids.shape[0]), "seqlen": int(ids.shape[1]),
            "stage1_rel_mse_end_mean": float(np.mean(last)),
            "stage1_s": round(time.perf_counter() - t0, 1)}
    return imp, info


def finetune_scales(model, calib_ids, keep: list, init: np.ndarray, *, steps: int = 10,
                    lr: float = 0.05, train_sink: Optional[int] = None,
                    train_window: Optional[int] = None, train_queries: Optional[int] = 384,
                    max_scale: float = 1.0, progress: bool = False) -> tuple[list, dict]:
    """LeanK stage 2: with the binary mask fixed, fine-tune the kept channels' scales
    (same layer-local L2 loss and training regime as :func:`learn_scales`, no L1; dead
    heads ignore their pruned region).

    Args:
        keep: ``keep[layer][kv_head]`` channel lists.
        init: ``[L, KV, D]`` initial scales, clipped to ``[0, max_scale]``
            (:func:`learn_mask` starts from 1: the binary mask).
        max_scale: upper bound of the fine-tuned scales (1 as in LeanK's ``[0, 1]``
            scales).

    Returns:
        ``(scales[layer][kv_head] -> list of floats aligned with keep, info)``.
    """
    ids = _as_ids(calib_ids)
    L, N, KV, D = kv_geometry(model)
    rep = N // KV
    sink, window, pos = _train_regime(ids.shape[1], train_sink, train_window, train_queries)
    t0 = time.perf_counter()
    h_in, _, (cos, sin) = _capture(model, ids)
    req = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    out, rel = [], []
    from tqdm.auto import tqdm
    try:
        for i, layer in enumerate(tqdm(model.model.layers, desc="leank stage 2",
                                       disable=not progress, leave=False)):
            free = torch.zeros(KV, D)
            for h, ch in enumerate(keep[i]):
                free[h, list(ch)] = 1.0
            dead = torch.tensor([len(ch) == 0 for ch in keep[i]]).repeat_interleave(rep)
            alpha = (torch.tensor(np.clip(init[i], 0, max_scale)) * free).requires_grad_(True)
            if steps > 0 and bool(free.sum() > 0):
                prob = _LayerProblem(layer.self_attn, h_in[i], cos, sin,
                                     pos.to(h_in[i].device), sink, window)
                _train_layer(prob, alpha, steps, lr, 0.0, free=free, dead_q=dead,
                             max_scale=max_scale)
                with torch.no_grad():
                    rel.append(prob.rel_mse(alpha, dead))
                del prob
            a = alpha.detach().numpy()
            out.append([[float(a[h, c]) for c in keep[i][h]] for h in range(KV)])
            h_in[i] = None
    finally:
        for p, r in zip(model.parameters(), req):
            p.requires_grad_(r)
    return out, {"stage2_steps": steps, "stage2_max_scale": max_scale,
                 "stage2_rel_mse_mean": float(np.mean(rel)) if rel else None,
                 "stage2_s": round(time.perf_counter() - t0, 1)}


def learn_mask(model, calib_ids, k_keep: float, method: str = "learned",
               alignment: int = DEFAULT_ALIGNMENT, *, scales: Optional[np.ndarray] = None,
               steps: int = 25, finetune_steps: int = 10, lr: float = 0.05, l1: float = 0.05,
               train_sink: Optional[int] = None, train_window: Optional[int] = None,
               train_queries: Optional[int] = 384, max_scale: float = 1.0, seed: int = 0,
               min_per_head: Optional[int] = None, progress: bool = False) -> LeanKMask:
    """Learn a static LeanK key-channel mask meeting the ``k_keep`` budget.

    Args:
        model: HF llama/qwen2 causal LM (fp32); frozen during training, restored after.
        calib_ids: ``int64 [nsamples, seqlen]`` (or a ``CalibrationSet``); a few windows
            longer than sink + window (e.g. 4 x 2,048 tokens for the defaults), so that
            training sees pruned keys as far away as inference does.
        k_keep: fraction of key channels kept, in (0, 1] (average over layers and heads).
        method: ``"learned"`` (LeanK two-stage training) or ``"magnitude"``
            (``||q||*||k||`` baseline).
        alignment: every head keeps a multiple of this many channels (must divide
            ``head_dim``).
        scales: precomputed stage-1 importances ``[L, KV, D]`` (:func:`learn_scales`)
            to skip stage 1, which does not depend on ``k_keep``.
        steps, finetune_steps, lr, l1, train_sink, train_window, train_queries, seed: see
            :func:`learn_scales` / :func:`finetune_scales` (default regime: the deployment
            sink / window; pass the sink / window you export with).
        max_scale: upper bound of the stage-2 scales (see :func:`finetune_scales`).
        min_per_head: see :func:`select_channels` (default: ``alignment``; 0 allows dead
            heads, whose middle V cache the export then drops).

    Returns:
        :class:`LeanKMask` (its ``meta`` records the settings and timings).

    Raises:
        ConfigError: bad ``k_keep``/``alignment``/``method``.
        CalibrationError: malformed calibration ids.
    """
    L, N, KV, D = kv_geometry(model)
    check_leank_args(k_keep, alignment, D)
    if method not in ("learned", "magnitude"):
        raise ConfigError(f"method='{method}' is unknown", "use 'learned' or 'magnitude'")
    ids = _as_ids(calib_ids)
    t0 = time.perf_counter()
    meta: dict[str, Any] = {"nsamples": int(ids.shape[0]), "calib_seqlen": int(ids.shape[1])}
    if method == "magnitude":
        sc = magnitude_scores(model, ids)
        keep = select_channels(sc, k_keep, alignment, min_per_head)
        meta["learn_s"] = round(time.perf_counter() - t0, 1)
        return LeanKMask(keep=keep, scales=[[[1.0] * len(h) for h in layer] for layer in keep],
                         head_dim=D, k_keep=float(k_keep), alignment=alignment,
                         method="magnitude", meta=meta)
    if scales is None:
        scales, info = learn_scales(model, ids, steps=steps, lr=lr, l1=l1,
                                    train_sink=train_sink, train_window=train_window,
                                    train_queries=train_queries, seed=seed,
                                    progress=progress)
        meta.update(info)
    else:
        scales = np.asarray(scales, dtype=np.float32)
        if scales.shape != (L, KV, D):
            raise ConfigError(f"stage-1 scales have shape {scales.shape}, expected {(L, KV, D)}",
                              "learn them on this model with learn_scales()")
        meta["stage1"] = "given (cached)"
    keep = select_channels(scales, k_keep, alignment, min_per_head)
    if float(k_keep) >= 1.0:
        sc_out = [[[1.0] * len(h) for h in layer] for layer in keep]
    else:
        # stage 2 starts from the binary mask (kept scales 1): the stage-1 importances are
        # means over the L1 ramp, a ranking, not scales (starting from them costs ~4% ppl)
        sc_out, info2 = finetune_scales(model, ids, keep, np.ones_like(scales),
                                        steps=finetune_steps, lr=lr,
                                        train_sink=train_sink, train_window=train_window,
                                        train_queries=train_queries, max_scale=max_scale,
                                        progress=progress)
        meta.update(info2)
    meta["learn_s"] = round(time.perf_counter() - t0, 1)
    return LeanKMask(keep=keep, scales=sc_out, head_dim=D, k_keep=float(k_keep),
                     alignment=alignment, method="learned", meta=meta)


# ------------------------------------------------------------------------------------------
# long-context evaluation
# ------------------------------------------------------------------------------------------

def long_perplexity(model, tokenizer, mask: Optional[LeanKMask], text=None, *,
                    seqlen: int = 2048, nwindows: int = 10, sink: int = DEFAULT_SINK,
                    window: int = DEFAULT_WINDOW, progress: bool = False):
    """Perplexity (``edgeprune.evaluate`` protocol: no BOS, non-overlapping windows) with
    the LeanK reference attention; ``mask=None`` gives the unpruned figure through the
    same code path.

    Returns:
        ``edgeprune.evaluate.PerplexityResult``.

    Raises:
        ConfigError: ``sink + window`` larger than ``seqlen`` when a mask is given.
    """
    from .evaluate import perplexity
    if mask is None:        # unpruned: the model's own attention (sdpa), same numbers
        return perplexity(model, tokenizer, text, seqlen=seqlen, nwindows=nwindows,
                          progress=progress)
    check_leank_args(sink=sink, window=window, context=seqlen)
    with apply_reference(model, mask, sink, window):
        return perplexity(model, tokenizer, text, seqlen=seqlen, nwindows=nwindows,
                          progress=progress)


NAMES = ["Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ingrid",
         "Jonas", "Kamala", "Luca", "Marta", "Nils", "Olga", "Pavel", "Quentin", "Rosa",
         "Sven", "Tamar", "Ugo", "Vera", "Wanda", "Xavier", "Yara", "Zoltan"]


def retrieval_prompts(tokenizer, text=None, *, n_trials: int = 20, context_tokens: int = 2000,
                      seed: int = 0, chat: bool = False) -> list[dict]:
    """Synthetic long-context retrieval trials ("needle in a haystack").

    One haystack, the first ``context_tokens`` tokens of ``text`` (default: the embedded
    held-out text), is shared by all trials. Trial ``t`` inserts the fact " The secret code
    of <name> is <5-digit number>." at depth ``t / (n_trials - 1)`` of the haystack
    (0% = start, 100% = end; snapped to just after a token ending a sentence when one is
    within 40 tokens), then asks: "Question: What is the secret code of <name>?
    Answer: The secret code of <name> is" and the greedy continuation is scored. With
    ``chat=True`` the document + question form a user turn of the tokenizer's chat
    template and the assistant's answer is primed the same way.

    Returns:
        ``[{"ids": list[int], "prefix": int, "answer": str, "depth": float, "name": str}]``
        where ``ids[:prefix]`` is the shared haystack prefix (reusable cache).
    """
    from .evaluate import resolve_text
    body, _ = resolve_text(text)
    hay = tokenizer(body, add_special_tokens=False)["input_ids"]
    if len(hay) < context_tokens:
        raise CalibrationError(f"retrieval text has {len(hay)} tokens, {context_tokens} needed",
                               "use a longer text or fewer context_tokens")
    hay = hay[:context_tokens]
    ends = [i + 1 for i, t in enumerate(hay) if tokenizer.decode([t]).rstrip().endswith(".")]
    rng = random.Random(seed)
    head: list[int] = []
    if chat and getattr(tokenizer, "chat_template", None):
        marker = "\x00DOC\x00"
        tmpl = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
        pre_txt, post_txt = tmpl.split(marker)
        head = tokenizer(pre_txt, add_special_tokens=False)["input_ids"]
    out = []
    for t in range(n_trials):
        depth = t / max(1, n_trials - 1)
        cut = int(round(depth * len(hay)))
        near = [e for e in ends if abs(e - cut) <= 40]
        if near and 0 < depth < 1:
            cut = min(near, key=lambda e: abs(e - cut))
        name = NAMES[t % len(NAMES)]
        code = str(rng.randint(10000, 99999))
        fact = tokenizer(f" The secret code of {name} is {code}. ", add_special_tokens=False)["input_ids"]
        q = f"What is the secret code of {name}?"
        prime = f"The secret code of {name} is"
        if head:
            tail = tokenizer("\n\n" + q + post_txt + prime, add_special_tokens=False)["input_ids"]
        else:
            tail = tokenizer("\n\nQuestion: " + q + "\nAnswer: " + prime,
                             add_special_tokens=False)["input_ids"]
        ids = head + hay[:cut] + fact + hay[cut:] + tail
        out.append({"ids": ids, "prefix": len(head) + cut, "answer": code,
                    "depth": round(depth, 3), "name": name})
    return out


def _torch_greedy(model, ids: list[int], max_new_tokens: int, prefix_cache=None,
                  prefix: int = 0) -> list[int]:
    """Greedy decoding with HF's cache; ``prefix_cache`` (a cache of ``ids[:>=prefix]``)
    is copied and cropped to ``prefix`` tokens instead of recomputing them."""
    import copy
    dev = next(model.parameters()).device
    out: list[int] = []
    with torch.no_grad():
        cache = None
        start = 0
        if prefix_cache is not None and prefix > 0:
            cache = copy.deepcopy(prefix_cache)
            extra = cache.get_seq_length() - prefix
            if extra > 0:
                cache.crop(-extra)
            start = prefix
        res = model(torch.tensor([ids[start:]], device=dev), cache=cache, use_cache=True)
        for _ in range(max_new_tokens):
            t = int(res.logits[0, -1].argmax())
            out.append(t)
            if len(out) == max_new_tokens:
                break
            res = model(torch.tensor([[t]], device=dev), cache=res["cache"], use_cache=True)
    return out


def retrieval_eval(model_or_generate, tokenizer, mask: Optional[LeanKMask] = None, text=None, *,
                   n_trials: int = 20, context_tokens: int = 2000, sink: int = DEFAULT_SINK,
                   window: int = DEFAULT_WINDOW, chat: bool = False, seed: int = 0,
                   max_new_tokens: int = 7, progress: bool = False) -> dict:
    """Exact-match accuracy of the greedy continuation on :func:`retrieval_prompts`.

    A trial scores 1 when the first number in the continuation equals the planted code.

    Args:
        model_or_generate: a torch model (run under :func:`apply_reference` with ``mask``,
            decoding with HF's cache) or a callable ``fn(ids: list[int], max_new_tokens)
            -> list[int]`` (e.g. an ONNX LeanK session).

    Returns:
        ``{"accuracy", "n_trials", "context_tokens", "chat", "by_depth": {depth: 0/1},
        "seconds"}``.
    """
    import re
    trials = retrieval_prompts(tokenizer, text, n_trials=n_trials, context_tokens=context_tokens,
                               seed=seed, chat=chat)
    t0 = time.perf_counter()
    torch_model = isinstance(model_or_generate, torch.nn.Module)
    if torch_model:
        model = model_or_generate
        ctx = apply_reference(model, mask, sink, window) if mask is not None \
            else contextlib.nullcontext()
    else:
        ctx = contextlib.nullcontext()
        gen = model_or_generate
    hits, by_depth, samples = 0, {}, []
    from tqdm.auto import tqdm
    with ctx:
        shared = None
        if torch_model:   # the haystack prefix is common to all trials: compute its cache once
            longest = max(trials, key=lambda tr: tr["prefix"])
            with torch.no_grad():
                dev = next(model.parameters()).device
                shared = model(torch.tensor([longest["ids"][:longest["prefix"]]], device=dev),
                               use_cache=True)["cache"]
        for tr in tqdm(trials, desc="retrieval", disable=not progress, leave=False):
            if torch_model:
                toks = _torch_greedy(model, tr["ids"], max_new_tokens, shared, tr["prefix"])
            else:
                toks = gen(tr["ids"], max_new_tokens)
            txt = tokenizer.decode(toks)
            m = re.search(r"\d+", txt)
            ok = bool(m and m.group(0) == tr["answer"])
            hits += ok
            by_depth[str(tr["depth"])] = int(ok)
            if len(samples) < 3:
                samples.append({"answer": tr["answer"], "got": txt})
    return {"accuracy": hits / len(trials), "n_trials": len(trials),
            "context_tokens": context_tokens, "chat": chat, "by_depth": by_depth,
            "samples": samples, "seconds": round(time.perf_counter() - t0, 1)}
