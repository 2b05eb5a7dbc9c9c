"""COUNTDOWN calibration: MLP inputs, thresholds, and the D predictors (4-bit copies of
gate/up or low-rank factors, fitted in closed form and trained)."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from ..errors import CalibrationError, ConfigError
from .config import (DEFAULT_PREDICTOR, DEFAULT_RANK, DEFAULT_TRAIN_EPOCHS, PREDICTORS, Q4_GROUP,
                     check_act_sparsity, check_mode, gated_mlps)
from .reference import _act, m_score, predictor_score


def q4_predictor(mlp, group_size: int = Q4_GROUP) -> dict:
    """D-COUNTDOWN q4 predictor: RTN asym 4-bit copies (blocks of ``group_size`` along
    ``H``) of ``W_gate`` and ``W_up`` plus the channel scale ``||W_down[:, j]||``."""
    from ..quantize import rtn_quantize
    out = {}
    for p in ("gate", "up"):
        q = rtn_quantize(getattr(mlp, p + "_proj").weight.detach().float().cpu(), 4,
                         group_size, pad_groups=True, name=p + "_proj")
        out.update({f"{p}_codes": q.codes.contiguous(), f"{p}_scales": q.scales.contiguous(),
                    f"{p}_zeros": q.zeros.contiguous()})
    out["block_size"] = torch.tensor([int(group_size)], dtype=torch.int64)
    out["channel_scale"] = mlp.down_proj.weight.detach().float().cpu().norm(dim=0).contiguous()
    return out


def predictor_bytes(pred: dict) -> int:
    """Bytes a decode step reads for one layer's D predictor (4-bit codes packed two per
    byte, zero points likewise, scales and factors as stored)."""
    if "gate_codes" in pred:
        n = 0
        for p in ("gate", "up"):
            n += pred[p + "_codes"].numel() // 2 + pred[p + "_zeros"].numel() // 2 + \
                pred[p + "_scales"].numel() * 4
        return n + pred["channel_scale"].numel() * 4
    return sum(pred[k].numel() * 4 for k in ("v_gate", "u_gate", "v_up", "u_up"))


@torch.no_grad()
def collect_mlp_inputs(model, calib_ids: torch.Tensor, max_tokens: int = 8192,
                       seed: int = 0, return_resid: bool = False):
    """Inputs ``x`` of every MLP on the calibration windows (dense model).

    Args:
        calib_ids: ``int64 [nsamples, seqlen]``.
        max_tokens: tokens kept per layer (a seeded random subset when there are more).

    Returns:
        ``[num_layers]`` float32 tensors ``[N, H]`` (and, with ``return_resid``, the mean
        squared norm per token of each layer's output residual stream).
    """
    mlps = gated_mlps(model)
    store: list = [[] for _ in mlps]
    resid = [[0.0, 0] for _ in mlps]

    def _res_hook(mod, args, out, _i):
        h = out[0] if isinstance(out, (tuple, list)) else out
        resid[_i][0] += float(h.detach().float().pow(2).sum())
        resid[_i][1] += h.shape[0] * h.shape[1]

    hooks = [layer.register_forward_hook(lambda mod, a, o, _i=i: _res_hook(mod, a, o, _i))
             for i, layer in enumerate(model.model.layers)]
    hooks += [m.register_forward_pre_hook(
        lambda mod, args, _i=i: store[_i].append(args[0].detach().reshape(-1, args[0].shape[-1])
                                                 .float().cpu()))
        for i, m in enumerate(mlps)]
    device = next(model.parameters()).device
    try:
        for row in calib_ids:
            model(row[None].to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out = []
    g = torch.Generator().manual_seed(seed)
    for xs in store:
        X = torch.cat(xs)
        if X.shape[0] > max_tokens:
            X = X[torch.randperm(X.shape[0], generator=g)[:max_tokens]]
        out.append(X)
    if return_resid:
        return out, [e / max(n, 1) for e, n in resid]
    return out


def per_token_threshold(scores: torch.Tensor, act_sparsity: float) -> tuple[float, float]:
    """``τ`` from ``|scores| [N, I]``: the median over tokens of each token's
    ``k``-th smallest magnitude, ``k = round(s I)`` (so ``|score| > τ`` skips ``k``
    coefficients of the median token). Returns ``(τ, realised sparsity on scores)``."""
    a = scores.abs()
    n_skip = int(round(act_sparsity * a.shape[-1]))
    if n_skip <= 0:
        return -1.0, 0.0
    kth = a.kthvalue(n_skip, dim=-1).values
    tau = float(kth.median())
    return tau, float((a <= tau).float().mean())


def lowrank_factors(W: torch.Tensor, X: torch.Tensor, rank: int,
                    damp: float = 1e-2) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal rank-``r`` ``V [H, r], U [r, I]`` with ``x V U ≈ x W^T`` on the rows of ``X``.

    Reduced-rank regression: with ``C = X^T X / N + λ I = Q diag(l) Q^T``, the best
    rank-``r`` approximation of ``X W^T`` through ``X`` is ``V = Q l^{-1/2} A_r``,
    ``U = S_r B_r^T`` where ``A S B^T`` is the SVD of ``diag(l^{1/2}) Q^T W^T``
    (``λ = damp * mean(diag C)``).
    """
    X = X.double()
    C = X.T @ X / X.shape[0]
    C += damp * C.diagonal().mean() * torch.eye(C.shape[0], dtype=C.dtype)
    lam, Q = torch.linalg.eigh(C)
    lam = lam.clamp_min(1e-12)
    M = (lam.sqrt()[:, None] * (Q.T @ W.double().T)).float()          # [H, I]
    A, S, Bt = torch.linalg.svd(M, full_matrices=False)
    A, S, Bt = A.double(), S.double(), Bt.double()
    r = min(rank, S.numel())
    V = Q @ (A[:, :r] / lam.sqrt()[:, None])                          # [H, r]
    U = S[:r, None] * Bt[:r]                                          # [r, I]
    return V.float().contiguous(), U.float().contiguous()


def pooled_threshold(scores: torch.Tensor, act_sparsity: float) -> tuple[float, float]:
    """``τ`` from ``|scores| [N, I]``: the value at or below which a fraction ``s`` of all
    calibration coefficients (pooled over tokens) fall, so the *mean* token skips ``s``
    (each token's count varies with its context, which the oracle study found better
    than a fixed per-token count). Returns ``(τ, realised sparsity on scores)``."""
    a = scores.abs().flatten()
    k = int(round(act_sparsity * a.numel()))
    if k <= 0:
        return -1.0, 0.0
    tau = float(a.kthvalue(k).values)
    return tau, float((a <= tau).float().mean())


def train_predictor(mlp, X: torch.Tensor, pred: dict, *, epochs: int, weight=None,
                    lr: float = 2e-3, batch: int = 256, seed: int = 0) -> dict:
    """Fine-tune a D predictor (``act(x Vg Ug) ⊙ (x Vu Uu)``) to regress the true direct
    coefficient ``c = act(gate(x)) ⊙ up(x)``.

    Loss: ``mean(((ĉ - c) ⊙ w)²) / mean((c ⊙ w)²)`` over the rows of ``X`` with ``w [I]``
    the L2 norm of each ``W_down`` column (the true size of a term of the down
    projection), so large, consequential coefficients dominate. Adam with a one-cycle
    learning-rate schedule, starting from the reduced-rank-regression factors ``pred``.

    Args:
        X: ``[N, H]`` float32 MLP inputs (dense model, calibration data).
        pred: ``{"v_gate", "u_gate", "v_up", "u_up"}`` initial factors.
        epochs: passes over ``X`` (``0`` returns ``pred`` unchanged).

    Returns:
        the trained factors (float32, same shapes), detached.
    """
    if epochs <= 0:
        return pred
    keys = ("v_gate", "u_gate", "v_up", "u_up")
    w = torch.ones(pred["u_up"].shape[1]) if weight is None else weight.float()
    with torch.no_grad():
        C = _act(mlp, mlp.gate_proj(X)) * mlp.up_proj(X)
        norm = max(float((C * w).pow(2).mean()), 1e-30)
    ps = [pred[k].detach().clone().float().requires_grad_(True) for k in keys]
    nb = max(1, X.shape[0] // batch)
    opt = torch.optim.Adam(ps, lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * nb)
    g = torch.Generator().manual_seed(seed)
    with torch.enable_grad():
        for _ in range(epochs):
            perm = torch.randperm(X.shape[0], generator=g)
            for b in range(nb):
                j = perm[b * batch:(b + 1) * batch]
                x = X[j]
                ch = _act(mlp, x @ ps[0] @ ps[1]) * (x @ ps[2] @ ps[3])
                loss = ((ch - C[j]) * w).pow(2).mean() / norm
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
    return {k: t.detach().contiguous() for k, t in zip(keys, ps)}


def _greedy_allocation(acc: dict, grid: list, target: float, L: int) -> list:
    """Per-layer sparsities on ``grid`` with mean ``target``: repeatedly raise the layer
    whose relative output error grows least (``acc[level]["err"][layer]``)."""
    step = grid[1] - grid[0]
    n_steps = int(round(target * L / step))
    lvl = [0] * L

    def err(li, j):
        return 0.0 if j == 0 else acc[grid[j]]["err"][li]

    for _ in range(n_steps):
        best, bi = None, None
        for li in range(L):
            if lvl[li] + 1 >= len(grid):
                continue
            d = err(li, lvl[li] + 1) - err(li, lvl[li])
            if best is None or d < best:
                best, bi = d, li
        if bi is None:
            break
        lvl[bi] += 1
    return [grid[j] for j in lvl]


@torch.no_grad()
def calibrate_fields(model, calib_ids: torch.Tensor, sparsities, mode: str = "m", *,
                     rank: int = DEFAULT_RANK, max_tokens: int = 8192, seed: int = 0,
                     progress: bool = False, allocation: str = "uniform",
                     err_tokens: int = 256, channel_scale: str = "gate_down",
                     threshold_rule: str = "pooled", train_epochs: Optional[int] = None,
                     stat_tokens: int = 8192, predictor: str = DEFAULT_PREDICTOR) -> list:
    """The fields of one :class:`~edgeprune.countdown.CountdownSpec` per act-sparsity
    (``edgeprune.countdown.calibrate_many``, which documents the arguments, builds the
    specs from them): ``[{"mode", "act_sparsity", "thresholds", "rank", "predictors",
    "activation", "stats"}]`` in the order of ``sparsities``.
    """
    if allocation not in ("uniform", "greedy"):
        raise ConfigError(f"allocation={allocation!r} is unknown", "use 'uniform' or 'greedy'")
    if channel_scale not in ("gate_down", "none"):
        raise ConfigError(f"channel_scale={channel_scale!r} is unknown",
                          "use 'gate_down' (E|act(gate)| * ||W_down col||) or 'none' (paper)")
    if predictor not in PREDICTORS:
        raise ConfigError(f"predictor={predictor!r} is unknown",
                          "use 'q4' (4-bit copy of gate/up) or 'lowrank'")
    if threshold_rule not in ("pooled", "median"):
        raise ConfigError(f"threshold_rule={threshold_rule!r} is unknown",
                          "use 'pooled' or 'median'")
    epochs = DEFAULT_TRAIN_EPOCHS if train_epochs is None else train_epochs
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0:
        raise ConfigError(f"train_epochs={train_epochs!r} must be a non-negative integer",
                          "use e.g. train_epochs=4 (0 = closed-form predictor)")
    thr_fn = pooled_threshold if threshold_rule == "pooled" else per_token_threshold
    ss = [check_act_sparsity(a) for a in sparsities]
    mode = check_mode(mode)
    mlps = gated_mlps(model)
    if not isinstance(calib_ids, torch.Tensor) or calib_ids.dim() != 2 or calib_ids.numel() == 0:
        raise CalibrationError("calibration ids must be a non-empty int64 [nsamples, seqlen] tensor",
                               "build them with edgeprune.calibration.build_calibration")
    if mode == "d" and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise ConfigError(f"rank={rank!r} must be a positive integer", "use e.g. rank=64")
    t0 = time.perf_counter()
    I = mlps[0].up_proj.out_features
    H = mlps[0].up_proj.in_features
    act_name = type(mlps[0].act_fn).__name__.lower().replace("activation", "")
    L = len(mlps)
    todo = [s for s in ss if s > 0]
    grid = [round(0.05 * j, 2) for j in range(20)] if allocation == "greedy" else []
    levels = sorted(set(todo) | set(g for g in grid if g > 0))
    acc = {s: {"taus": [], "real": [], "recall": [], "l1": [], "err": []} for s in levels}
    preds = []
    X_all, resid = collect_mlp_inputs(model, calib_ids, max_tokens, seed,
                                      return_resid=True) if todo else ([], [])
    it = range(L) if todo else []
    if progress and todo:
        from tqdm.auto import tqdm
        it = tqdm(it, desc=f"countdown-{mode} calibrate", unit="layer")
    for i in it:
        mlp, Xf = mlps[i], X_all[i]
        X = Xf[:stat_tokens]
        Xd = X.to(mlp.up_proj.weight.dtype).to(mlp.up_proj.weight.device)
        u = mlp.up_proj(Xd).float().cpu()
        c = (_act(mlp, mlp.gate_proj(Xd)).float().cpu() * u)
        Wd = mlp.down_proj.weight.detach().float().cpu()
        dn = Wd.norm(dim=0)                                              # [I]
        if mode == "m":
            pred = None
            if channel_scale == "gate_down":
                f = _act(mlp, mlp.gate_proj(Xd)).float().cpu().abs().mean(0) * dn
                pred = {"channel_scale": f.contiguous()}
                preds.append(pred)
            score = m_score(u, pred)
        elif predictor == "q4":
            pred = q4_predictor(mlp)
            preds.append(pred)
            score = predictor_score(pred, X, lambda t: _act(mlp, t))
        else:
            Vg, Ug = lowrank_factors(mlp.gate_proj.weight.detach().float().cpu(), Xf, rank)
            Vu, Uu = lowrank_factors(mlp.up_proj.weight.detach().float().cpu(), Xf, rank)
            pred = {"v_gate": Vg, "u_gate": Ug, "v_up": Vu, "u_up": Uu}
            if epochs:
                pred = train_predictor(mlp, Xf.to(Wd.device), pred, epochs=epochs, weight=dn,
                                       seed=seed + i)
                # fold ||W_down[:, j]|| into the up factor: the score is then the predicted
                # size of term j of the down projection (same graph, no extra tensor)
                pred["u_up"] = (pred["u_up"] * dn[None]).contiguous()
            preds.append(pred)
            score = predictor_score(pred, X, lambda t: _act(mlp, t))
        ca = c.abs()
        order = ca.argsort(dim=-1, descending=True) if len(levels) > 3 else None
        ne = min(err_tokens, c.shape[0])
        for s in levels:
            n_keep = I - int(round(s * I))
            top = order[:, :n_keep] if order is not None else ca.topk(n_keep, dim=-1).indices
            true_top = torch.zeros_like(c, dtype=torch.bool).scatter_(-1, top, True)
            tau, rs = thr_fn(score, s)
            keep = score.abs() > tau
            a = acc[s]
            a["taus"].append(tau)
            a["real"].append(rs)
            a["recall"].append(float((keep & true_top).sum() / true_top.sum()))
            # fraction of |c| mass (L1) kept: how much of the down projection's input survives
            a["l1"].append(float((ca * keep).sum() / ca.sum().clamp_min(1e-30)))
            if grid:
                dy = (c[:ne] * (~keep[:ne])) @ Wd.T
                a["err"].append(float(dy.pow(2).sum(-1).mean()) / max(resid[i], 1e-30))
        del Xd, u, c, ca, order, Wd, X, Xf
    secs = round(time.perf_counter() - t0, 2)
    n_tok = int(X_all[0].shape[0]) if X_all else 0
    mlp_bytes = 3 * H * I * 4
    out = []
    for s in ss:
        if s == 0.0:
            out.append(dict(mode=mode, act_sparsity=0.0, thresholds=[-1.0] * L,
                            rank=rank if mode == "d" and predictor == "lowrank" else None,
                            predictors=None, activation=act_name,
                            stats={"realised_sparsity": [0.0] * L, "realised_sparsity_mean": 0.0,
                                   "calibration_s": 0.0}))
            continue
        if allocation == "greedy":
            per = _greedy_allocation(acc, grid, s, L)
            a = {k: [acc[per[li]][k][li] if per[li] > 0 else
                     {"taus": -1.0, "real": 0.0, "recall": 1.0, "l1": 1.0, "err": 0.0}[k]
                     for li in range(L)] for k in ("taus", "real", "recall", "l1", "err")}
        else:
            per = [s] * L
            a = acc[s]
        stats: dict[str, Any] = {
            "allocation": allocation, "layer_act_sparsity": [round(p, 3) for p in per],
            "realised_sparsity": [round(r, 4) for r in a["real"]],
            "realised_sparsity_mean": round(sum(a["real"]) / L, 4),
            "recall_top": [round(r, 4) for r in a["recall"]],
            "recall_top_mean": round(sum(a["recall"]) / L, 4),
            "coef_l1_kept_mean": round(sum(a["l1"]) / L, 4),
            "calibration_tokens_per_layer": n_tok,
            "threshold_tokens_per_layer": min(n_tok, stat_tokens),
            "calibration_s": secs,
            "threshold_rule": (
                "pooled: s-quantile of all calibration scores" if threshold_rule == "pooled"
                else "median over tokens of the per-token k-th smallest |score|, "
                     "k = round(s * intermediate_size)"),
        }
        if mode == "m":
            stats["score"] = ("|up_j(x) * f_j|, f_j = E|act(gate_j(x))| * ||W_down[:, j]||"
                              if channel_scale == "gate_down" else "|up_j(x)| (paper)")
            stats["channel_scale_bytes_per_layer"] = I * 4 if channel_scale == "gate_down" else 0
        if mode == "d" and predictor == "q4":
            pbytes = predictor_bytes(preds[0])
            stats.update(predictor=f"4-bit RTN asym g{Q4_GROUP} copy of gate and up: "
                                   "|act(x Wg^T) * (x Wu^T)| * ||W_down col||",
                         predictor_bytes_per_layer=pbytes, mlp_bytes_per_layer_fp32=mlp_bytes,
                         predictor_fraction_of_mlp=round(pbytes / mlp_bytes, 4))
        elif mode == "d":
            pbytes = 2 * (H * rank + rank * I) * 4
            stats.update(predictor="low-rank act(x Vg Ug) * (x Vu Uu): reduced-rank regression "
                                   "of gate and up" + (
                                       f", then {epochs} epochs of Adam regressing the direct "
                                       "coefficient weighted by ||W_down col|| (folded into Uu)"
                                       if epochs else ""),
                         predictor_train_epochs=epochs,
                         predictor_bytes_per_layer=pbytes, mlp_bytes_per_layer_fp32=mlp_bytes,
                         predictor_fraction_of_mlp=round(pbytes / mlp_bytes, 4))
        out.append(dict(mode=mode, act_sparsity=s, thresholds=a["taus"],
                        rank=rank if mode == "d" and predictor == "lowrank" else None,
                        predictors=preds or None, activation=act_name, stats=stats))
    return out


__all__ = ["calibrate_fields", "q4_predictor", "predictor_bytes", "collect_mlp_inputs",
           "per_token_threshold", "pooled_threshold", "lowrank_factors", "train_predictor"]
