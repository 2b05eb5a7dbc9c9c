"""Choosing the LeanK mask: budgeted channel selection, the magnitude baseline and LeanK's
two-stage training (stage 1 :func:`learn_scales`, stage 2 :func:`finetune_scales`).

:func:`learn_channels` returns the fields of a :class:`edgeprune.leank.LeanKMask`
(``edgeprune.leank.learn_mask`` builds the mask from them).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Optional

import numpy as np
import torch

from ..errors import CalibrationError, ConfigError
from .config import DEFAULT_ALIGNMENT, DEFAULT_SINK, DEFAULT_WINDOW, check_leank_args, kv_geometry
from .reference import _attention_state


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


@contextlib.contextmanager
def _frozen(model):
    """Within the block no parameter of ``model`` requires grad (restored after)."""
    req = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield model
    finally:
        for p, r in zip(model.parameters(), req):
            p.requires_grad_(r)


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
    imp = np.zeros((L, KV, D), np.float32)
    first, last = [], []
    from tqdm.auto import tqdm
    with _frozen(model):
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
    out, rel = [], []
    from tqdm.auto import tqdm
    with _frozen(model):
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
    return out, {"stage2_steps": steps, "stage2_max_scale": max_scale,
                 "stage2_rel_mse_mean": float(np.mean(rel)) if rel else None,
                 "stage2_s": round(time.perf_counter() - t0, 1)}


def learn_channels(model, calib_ids, k_keep: float, method: str = "learned",
               alignment: int = DEFAULT_ALIGNMENT, *, scales: Optional[np.ndarray] = None,
               steps: int = 25, finetune_steps: int = 10, lr: float = 0.05, l1: float = 0.05,
               train_sink: Optional[int] = None, train_window: Optional[int] = None,
               train_queries: Optional[int] = 384, max_scale: float = 1.0, seed: int = 0,
               min_per_head: Optional[int] = None, progress: bool = False) -> dict:
    """Learn a static LeanK key-channel mask meeting the ``k_keep`` budget
    (``edgeprune.leank.learn_mask`` returns it as a :class:`~edgeprune.leank.LeanKMask`).

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
        the mask's fields ``{"keep", "scales", "head_dim", "k_keep", "alignment",
        "method", "meta"}`` (``meta`` records the settings and timings).

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
        return dict(keep=keep, scales=[[[1.0] * len(h) for h in layer] for layer in keep],
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
    return dict(keep=keep, scales=sc_out, head_dim=D, k_keep=float(k_keep),
                alignment=alignment, method="learned", meta=meta)


__all__ = ["select_channels", "magnitude_scores", "learn_scales", "finetune_scales",
           "learn_channels"]
