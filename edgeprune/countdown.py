"""COUNTDOWN: contextual sparse-activation filtering of the MLP down projection.

COUNTDOWN (Cheon et al., EMNLP 2025) reads a gated MLP
``y = W_down (act(W_gate x) ⊙ W_up x)`` as a linear combination of the *columns* of
``W_down`` weighted by the coefficients ``c = act(W_gate x) ⊙ W_up x`` (``[I]`` per
token). For a given token most coefficients are negligible; skipping coefficient ``j``
skips reading row ``j`` of ``W_gate`` (and of ``W_up``) and column ``j`` of ``W_down``.

Two variants, both implemented here as an *exact* PyTorch reference (every position of a
teacher-forced window is filtered the way a decoded token would be):

* **M-COUNTDOWN** thresholds the *indirect* coefficient ``u = W_up x`` (computed in full):
  ``keep_j = |u_j| > τ_l``; only kept gate rows / down columns are computed. No
  predictor. ``τ_l`` (one per layer) is calibrated from the per-token ``k``-th smallest
  ``|u|`` at the target ratio (``k = round(s * I)``): ``τ_l`` = median over calibration
  tokens, so the median token skips exactly ``s`` of its coefficients.
* **D-COUNTDOWN** predicts the *direct* coefficient from the block input with a small
  per-layer low-rank predictor and thresholds it, so up and gate rows and down columns are
  all skipped. Predictor (our design; the paper trains a small predictor): data-aware
  low-rank factors of the gate and the up projection,
  ``ĉ = act(x V_g U_g) ⊙ (x V_u U_u)`` with ``V [H, r]``, ``U [r, I]`` the optimal
  rank-``r`` reduced-rank regression of ``W x`` on the calibration inputs (closed form:
  whiten ``x`` with its covariance, truncated SVD of the whitened weight), so the
  predictor has the same functional form as the coefficient it predicts.
  ``keep_j = |ĉ_j| > τ_l`` with ``τ_l`` calibrated like M's on ``|ĉ|``. Recall of the
  truly large coefficients (the top ``1 - s`` of ``|c|`` per token) is reported.

Act-sparsity ``s = 0`` keeps every coefficient (threshold ``-1``): the output equals the
dense model exactly.

Public API::

    spec = calibrate(model, calib_ids, act_sparsity=0.5, mode="m")   # -> CountdownSpec
    with apply_reference(model, spec):                               # filtered forward
        logits = model(ids).logits
    res = evaluate(model, tok, spec, text)                           # ppl / KL / top-1
    exporters.countdown.export_countdown(model, tok, out_dir, spec)  # ONNX (sparse decode)
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .errors import CalibrationError, CheckpointError, ConfigError, UnsupportedArchitectureError

MODES = ("m", "d")
DEFAULT_RANK = 64


# ----------------------------------------------------------------------------- checks
def check_act_sparsity(act_sparsity) -> float:
    """Validate ``act_sparsity`` (fraction of coefficients skipped per token).

    Raises:
        ConfigError: not a number in ``[0, 1)``.
    """
    try:
        s = float(act_sparsity)
    except (TypeError, ValueError):
        raise ConfigError(f"act_sparsity={act_sparsity!r} is not a number",
                          "pass a fraction in [0, 1), e.g. --act-sparsity 0.5") from None
    if not (0.0 <= s < 1.0) or math.isnan(s):
        raise ConfigError(f"act_sparsity={act_sparsity} is outside [0, 1)",
                          "pass the fraction of MLP coefficients to skip, e.g. 0.5 or 0.7")
    return s


def check_mode(mode) -> str:
    """Validate ``mode`` (``"m"`` or ``"d"``); raises :class:`ConfigError`."""
    m = str(mode).lower().replace("-countdown", "")
    if m not in MODES:
        raise ConfigError(f"countdown mode {mode!r} is unknown",
                          "use 'm' (M-COUNTDOWN, threshold on |up(x)|) or 'd' "
                          "(D-COUNTDOWN, low-rank predictor)")
    return m


def gated_mlps(model) -> list:
    """The MLP modules of every decoder layer, checked to be gated (SwiGLU-style).

    Returns:
        ``[layer.mlp]`` with ``gate_proj``, ``up_proj``, ``down_proj`` (``nn.Linear``)
        and ``act_fn``.

    Raises:
        UnsupportedArchitectureError: no ``model.model.layers``, or an MLP that is not
            gated (e.g. GPT-2 style ``fc -> act -> proj``), which COUNTDOWN's
            indirect/direct coefficient split does not apply to.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} has no model.layers",
            "COUNTDOWN supports llama/qwen2-style decoders (model.model.layers[i].mlp)")
    out = []
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        ok = mlp is not None and all(
            isinstance(getattr(mlp, n, None), torch.nn.Linear)
            for n in ("gate_proj", "up_proj", "down_proj")) and hasattr(mlp, "act_fn")
        if not ok:
            raise UnsupportedArchitectureError(
                f"layer {i} MLP ({type(mlp).__name__}) is not gated: COUNTDOWN needs "
                "down(act(gate(x)) * up(x)) with gate_proj/up_proj/down_proj linears",
                "use a SwiGLU model (llama, qwen2); non-gated MLPs are not supported")
        if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj")):
            raise UnsupportedArchitectureError(
                f"layer {i} MLP has biases on gate/up projections",
                "COUNTDOWN is implemented for bias-free gated MLPs (llama, qwen2)")
        out.append(mlp)
    return out


