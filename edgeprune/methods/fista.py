"""FISTAPruner: Layer-wise Post-training Pruning for Large Language Models
(Zhao, Hu, Li, Zheng, Wang & Yuan, 2024).

Each target linear of a decoder block is pruned by solving the convex (LASSO-type) model

    min_W  1/2 || W X - W* X* ||_F^2 + lambda || W ||_1                         (1)

with FISTA, the accelerated proximal gradient method (Beck & Teboulle 2009), where ``W*``
is the dense weight, ``X*`` the layer's input in the *dense* block and ``X`` its input in
the block whose earlier linears are already pruned: the cumulative-error-elimination of
the paper (each layer is fitted to the dense block's output, so it compensates the error
its pruned predecessors in the block made). With ``G = X^T X`` and ``B = W* X*^T X``
(``[in, in]``, ``[out, in]``, over the calibration tokens) the smooth part is
``f(W) = 1/2 tr(W G W^T) - tr(B W^T) + const`` and ``grad f = W G - B``.

Per layer (:func:`fista_prune`):

1. **lambda by bisection** (geometric, from ``lambda_0 = L q``, ``q`` the target quantile
   of ``|W*_ij| G_jj`` in the preconditioned variable below, where one proximal step from
   ``W*`` zeroes that fraction; x4 / /4 until the target is bracketed): for each
   ``lambda``, ``iters`` FISTA steps from the same start on a random subset of
   ``search_rows`` rows (rows are independent in (1)); stop when the solution's zeros
   are within ``lambda_tol`` (a fraction of the weights) of the target count
   ``round(sparsity x out x in)`` (N:M: ``1 - n/m``), after at most ``lambda_steps``
   tries, else :class:`CompressionError` naming the layer. Every try starts from the
   same point with the same step count, so the zeros are a (nearly) monotone function
   of ``lambda`` and the bisection is sound even when ``iters`` steps do not converge
   on an ill-conditioned layer.
2. **Solve** (1) at that ``lambda`` on every row (``iters`` steps from the same start).
3. **Exact pattern**: keep the largest ``|W_ij| sqrt(G_jj)`` of the solution: exactly
   ``round(sparsity x out x in)`` zeros per layer, or ``prune_n`` of every ``prune_m``.
4. **Refit** the kept weights: ``f`` minimized over the mask by conjugate gradients
   (every row its own least-squares system, ``refine_iters`` steps), which removes the L1
   shrinkage of the kept weights.
5. **Keep the better** of that solution and the warm start (refit on its own pattern the
   same way) by ``f``: the layer's reconstruction error never exceeds the warm start's.

FISTA runs in the monotone form (MFISTA: an iterate is kept only when it lowers the
objective, so the objective never increases) on the diagonally preconditioned variable
``U = W diag(d)``, ``d_j = sqrt(G_jj)`` (the same minimizer, a much smaller condition
number when a few input channels carry large activations); the L1 term becomes a
weighted one, ``lambda sum_ij |U_ij| / d_j``, whose proximal step is still a soft
threshold. One ``[out, in] x [in, in]`` product per step.

Warm start (``warm_start``): ``"sparsegpt"`` (default) starts FISTA from SparseGPT's
solution (:func:`~edgeprune.methods.sparsegpt.sparsegpt_prune`) of the error-corrected
target ``W~ = W* + (B - W* G) (G + delta I)^-1`` (the dense fit of ``W* X*`` on ``X``, damped
only in the correction: where no pruned predecessor changed the input, ``B = W* G`` and
``W~ = W*`` exactly, while the damped solve ``B (G + delta I)^-1`` shrinks ``W*`` along ``G``'s
weak directions; on SmolLM2-135M at 50 % the undamped form took WikiText-2 perplexity from 58.68
to 56.44, ``bench/compare_methods.py --cases fista_50``); ``"wanda"`` from the
Wanda-pruned weights; ``"dense"`` from ``W*`` (the paper's). Measured on SmolLM2-135M
(block 3, no error correction, relative layer error ``||W*X - WX||^2 / ||W*X||^2``,
50 %): o_proj SparseGPT 0.0190, dense-start FISTA 0.0208 (20 steps) / 0.0203 (100 steps),
SparseGPT refit 0.0147, SparseGPT-start FISTA 0.0140; down_proj SparseGPT 0.0444,
SparseGPT refit 0.0378, SparseGPT-start FISTA 0.0551: the SparseGPT start converges to a
better pattern in fewer steps than the dense start, and step 5 keeps the refit SparseGPT
pattern where the L1 pattern is worse. Weights an earlier stage pruned stay zero
throughout.

Within a block the linears are pruned in forward order (``[q,k,v]``, ``[o]``,
``[gate,up]``, ``[down]``), each group's ``G`` and ``B`` gathered after the groups before
it were pruned; layers reading one input share ``G`` and ``B``'s ``X^T X*`` factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..errors import CompressionError, ConfigError
from .base import LayerResult, LayerTask, Method, keep_mask_from_score, pattern_name, single_thread
from .config import PruneOptions
from .registry import register_method

_WARM = ("sparsegpt", "wanda", "dense")


@dataclass
class FISTAConfig(PruneOptions):
    """FISTAPruner settings (``sparsity``, ``prune_n``, ``prune_m`` from :class:`PruneOptions`).

    ``iters``: FISTA steps per ``lambda`` tried and for the final solve. ``refine_iters``:
    steps of the refit on the final mask. ``lambda_steps`` / ``lambda_tol``: the bisection's
    tries and the fraction of the layer's weights its solution may miss the target count by
    (the exact pattern is then imposed). ``search_rows``: rows the bisection solves on
    (``0``: all). ``error_correction``: fit the dense block's outputs (the paper's
    cumulative-error elimination; off: ``X* = X``). ``warm_start``: ``"sparsegpt"``
    (default), ``"wanda"`` or ``"dense"`` (see the module docstring); ``percdamp``: the
    damping of the SparseGPT warm start and of the error-corrected target. ``seed``: the
    bisection's row subset.
    """

    iters: int = 10
    refine_iters: int = 40
    lambda_steps: int = 16
    lambda_tol: float = 0.03
    search_rows: int = 128
    error_correction: bool = True
    warm_start: str = "sparsegpt"
    percdamp: float = 0.01
    seed: int = 0
    method = "fista"

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a bad sparsity, step count, tolerance or warm start."""
        super().validate()
        for attr in ("iters", "lambda_steps"):
            if getattr(self, attr) < 1:
                raise ConfigError(f"fista {attr}={getattr(self, attr)} must be >= 1", f"use e.g. {attr}=20")
        for attr in ("refine_iters", "search_rows"):
            if getattr(self, attr) < 0:
                raise ConfigError(f"fista {attr}={getattr(self, attr)} must be >= 0", f"use e.g. {attr}=40")
        if not self.percdamp >= 0:
            raise ConfigError(f"fista percdamp={self.percdamp} must be >= 0", "use 0.01")
        if not 0 < self.lambda_tol < 1:
            raise ConfigError(f"fista lambda_tol={self.lambda_tol} must be in (0, 1)", "use e.g. 0.02")
        if self.warm_start not in _WARM:
            raise ConfigError(f"fista warm_start={self.warm_start!r} is unknown", f"use one of {', '.join(_WARM)}")


