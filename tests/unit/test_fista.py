"""FISTAPruner (edgeprune.methods.fista): a monotone FISTA, its solution against a
reference solver, exact sparsity patterns, the lambda search and bad settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeprune.engine import compress
from edgeprune.errors import CompressionError, ConfigError
from edgeprune.methods.base import relative_error
from edgeprune.methods.fista import FISTAConfig, fista_lasso, fista_prune, lasso_objective
from edgeprune.methods.wanda import wanda_prune
from edgeprune.recipe import Recipe


def _calib(n=4, s=32, seed=1):
    return torch.randint(0, 256, (n, s), generator=torch.Generator().manual_seed(seed))


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n}


def _layer(out=24, inp=64, n=400, seed=0, outliers=4):
    """``W*``, ``X`` [n, in] with a few large-magnitude channels, ``G = X^T X / n``."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, inp, generator=g) * 0.1
    X = torch.randn(n, inp, generator=g) @ (torch.randn(inp, inp, generator=g) * 0.3 + torch.eye(inp))
    X[:, torch.randperm(inp, generator=g)[:outliers]] *= 10.0
    return W, X, X.t() @ X / n


def test_objective_decreases_monotonically_on_a_layer():
    W, X, G = _layer()
    Xs = X + 0.05 * torch.randn(X.shape, generator=torch.Generator().manual_seed(5))  # dense input X*
    B = W @ (Xs.t() @ X / X.shape[0])
    lam = 0.02
    hist: list = []
    sol = fista_lasso(W, G, B, lam, 200, history=hist)
    assert len(hist) == 201
    assert all(b <= a + 1e-9 * abs(a) for a, b in zip(hist, hist[1:]))
    assert hist[-1] < hist[0]
    assert abs(lasso_objective(sol, G, B, lam) - hist[-1]) <= 1e-4 * abs(hist[-1])
    assert float((sol == 0).float().mean()) > 0.05  # the L1 term zeroes weights


def test_solution_matches_a_reference_solver():
    """min 1/2 ||X W^T - Y||^2 + lam ||W||_1 on a tiny problem: FISTA vs L-BFGS-B on the
    split variables W = P - N (P, N >= 0), the LASSO's smooth reformulation."""
    from scipy.optimize import minimize

    W, X, G = _layer(out=3, inp=8, n=60, seed=2, outliers=1)
    n = X.shape[0]
    Y = X @ W.t() + 0.01 * torch.randn(n, 3, generator=torch.Generator().manual_seed(3))
    B = (Y.t() @ X) / n
    lam = 0.01
    ours = fista_lasso(torch.zeros_like(W), G, B, lam, 5000).double().numpy()

    Gd, Bd = G.double().numpy(), B.double().numpy()

    def f(z):
        P, Nn = z[:24].reshape(3, 8), z[24:].reshape(3, 8)
        Wz = P - Nn
        grad = Wz @ Gd - Bd
        val = 0.5 * np.sum((Wz @ Gd) * Wz) - np.sum(Bd * Wz) + lam * (P.sum() + Nn.sum())
        return val, np.concatenate([(grad + lam).ravel(), (-grad + lam).ravel()])

    r = minimize(f, np.zeros(48), jac=True, method="L-BFGS-B", bounds=[(0, None)] * 48,
                 options={"maxiter": 20000, "ftol": 1e-15, "gtol": 1e-12})
    ref = r.x[:24].reshape(3, 8) - r.x[24:].reshape(3, 8)
    np.testing.assert_allclose(ours, ref, atol=2e-4)
    assert lasso_objective(torch.from_numpy(ours), G, B, lam) <= lasso_objective(torch.from_numpy(ref), G, B, lam) + 1e-8
    assert np.array_equal(np.abs(ours) < 1e-6, np.abs(ref) < 1e-6)  # the same support