# ----------------------------------------------------------------------------- spec
@dataclass
class CountdownSpec:
    """Calibrated COUNTDOWN filter for one model.

    Attributes:
        mode: ``"m"`` (threshold on ``|up(x)|``) or ``"d"`` (threshold on a predictor).
        act_sparsity: target fraction ``s`` of coefficients skipped per token.
        thresholds: ``[num_layers]`` floats ``τ_l`` (``-1`` keeps everything).
        rank: predictor rank ``r`` (D only).
        predictors: D only: per layer ``{"v_gate": [H, r], "u_gate": [r, I],
            "v_up": [H, r], "u_up": [r, I]}`` float32 tensors.
        activation: the MLP's activation name (``"silu"``).
        stats: JSON-able calibration figures (realised sparsity per layer, recall,
            predictor bytes vs MLP bytes, calibration tokens, seconds).
    """

    mode: str
    act_sparsity: float
    thresholds: list
    rank: Optional[int] = None
    predictors: Optional[list] = None
    activation: str = "silu"
    stats: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.thresholds)

    def to_json(self) -> dict:
        """Everything but the predictor tensors (for ``edgeprune.json`` / reports)."""
        return {"method": "COUNTDOWN (Cheon et al., EMNLP 2025)",
                "mode": self.mode, "variant": f"{self.mode.upper()}-COUNTDOWN",
                "act_sparsity": self.act_sparsity,
                "thresholds": [float(t) for t in self.thresholds], "rank": self.rank,
                "activation": self.activation, "stats": self.stats}

    def predictor_arrays(self, i: int) -> dict:
        """Layer ``i``'s predictor as numpy float32 arrays (D mode)."""
        if not self.predictors:
            return {}
        return {k: v.detach().float().cpu().numpy() for k, v in self.predictors[i].items()}

    def save(self, path) -> Path:
        """Write ``countdown.json`` (+ ``countdown.safetensors`` for D) into folder ``path``
        atomically (temp names then rename)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.predictors:
            tens = {f"layers.{i}.{k}": v.detach().float().contiguous().cpu()
                    for i, p in enumerate(self.predictors) for k, v in p.items()}
            tmp = path / ".countdown.safetensors.tmp"
            save_file(tens, str(tmp))
            tmp.replace(path / "countdown.safetensors")
        tmp = path / ".countdown.json.tmp"
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path / "countdown.json")
        return path

    @classmethod
    def load(cls, path) -> "CountdownSpec":
        """Read a spec written by :meth:`save` (safetensors only, never pickle).

        Raises:
            CheckpointError: missing or unreadable files.
        """
        path = Path(path)
        try:
            meta = json.loads((path / "countdown.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path / 'countdown.json'}: {e}",
                                  "pass a folder written by CountdownSpec.save") from e
        preds = None
        if meta["mode"] == "d" and float(meta["act_sparsity"]) > 0:
            from safetensors.torch import load_file
            try:
                t = load_file(str(path / "countdown.safetensors"))
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"cannot read {path / 'countdown.safetensors'}: {e}",
                                      "re-run the calibration") from e
            preds = [{k: t[f"layers.{i}.{k}"] for k in ("v_gate", "u_gate", "v_up", "u_up")}
                     for i in range(len(meta["thresholds"]))]
        return cls(mode=meta["mode"], act_sparsity=float(meta["act_sparsity"]),
                   thresholds=list(meta["thresholds"]), rank=meta.get("rank"),
                   predictors=preds, activation=meta.get("activation", "silu"),
                   stats=meta.get("stats", {}))


# ----------------------------------------------------------------------- core math
def _act(mlp, x):
    return mlp.act_fn(x)


def predictor_score(pred: dict, x: torch.Tensor, act=F.silu) -> torch.Tensor:
    """D-COUNTDOWN score ``ĉ = act(x V_g U_g) ⊙ (x V_u U_u)``: ``[..., H] -> [..., I]``."""
    g = (x @ pred["v_gate"].to(x.dtype)) @ pred["u_gate"].to(x.dtype)
    u = (x @ pred["v_up"].to(x.dtype)) @ pred["u_up"].to(x.dtype)
    return act(g) * u


def keep_mask(mlp, x: torch.Tensor, mode: str, tau: float, pred: Optional[dict] = None,
              up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which coefficients of ``x [..., H]`` are kept: bool ``[..., I]``.

    M: ``|up(x)| > τ``; D: ``|ĉ(x)| > τ`` (:func:`predictor_score`). ``τ < 0`` keeps all.
    """
    if tau < 0:
        ref = mlp.up_proj(x) if up is None else up
        return torch.ones_like(ref, dtype=torch.bool)
    if mode == "m":
        u = mlp.up_proj(x) if up is None else up
        return u.abs() > tau
    return predictor_score(pred, x, lambda t: _act(mlp, t)).abs() > tau