def lasso_objective(W: torch.Tensor, G: torch.Tensor, B: torch.Tensor, lam: float) -> float:
    """``1/2 tr(W G W^T) - tr(B W^T) + lambda ||W||_1``: objective (1) without its constant.

    Args:
        W: ``[out, in]``; G: ``[in, in]`` ``X^T X``; B: ``[out, in]`` ``W* X*^T X``.
    """
    W = W.double()
    return float(0.5 * ((W @ G.double()) * W).sum() - (B.double() * W).sum() + lam * W.abs().sum())


class _Problem:
    """Objective (1) in the preconditioned variable ``U = W diag(d)``: ``Gp = D^-1 G D^-1``,
    ``Bp = B D^-1``, L1 weights ``lambda / d_j``, step ``1 / L`` with ``L = ||Gp||_2``."""

    def __init__(self, G: torch.Tensor, B: torch.Tensor):
        G = G.float()
        diag = torch.diagonal(G).clone()
        self.d = torch.where(diag > 0, diag.sqrt(), torch.ones_like(diag))  # dead channels: d = 1
        self.Gp = G / self.d[:, None] / self.d[None, :]
        self.Bp = B.float() / self.d[None, :]
        self.L = float(torch.linalg.eigvalsh(self.Gp.double()).max().clamp(min=1e-12))

    def rows(self, idx: Optional[torch.Tensor]) -> "_Problem":
        if idx is None:
            return self
        sub = object.__new__(_Problem)
        sub.d, sub.Gp, sub.L, sub.Bp = self.d, self.Gp, self.L, self.Bp[idx]
        return sub

    def objective(self, U, UG, lam: float) -> float:
        return float(0.5 * (UG * U).sum() - (self.Bp * U).sum() + lam * (U.abs() / self.d).sum())

    def solve(self, U0: torch.Tensor, lam: float, iters: int, keep: Optional[torch.Tensor] = None,
              history: Optional[list] = None) -> torch.Tensor:
        """MFISTA on ``F(U) = 1/2 tr(U Gp U^T) - tr(Bp U^T) + lam sum |U_ij| / d_j`` with
        ``U`` zero outside ``keep``; ``history`` receives ``F`` of each iterate."""
        thr = (lam / self.L) / self.d[None, :]
        x = U0 if keep is None else U0 * keep
        xG = x @ self.Gp
        fx = self.objective(x, xG, lam)
        y, yG, t = x, xG, 1.0
        if history is not None:
            history.append(fx)
        for _ in range(iters):
            v = y - (yG - self.Bp) / self.L
            z = torch.sign(v) * torch.clamp(v.abs() - thr, min=0) if lam > 0 else v
            if keep is not None:
                z = z * keep
            zG = z @ self.Gp
            fz = self.objective(z, zG, lam)
            t1 = (1 + math.sqrt(1 + 4 * t * t)) / 2
            if fz <= fx:
                xn, xnG, fx = z, zG, fz
            else:
                xn, xnG = x, xG
            a, b = t / t1, (t - 1) / t1
            y = xn + a * (z - xn) + b * (xn - x)
            yG = xnG + a * (zG - xnG) + b * (xnG - xG)
            x, xG, t = xn, xnG, t1
            if history is not None:
                history.append(fx)
        return x

    def refit(self, U: torch.Tensor, keep: torch.Tensor, iters: int) -> torch.Tensor:
        """Minimize ``1/2 tr(U Gp U^T) - tr(Bp U^T)`` over ``U`` zero outside ``keep`` by
        conjugate gradients, every row its own system ``Gp[S, S] u = Bp[S]`` (``S`` the
        row's kept inputs); ``iters`` steps from ``U``."""
        k = keep.to(U.dtype)
        U = U * k
        r = (self.Bp - U @ self.Gp) * k
        p = r.clone()
        rr = (r * r).sum(1, keepdim=True)
        for _ in range(iters):
            Ap = (p @ self.Gp) * k
            pAp = (p * Ap).sum(1, keepdim=True)
            alpha = torch.where(pAp > 0, rr / pAp.clamp(min=1e-30), torch.zeros_like(pAp))
            U = U + alpha * p
            r = r - alpha * Ap
            rr_new = (r * r).sum(1, keepdim=True)
            beta = torch.where(rr > 0, rr_new / rr.clamp(min=1e-30), torch.zeros_like(rr))
            p = r + beta * p
            rr = rr_new
        return U