@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.7])
def test_exact_count_per_layer(sparsity):
    W, X, G = _layer(out=40, inp=96)
    w, keep, info = fista_prune(W, G, sparsity=sparsity, search_rows=16)
    assert int((~keep).sum()) == round(sparsity * W.numel())
    assert torch.equal(w != 0, keep & (w != 0)) and not bool((w[~keep] != 0).any())
    assert 0 < info["lambda"] and abs(info["lambda_zeros"] - sparsity) < 0.1


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4)])
def test_exact_nm_pattern(n, m):
    W, X, G = _layer(out=16, inp=64)
    w, keep, _ = fista_prune(W, G, prune_n=n, prune_m=m)
    assert torch.equal(keep.reshape(16, -1, m).sum(-1), torch.full((16, 64 // m), n))
    assert not bool((w[~keep] != 0).any())


def test_earlier_mask_stays_pruned():
    W, X, G = _layer(out=16, inp=64)
    prior = torch.rand(W.shape, generator=torch.Generator().manual_seed(1)) > 0.3
    w, keep, _ = fista_prune(W, G, sparsity=0.5, mask=prior)
    assert not bool((keep & ~prior).any()) and int((~keep).sum()) == round(0.5 * W.numel())


def test_beats_wanda_on_the_layer_reconstruction():
    W, X, G = _layer(out=32, inp=64)
    for kw in ({"sparsity": 0.5}, {"prune_n": 2, "prune_m": 4}):
        w, _, _ = fista_prune(W, G, **kw)
        wanda = W * wanda_prune(W, torch.diagonal(G).sqrt(), kw.get("sparsity", 0.5), kw.get("prune_n", 0),
                                kw.get("prune_m", 0))
        assert relative_error(W, w, G) < 0.7 * relative_error(W, wanda, G), kw


@pytest.mark.parametrize("cfg", [FISTAConfig(sparsity=0.5), FISTAConfig(sparsity=0.3, error_correction=False),
                                 FISTAConfig(prune_n=2, prune_m=4), FISTAConfig(prune_n=4, prune_m=8),
                                 FISTAConfig(sparsity=0.5, warm_start="wanda"),
                                 FISTAConfig(prune_n=2, prune_m=4, warm_start="dense", error_correction=False)],
                         ids=lambda c: f"{c.prune_n}:{c.prune_m}-{c.sparsity}-{c.warm_start}")
def test_engine_exact_patterns_per_layer(tiny_llama, cfg):
    res = compress(tiny_llama, cfg, _calib(), progress=False)
    lin = _linears(tiny_llama)
    assert set(res.masks) == set(lin)
    for name, mod in lin.items():
        w = mod.weight.detach()
        assert torch.equal(w != 0, res.masks[name] & (w != 0)), name
        if cfg.prune_n:
            assert int((w != 0).reshape(w.shape[0], -1, cfg.prune_m).sum(-1).max()) <= cfg.prune_n
            assert res.sparsity_pattern[name] == f"{cfg.prune_n}:{cfg.prune_m}"
            assert abs(res.sparsity()[name] - (1 - cfg.prune_n / cfg.prune_m)) < 1e-9
        else:
            assert int((~res.masks[name]).sum()) == round(cfg.sparsity * w.numel()), name
            assert res.sparsity_pattern[name] == "unstructured"
    assert all(bool(torch.isfinite(m.weight).all()) for m in lin.values())


def test_a_lambda_search_that_cannot_reach_the_target_names_the_layer(tiny_llama):
    cfg = FISTAConfig(sparsity=0.5, lambda_steps=1, lambda_tol=1e-6)
    with pytest.raises(CompressionError, match=r"model\.layers\.0\.self_attn\.q_proj: the lambda search did not "
                                               r"reach sparsity 0\.500 in 1 tries"):
        compress(tiny_llama, cfg, _calib(), progress=False)


@pytest.mark.parametrize("opts,match", [
    ({"sparsity": 1.0}, r"sparsity=1.0 is outside \[0, 1\)"),
    ({"sparsity": -0.1}, r"sparsity=-0.1 is outside \[0, 1\)"),
    ({"prune_n": 4, "prune_m": 4}, "N:M sparsity 4:4 is invalid"),
    ({"iters": 0}, "iters=0 must be >= 1"),
    ({"lambda_steps": 0}, "lambda_steps=0 must be >= 1"),
    ({"refine_iters": -1}, "refine_iters=-1 must be >= 0"),
    ({"lambda_tol": 0.0}, r"lambda_tol=0.0 must be in \(0, 1\)"),
    ({"warm_start": "gptq"}, "warm_start='gptq' is unknown"),
    ({"percdamp": -1.0}, "percdamp=-1.0 must be >= 0"),
])
def test_bad_settings_are_refused(opts, match):
    with pytest.raises(ConfigError, match=match):
        FISTAConfig.from_options(**opts)
    with pytest.raises(ConfigError, match=match):
        Recipe.from_dict({"stages": [{"method": "fista", **opts}]}).validate()


def test_warm_start_candidate_is_never_beaten_by_a_worse_fista_pattern():
    """Step 5: the result's objective is at most the refit warm start's."""
    from edgeprune.methods.fista import _Problem
    from edgeprune.methods.sparsegpt import sparsegpt_prune

    W, X, G = _layer(out=32, inp=64)
    ws, wk = sparsegpt_prune(W, G, sparsity=0.5)[:2]
    w, keep, info = fista_prune(W, G, sparsity=0.5, warm=ws, warm_keep=wk)
    assert set(info["objective"]) == {"fista", "warm"} and info["chose"] in ("fista", "warm")
    p = _Problem(G, W @ G)
    U = w * p.d[None, :]
    assert p.objective(U, U @ p.Gp, 0.0) <= min(info["objective"].values()) + 1e-6 * abs(min(info["objective"].values()))
    assert relative_error(W, w, G) <= relative_error(W, ws, G)  # the refit never loses to SparseGPT


def test_shipped_presets_parse():
    from edgeprune.pipeline import preset_names, resolve_recipe

    names = preset_names()
    assert {"best-w4", "best-w4-clip", "best-w4-refit", "best-w4-signround", "best-50", "best-2-4"} <= set(names)
    for n in names:
        Recipe.from_file(resolve_recipe(n)).validate()


def test_error_corrected_warm_target_is_the_weight_when_the_inputs_agree():
    """The warm start's target is ``W + (B - W G) (G + delta I)^-1``: a layer whose input
    no pruned predecessor changed (``B = W G``: a block's q/k/v) starts SparseGPT from ``W``
    itself. The damped solve ``B (G + delta I)^-1`` would shrink ``W`` along ``G``'s weak
    directions (a different pattern here, checked)."""
    from edgeprune.methods.base import LayerTask
    from edgeprune.methods.fista import FISTA
    from edgeprune.methods.sparsegpt import sparsegpt_prune

    W, _, G = _layer(n=48)                      # n < in: G is singular, damping matters
    task = LayerTask(name="l", module=torch.nn.Linear(64, 24, bias=False), weight=W, mask=None, stats=None)
    warm, keep = FISTA(FISTAConfig(sparsity=0.5))._warm(task, G, W @ G)
    ref_w, ref_keep = sparsegpt_prune(W, G, sparsity=0.5, percdamp=0.01, name="l")[:2]
    assert torch.equal(keep, ref_keep)
    torch.testing.assert_close(warm, ref_w, rtol=1e-4, atol=1e-5)