def filtered_mlp(mlp, x: torch.Tensor, mode: str, tau: float, pred: Optional[dict] = None,
                 counter: Optional[list] = None) -> torch.Tensor:
    """Exact COUNTDOWN MLP: ``down((act(gate(x)) ⊙ up(x)) ⊙ keep)``, ``[..., H] -> [..., H]``.

    Computed densely then masked (the reference; the ONNX graph computes only the kept
    rows/columns, with the same result). ``counter`` (``[kept, total]``) accumulates counts.
    """
    u = mlp.up_proj(x)
    keep = keep_mask(mlp, x, mode, tau, pred, up=u)
    if counter is not None:
        counter[0] += int(keep.sum())
        counter[1] += keep.numel()
    c = _act(mlp, mlp.gate_proj(x)) * u
    return mlp.down_proj(c * keep.to(c.dtype))


@contextlib.contextmanager
def apply_reference(model, spec: CountdownSpec, counters: Optional[list] = None):
    """Patch every MLP of ``model`` with the exact COUNTDOWN filter (context manager).

    Inside the ``with`` block every position of every forward pass is filtered (the
    teacher-forced view of what each decoded token sees). The original ``forward`` is
    restored on exit, even on error.

    Args:
        model: llama/qwen2 causal LM (checked by :func:`gated_mlps`).
        spec: :class:`CountdownSpec` with one threshold per layer.
        counters: optional list, filled with one ``[kept, total]`` pair per layer.

    Raises:
        UnsupportedArchitectureError: non-gated MLP.
        ConfigError: the spec's layer count differs from the model's.
    """
    mlps = gated_mlps(model)
    if len(mlps) != spec.num_layers:
        raise ConfigError(f"the COUNTDOWN spec has {spec.num_layers} layers, the model "
                          f"{len(mlps)}", "calibrate the spec on this model")
    if spec.mode == "d" and spec.act_sparsity > 0 and not spec.predictors:
        raise ConfigError("D-COUNTDOWN spec without predictors", "calibrate with mode='d'")
    if counters is not None:
        counters.clear()
        counters.extend([0, 0] for _ in mlps)
    saved = []
    try:
        for i, mlp in enumerate(mlps):
            saved.append((mlp, mlp.__dict__.get("forward")))
            pred = spec.predictors[i] if spec.predictors else None
            cnt = counters[i] if counters is not None else None

            def fwd(x, _m=mlp, _t=float(spec.thresholds[i]), _p=pred, _c=cnt):
                return filtered_mlp(_m, x, spec.mode, _t, _p, _c)

            mlp.forward = fwd
        yield model
    finally:
        for mlp, old in saved:
            if old is None:
                mlp.__dict__.pop("forward", None)
            else:
                mlp.forward = old


# ----------------------------------------------------------------------- calibration
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