def fista_lasso(W0: torch.Tensor, G: torch.Tensor, B: torch.Tensor, lam: float, iters: int,
                history: Optional[list] = None) -> torch.Tensor:
    """Solve (1) for a fixed ``lambda`` by monotone FISTA (preconditioned, see module docstring).

    Args:
        W0: ``[out, in]`` starting point; G: ``[in, in]``; B: ``[out, in]``; lam: ``>= 0``.
        iters: FISTA steps. history: receives the objective (:func:`lasso_objective`) of
            every iterate, starting point included (non-increasing).

    Returns:
        ``[out, in]`` float32 solution.
    """
    p = _Problem(G, B)
    U = p.solve(W0.float() * p.d[None, :], lam, iters, history=history)
    return U / p.d[None, :]


def fista_prune(W: torch.Tensor, G: torch.Tensor, B: Optional[torch.Tensor] = None, *, sparsity: float = 0.5,
                prune_n: int = 0, prune_m: int = 0, iters: int = 10, refine_iters: int = 40,
                lambda_steps: int = 16, lambda_tol: float = 0.03, search_rows: int = 128,
                mask: Optional[torch.Tensor] = None, warm: Optional[torch.Tensor] = None,
                warm_keep: Optional[torch.Tensor] = None, seed: int = 0,
                name: str = "layer") -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Prune ``W`` with FISTAPruner (steps 1-5 of the module docstring).

    Args:
        W: ``[out, in]`` dense weight ``W*``. G: ``[in, in]`` ``X^T X / n``.
        B: ``[out, in]`` ``W* X*^T X / n`` (``None``: ``W G``, no error correction).
        sparsity: fraction removed (unstructured); ignored when ``prune_n`` is set.
        prune_n, prune_m: N:M pattern. iters, refine_iters, lambda_steps, lambda_tol,
        search_rows: see :class:`FISTAConfig`.
        mask: earlier ``bool [out, in]`` keep-mask; pruned weights stay zero.
        warm: starting point of FISTA (default ``W``).
        warm_keep: the pattern of a pruned ``warm`` (which then is a candidate too: refit
            on its own pattern, kept when its objective is lower, step 5).

    Returns:
        ``(W_new [out, in], keep bool [out, in], info)`` with ``info = {"lambda",
        "lambda_zeros"`` (fraction of zeros of the lambda solution), ``"tries"``,
        ``"chose"``: ``"fista"`` or ``"warm"``, ``"objective"``: ``{candidate: f}}``.

    Raises:
        CompressionError: the bisection could not bring the solution's zeros within
            ``lambda_tol`` of the target (names the layer).
    """
    W = W.float()
    out, inp = W.shape
    B = W @ G.float() if B is None else B
    p = _Problem(G, B)
    frac = (1 - prune_n / prune_m) if prune_n else sparsity
    keep0 = None if mask is None else mask.to(W.device, torch.bool)
    U = (W if warm is None else warm.float()) * p.d[None, :]
    if keep0 is not None:
        U = U * keep0
    g = torch.Generator().manual_seed(seed)
    idx = None
    if 0 < search_rows < out:
        idx = torch.randperm(out, generator=g)[:search_rows].sort().values.to(W.device)
    sub = p.rows(idx)
    Us = U if idx is None else U[idx]
    ks = None if keep0 is None else (keep0 if idx is None else keep0[idx])
    target = frac * Us.numel()
    score0 = (W.abs() * p.d[None, :] ** 2).flatten()
    lam = p.L * float(torch.quantile(score0[torch.randperm(score0.numel(), generator=g)[:1_000_000]
                                            .to(W.device)], min(max(frac, 0.0), 1.0)))
    lam = max(lam, 1e-12)
    lo = hi = None
    zeros = None
    tries = 0
    with single_thread(W.device):
        for tries in range(1, lambda_steps + 1):
            Ul = sub.solve(Us, lam, iters, keep=ks)
            zeros = int((Ul == 0).sum())
            if abs(zeros - target) <= lambda_tol * Us.numel():
                break
            if zeros < target:
                lo = lam
            else:
                hi = lam
            if lo is not None and hi is not None and hi < lo * 1.001:
                # the zeros jumped across the target within the bracket (ties): open it again
                lo, hi = (lo / 2, hi) if zeros > target else (lo, hi * 2)
            lam = math.sqrt(lo * hi) if lo is not None and hi is not None else (lam * 4 if hi is None else lam / 4)
        else:
            raise CompressionError(
                f"{name}: the lambda search did not reach sparsity {frac:.3f} in {lambda_steps} tries "
                f"(last lambda {lam:.3g}: {zeros / Ul.numel():.3f} zeros)",
                "raise lambda_steps, iters or lambda_tol in the fista settings")
        U = p.solve(U, lam, iters, keep=keep0)
        lam_zeros = float((U == 0).float().mean())
        keep = keep_mask_from_score(U.abs(), sparsity, prune_n, prune_m, keep0, per_row=False)
        U = p.refit(U, keep, refine_iters)
        info = {"lambda": lam, "lambda_zeros": lam_zeros, "tries": tries, "chose": "fista",
                "objective": {"fista": p.objective(U, U @ p.Gp, 0.0)}}
        if warm is not None and warm_keep is not None:
            wk = warm_keep.to(W.device, torch.bool)
            Uw = p.refit(warm.float() * p.d[None, :], wk, refine_iters)
            info["objective"]["warm"] = p.objective(Uw, Uw @ p.Gp, 0.0)
            if info["objective"]["warm"] < info["objective"]["fista"]:
                U, keep, info["chose"] = Uw, wk, "warm"
    return (U / p.d[None, :]) * keep, keep, info


def _grouped_calls(block: nn.Module, rel: dict, batch) -> list[list[str]]:
    from ..blocks import sequential_groups  # noqa: PLC0415 - blocks imports methods.base
    mods = dict(rel)
    return sequential_groups(block, mods, batch, tuple(mods))


class _Stop(Exception):
    pass


def _group_inputs(block: nn.Module, module: nn.Module, batch, weights: Optional[dict]) -> torch.Tensor:
    """The input ``[tokens, in]`` of ``module`` on one batch (valid tokens only), the block
    run with its own weights or with ``weights`` substituted; stops at ``module``."""
    seen = []

    def hook(mod, inp):
        seen.append(inp[0])
        raise _Stop

    h = module.register_forward_pre_hook(hook)
    try:
        if weights is None:
            block(batch[0], **batch[1])
        else:
            torch.func.functional_call(block, weights, (batch[0],), batch[1], strict=False)
    except _Stop:
        pass
    finally:
        h.remove()
    x = seen[0].reshape(-1, seen[0].shape[-1]).float()
    return x[batch[2].reshape(-1)]


@register_method(FISTAConfig)
class FISTA(Method):
    """FISTAPruner (:class:`FISTAConfig`): per block, its target linears in forward order,
    each by :func:`fista_prune` (:attr:`needs_block_inputs`: it runs the dense and the
    partly pruned block itself)."""

    needs_block_inputs = True
    needs_stats = False

    def __init__(self, config):
        super().__init__(config)
        #: layer name -> ``"fista"`` or ``"warm"``: which candidate each layer kept
        self.chosen: dict[str, str] = {}

    def compress_block(self, block: nn.Module, tasks: list[LayerTask], inputs=None) -> dict[str, LayerResult]:
        """Prune the target linears of ``block``.

        Args:
            block: the decoder block; the pruned weights are written into it as each group
                finishes (the later groups' inputs depend on them), and returned.
            tasks: the block's target linears.
            inputs: ``[[hidden [b, seqlen, d], kwargs, tokmask [b, seqlen]]]`` batches.

        Returns:
            ``{name: LayerResult}`` (pruned weight, keep-mask, pattern).
        """
        c = self.config
        rel = {next(n for n, m in block.named_modules() if m is t.module): t for t in tasks}
        dense = {n + ".weight": t.weight.clone() for n, t in rel.items()}
        if not inputs:
            raise CompressionError(f"{tasks[0].name}: fista needs calibration inputs", "pass calibration data")
        groups = _grouped_calls(block, {n: t.module for n, t in rel.items()}, inputs[0])
        out: dict[str, LayerResult] = {}
        for group in groups:
            G = K = None
            n_tok = 0
            for b in inputs:
                x = _group_inputs(block, rel[group[0]].module, b, None)
                xs = _group_inputs(block, rel[group[0]].module, b, dense) if c.error_correction else x
                ok = torch.isfinite(x).all(1) & torch.isfinite(xs).all(1)
                x, xs = x[ok], xs[ok]
                G = x.t() @ x if G is None else G.addmm_(x.t(), x)
                K = xs.t() @ x if K is None else K.addmm_(xs.t(), x)
                n_tok += x.shape[0]
            G, K = G / max(n_tok, 1), K / max(n_tok, 1)
            for n in group:
                t = rel[n]
                out[t.name] = self._prune(t, G, t.weight @ K, n_tok)
                t.module.weight.data.copy_(out[t.name].weight.to(t.module.weight.dtype))
        return out

    def _prune(self, t: LayerTask, G: torch.Tensor, B: torch.Tensor, n_tok: int) -> LayerResult:
        c = self.config
        if n_tok == 0 or not bool((torch.diagonal(G) > 0).any()):
            from .magnitude import magnitude_prune
            keep = magnitude_prune(t.weight, c.sparsity, c.prune_n, c.prune_m, t.mask)
            return LayerResult(weight=t.weight * keep, mask=keep, pattern=pattern_name(c),
                               notes=[f"{t.name}: no usable calibration activations -> magnitude"])
        warm, warm_keep = self._warm(t, G, B)
        w, keep, info = fista_prune(t.weight, G, B, sparsity=c.sparsity, prune_n=c.prune_n, prune_m=c.prune_m,
                                    iters=c.iters, refine_iters=c.refine_iters, lambda_steps=c.lambda_steps,
                                    lambda_tol=c.lambda_tol, search_rows=c.search_rows, mask=t.mask, warm=warm,
                                    warm_keep=warm_keep, seed=c.seed, name=t.name)
        self.chosen[t.name] = info["chose"]
        return LayerResult(weight=w, mask=keep, pattern=pattern_name(c))

    def _warm(self, t: LayerTask, G: torch.Tensor, B: torch.Tensor):
        """``(warm, warm_keep)``: SparseGPT's or Wanda's solution of the layer's target
        (with error correction, the dense fit ``W* + (B - W* G) (G + delta I)^-1``), or
        ``(None, None)``."""
        c = self.config
        if c.warm_start == "dense":
            return None, None
        if c.warm_start == "wanda":
            from .wanda import wanda_prune
            keep = wanda_prune(t.weight, torch.diagonal(G).clamp(min=0).sqrt(), c.sparsity, c.prune_n,
                               c.prune_m, t.mask)
            return t.weight * keep, keep
        from .obs import fix_dead_channels
        from .sparsegpt import sparsegpt_prune
        target = t.weight
        if c.error_correction:
            Gd = fix_dead_channels(G.float())
            Gd = Gd + max(c.percdamp, 1e-6) * float(torch.diagonal(Gd).mean()) * torch.eye(
                Gd.shape[0], device=Gd.device)
            L, info = torch.linalg.cholesky_ex(Gd)
            if int(info) == 0:
                target = t.weight + torch.cholesky_solve((B.float() - t.weight @ G.float()).t(), L).t()
        r = sparsegpt_prune(target, G, sparsity=c.sparsity, prune_n=c.prune_n, prune_m=c.prune_m,
                            percdamp=c.percdamp, mask=t.mask, name=t.name)
        return (None, None) if r is None else (r[0], r[1])


__all__ = ["FISTAConfig", "FISTA", "fista_prune", "fista_lasso", "lasso_objective"]
