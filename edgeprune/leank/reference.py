"""The LeanK reference attention (torch): the exact function the exported graph computes.

For a query at position ``p`` and a key at position ``j <= p`` of KV head ``h``, the score
is the full ``q_p . k_j / sqrt(D)`` on the first ``sink`` tokens and the last ``window``
before the query, and ``(q_p * s_h)[kept_h] . k_j[kept_h] / sqrt(D)`` elsewhere (``-inf``
for a dead head). The mask is duck-typed (``keep``, ``scales``, ``num_layers``,
``check_model``: :class:`edgeprune.leank.LeanKMask`).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from .config import DEFAULT_SINK, DEFAULT_WINDOW, check_leank_args

ATTN_NAME = "edgeprune_leank"
QUERY_CHUNK = 256        # reference attention: queries per chunk (causal key ranges)


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


def _states_from_mask(model, mask, sink: int, window: int) -> list:
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
def apply_reference(model, mask, sink: int = DEFAULT_SINK,
                    window: int = DEFAULT_WINDOW):
    """Context manager: ``model`` computes attention with the LeanK cache semantics.

    Inside the block every forward pass (prefill or decoding with HF's cache) scores
    pruned-region keys on the mask's kept channels only (scaled by the mask's scales),
    full-region keys (first ``sink`` tokens, last ``window`` before each query) in full;
    dead heads ignore their pruned region. ``mask=None`` gives dense attention through
    the same code path. Batch rows must be unpadded (no attention_mask padding).

    Args:
        model: HF llama/qwen2 causal LM (fp32, eval).
        mask: :class:`~edgeprune.leank.LeanKMask` matching the model, or ``None``.
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


__all__ = ["apply_reference", "leank_scores", "ATTN_NAME", "QUERY_CHUNK"]