@torch.no_grad()
def calibrate(model, calib_ids: torch.Tensor, act_sparsity: float, mode: str = "m", *,
              rank: int = DEFAULT_RANK, max_tokens: int = 8192, seed: int = 0,
              progress: bool = False, allocation: str = "uniform") -> CountdownSpec:
    """Calibrate COUNTDOWN thresholds (and D predictors) on calibration windows.

    Args:
        model: llama/qwen2 causal LM with gated MLPs (fp32, eval mode; not modified).
        calib_ids: ``int64 [nsamples, seqlen]`` (``edgeprune.calibration``).
        act_sparsity: fraction ``s`` in ``[0, 1)`` of MLP coefficients skipped per token.
        mode: ``"m"`` (M-COUNTDOWN) or ``"d"`` (D-COUNTDOWN).
        rank: D predictor rank ``r`` (per gate and per up factor).
        max_tokens: calibration tokens used per layer (random subset).
        seed: seed of that subset.
        allocation: ``"uniform"`` (paper) or ``"greedy"`` per-layer sparsities with the
            same mean (see :func:`calibrate_many`).

    Returns:
        :class:`CountdownSpec`; ``stats`` holds the realised sparsity per layer on the
        calibration tokens and, for D, the recall of the true top-``(1-s)`` coefficients,
        and the predictor bytes vs MLP weight bytes.

    Raises:
        ConfigError: ``act_sparsity`` outside ``[0, 1)``, unknown mode, bad rank.
        UnsupportedArchitectureError: non-gated MLP.
        CalibrationError: empty calibration set.
    """
    return calibrate_many(model, calib_ids, [act_sparsity], mode, rank=rank,
                          max_tokens=max_tokens, seed=seed, progress=progress,
                          allocation=allocation)[0]


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
def calibrate_many(model, calib_ids: torch.Tensor, sparsities, mode: str = "m", *,
                   rank: int = DEFAULT_RANK, max_tokens: int = 8192, seed: int = 0,
                   progress: bool = False, allocation: str = "uniform",
                   err_tokens: int = 256) -> list:
    """:func:`calibrate` for several act-sparsities at once (one pass over the
    calibration data; D predictors shared, only the thresholds differ).

    Args:
        allocation: ``"uniform"`` (every layer skips ``s``; the paper's setting) or
            ``"greedy"`` (our extension: per-layer sparsities on a 0.05 grid whose mean is
            ``s``, chosen greedily to minimise the summed relative MLP output error
            ``E||Δy_l||² / E||h_l||²`` (``h_l`` the residual stream after layer ``l``),
            measured on ``err_tokens`` calibration tokens per layer).

    Returns:
        ``[CountdownSpec]`` in the order of ``sparsities``.
    """
    if allocation not in ("uniform", "greedy"):
        raise ConfigError(f"allocation={allocation!r} is unknown", "use 'uniform' or 'greedy'")
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
        mlp, X = mlps[i], X_all[i]
        Xd = X.to(mlp.up_proj.weight.dtype).to(mlp.up_proj.weight.device)
        u = mlp.up_proj(Xd).float().cpu()
        c = (_act(mlp, mlp.gate_proj(Xd)).float().cpu() * u)
        if mode == "m":
            score = u
        else:
            Vg, Ug = lowrank_factors(mlp.gate_proj.weight.detach().float().cpu(), X, rank)
            Vu, Uu = lowrank_factors(mlp.up_proj.weight.detach().float().cpu(), X, rank)
            pred = {"v_gate": Vg, "u_gate": Ug, "v_up": Vu, "u_up": Uu}
            preds.append(pred)
            score = predictor_score(pred, X, lambda t: _act(mlp, t))
        ca = c.abs()
        order = ca.argsort(dim=-1, descending=True) if len(levels) > 3 else None
        ne = min(err_tokens, c.shape[0])
        Wd = mlp.down_proj.weight.detach().float().cpu()
        for s in levels:
            n_keep = I - int(round(s * I))
            top = order[:, :n_keep] if order is not None else ca.topk(n_keep, dim=-1).indices
            true_top = torch.zeros_like(c, dtype=torch.bool).scatter_(-1, top, True)
            tau, rs = per_token_threshold(score, s)
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
        del Xd, u, c, ca, order, Wd
    secs = round(time.perf_counter() - t0, 2)
    mlp_bytes = 3 * H * I * 4
    out = []
    for s in ss:
        if s == 0.0:
            out.append(CountdownSpec(mode, 0.0, [-1.0] * L, rank if mode == "d" else None,
                                     None, act_name, {"realised_sparsity": [0.0] * L,
                                                      "realised_sparsity_mean": 0.0,
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
            "calibration_tokens_per_layer": int(X_all[0].shape[0]),
            "calibration_s": secs,
            "threshold_rule": "median over tokens of the per-token k-th smallest |score|, "
                              "k = round(s * intermediate_size)",
        }
        if mode == "d":
            pbytes = 2 * (H * rank + rank * I) * 4
            stats.update(predictor="low-rank reduced-rank regression of gate and up: "
                                   "act(x Vg Ug) * (x Vu Uu)",
                         predictor_bytes_per_layer=pbytes, mlp_bytes_per_layer_fp32=mlp_bytes,
                         predictor_fraction_of_mlp=round(pbytes / mlp_bytes, 4))
        out.append(CountdownSpec(mode, s, a["taus"], rank if mode == "d" else None,
                                 preds or None, act_name, stats))
    return out


# ----------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, tokenizer, spec: CountdownSpec, text=None, *, seqlen: int = 512,
             nwindows: Optional[int] = 40, progress: bool = False) -> dict:
    """Teacher-forced quality of the filtered model vs the same model unfiltered.

    Same protocol as :func:`edgeprune.evaluate.fidelity` (WikiText-2 style: no BOS,
    non-overlapping windows of ``seqlen``), with the filter applied at every position.

    Returns:
        ``{"ppl_dense", "ppl", "ppl_increase_pct", "kl", "top1_agree",
        "realised_sparsity", "protocol"}``; KL(dense || filtered) in nats/token,
        realised sparsity = fraction of coefficients skipped over all scored positions
        and layers.
    """
    return evaluate_many(model, tokenizer, [spec], text, seqlen=seqlen, nwindows=nwindows,
                         progress=progress)[0]


@torch.no_grad()
def evaluate_many(model, tokenizer, specs, text=None, *, seqlen: int = 512,
                  nwindows: Optional[int] = 40, progress: bool = False,
                  logits_fns: Optional[dict] = None) -> list:
    """:func:`evaluate` for several specs, computing the dense logits once per window.

    Args:
        logits_fns: optional ``{index: fn(ids [1,S]) -> logits}`` replacing the PyTorch
            reference of ``specs[index]`` (e.g. an always-sparse ONNX session), so the
            exported graph is scored under the same protocol.
    """
    from .evaluate import eval_windows

    windows, proto = eval_windows(tokenizer, text, seqlen=seqlen, nwindows=nwindows)
    n = len(specs)
    acc = [dict(kl=0.0, agree=0.0, nll=0.0, kept=0, total=0) for _ in range(n)]
    nll_d = 0.0
    it = windows
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(windows, desc="countdown eval", unit="win", leave=False)
    for w in it:
        ids = w[None]
        ld = F.log_softmax(model(ids, use_cache=False).logits[0, :-1].float(), -1)
        nll_d += F.nll_loss(ld, w[1:], reduction="sum").item()
        pd = ld.exp()
        for j, spec in enumerate(specs):
            counters: list = []
            if logits_fns and j in logits_fns:
                lo = logits_fns[j](ids)
                lo = lo if isinstance(lo, torch.Tensor) else torch.from_numpy(lo)
            else:
                with apply_reference(model, spec, counters):
                    lo = model(ids, use_cache=False).logits
            lm = F.log_softmax(lo[0, :-1].float(), -1)
            a = acc[j]
            a["kl"] += (pd * (ld - lm)).sum().item()
            a["agree"] += (ld.argmax(-1) == lm.argmax(-1)).sum().item()
            a["nll"] += F.nll_loss(lm, w[1:], reduction="sum").item()
            a["kept"] += sum(k for k, _ in counters)
            a["total"] += sum(t for _, t in counters)
    N = proto.ntokens_scored
    ppl_d = math.exp(nll_d / N)
    out = []
    for a in acc:
        ppl = math.exp(a["nll"] / N)
        out.append({"ppl_dense": ppl_d, "ppl": ppl, "ppl_increase_pct": 100.0 * (ppl / ppl_d - 1),
                    "kl": a["kl"] / N, "top1_agree": a["agree"] / N,
                    "realised_sparsity": (1.0 - a["kept"] / a["total"]) if a["total"] else None,
                    "protocol": proto.to_dict()})
    return out


__all__ = ["CountdownSpec", "calibrate", "calibrate_many", "evaluate_many", "apply_reference", "evaluate", "filtered_mlp",
           "keep_mask", "predictor_score", "lowrank_factors", "per_token_threshold",
           "collect_mlp_inputs", "gated_mlps", "check_act_sparsity", "check_mode", "MODES"]
