"""COUNTDOWN quality study on SmolLM2-135M (issue 6): oracle bounds and filter variants.

Every variant keeps, per token and layer, a subset of the MLP coefficients
``c = act(gate(x)) * up(x)`` and is scored teacher-forced (the filter applied at every
position) on WikiText-2 test windows of 512 tokens (no BOS), against the same model
unfiltered: perplexity increase, KL(dense || filtered), realised act-sparsity.

Variants (``--variants``, comma separated; ``@s`` is appended per sparsity):

* ``oracle-topk``: per token, the truly largest ``|c_j|`` (exactly ``1-s`` kept).
* ``oracle-topk-w``: per token, the largest ``|c_j| * ||W_down[:, j]||`` (the true size of
  each term of the down projection's sum).
* ``oracle-thr`` / ``oracle-thr-w``: one threshold per layer on ``|c|`` (resp. weighted),
  calibrated on C4 so that ``s`` of the calibration coefficients fall below it (the token's
  count varies).
* ``m-median``: M-COUNTDOWN as first built (``|up| > tau``, tau = median per-token k-th).
* ``m-pooled``: ``|up| > tau``, tau = pooled quantile (mean sparsity = s on calibration).
* ``m-chan``: ``|up_j| * f_j > tau`` with ``f_j = E|act(gate_j)| * ||W_down[:, j]||``.
* ``m-chan-rms``: same with ``f_j = sqrt(E act(gate_j)^2) * ||W_down[:, j]||``.

No peer runs these variants: records (``--json PATH``) carry ``peer``/``theirs`` null,
one per variant and metric (``ppl``, ``ppl_increase_pct``, ``kl_nats``,
``top1_agreement``, ``act_sparsity``, ``recall_top``).

Usage::

    .venv/bin/python bench/countdown_study.py --quick --json /tmp/cd_quick.json
    .venv/bin/python bench/countdown_study.py --nwindows 8 --sparsities 0.5,0.7,0.9 \\
        --variants oracle-topk,oracle-topk-w,oracle-thr-w,m-median,m-pooled,m-chan
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

import benchlib
from benchlib import C4, WIKI


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def pooled_tau(score: torch.Tensor, s: float) -> float:
    """Threshold below which a fraction ``s`` of the pooled ``|score|`` values lie."""
    a = score.abs().flatten()
    k = max(1, int(round(s * a.numel())))
    return float(a.kthvalue(k).values)


class Stats:
    """Per-layer calibration statistics on the dense model's MLP inputs."""

    def __init__(self, model, calib_ids, max_tokens, stat_tokens=4096):
        from edgeprune import countdown as cd
        self.mlps = cd.gated_mlps(model)
        X_all, self.resid = cd.collect_mlp_inputs(model, calib_ids, max_tokens,
                                                  return_resid=True)
        self.layers = []
        self.predictors = {}
        with torch.no_grad():
            for mlp, Xf in zip(self.mlps, X_all):
                X = Xf[:stat_tokens]
                u = mlp.up_proj(X)
                a = mlp.act_fn(mlp.gate_proj(X))
                c = a * u
                dn = mlp.down_proj.weight.norm(dim=0)            # [I]
                pos = (u > 0).float()
                fpos = (a.abs() * pos).sum(0) / pos.sum(0).clamp_min(1) * dn
                fneg = (a.abs() * (1 - pos)).sum(0) / (1 - pos).sum(0).clamp_min(1) * dn
                ynorm = float(mlp.down_proj(c).pow(2).sum(-1).mean())
                self.layers.append(dict(X=X, Xf=Xf, u=u, ynorm=ynorm, a=a, c=c, dn=dn, fpos=fpos, fneg=fneg,
                                        ea=a.abs().mean(0), ra=a.pow(2).mean(0).sqrt()))


GRID = [round(0.05 * j, 2) for j in range(1, 20)]


def score_fn(name: str, st: "Stats"):
    """``fn(i, x, u, c) -> score [..., I]`` of a threshold variant (larger = keep)."""
    ly = st.layers
    if name in ("oracle-thr", "oracle-thr-w"):
        w = name.endswith("-w")
        return lambda i, x, u, c: c.abs() * (ly[i]["dn"] if w else 1.0)
    if name in ("m-median", "m-pooled"):
        return lambda i, x, u, c: u.abs()
    if name == "m-chan":
        return lambda i, x, u, c: u.abs() * (ly[i]["ea"] * ly[i]["dn"])
    if name == "m-chan-rms":
        return lambda i, x, u, c: u.abs() * (ly[i]["ra"] * ly[i]["dn"])
    if name == "m-sign":
        # E[|act(gate_j)| | sign(up_j)] * ||W_down[:, j]||: one factor per sign
        return lambda i, x, u, c: u.abs() * torch.where(u > 0, ly[i]["fpos"], ly[i]["fneg"])
    if name.startswith("d-q"):                 # d-q<bits>g<group>: RTN-quantized gate/up
        if name not in st.predictors:
            from edgeprune_exporters.int4 import rtn_int
            bits, grp = (int(t) for t in name[3:].split("g"))
            fns = []
            for m, lay in zip(st.mlps, ly):
                wg, wu = (torch.from_numpy(rtn_int(w.weight.detach().numpy(), bits, grp)
                                           .dequantize()) for w in (m.gate_proj, m.up_proj))
                fns.append(lambda x, _m=m, _g=wg, _u=wu, _d=lay["dn"]:
                           (_m.act_fn(x @ _g.T) * (x @ _u.T)).abs() * _d)
            st.predictors[name] = fns
        preds = st.predictors[name]
        return lambda i, x, u, c: preds[i](x)
    if name.startswith("d-"):
        if name not in st.predictors:        # d-<loss>-r<rank>[-e<epochs>]
            parts = name.split("-")
            loss, rank = parts[1], int(parts[2][1:])
            ep = int(parts[3][1:]) if len(parts) > 3 else 8
            t0 = time.time()
            st.predictors[name] = [
                train_predictor(m, lay["Xf"], rank, loss, epochs=ep, dn=lay["dn"])
                for m, lay in zip(st.mlps, ly)]
            log(f"trained {name} on {ly[0]['Xf'].shape[0]} tokens/layer in {time.time() - t0:.0f}s")
        preds = st.predictors[name]
        return lambda i, x, u, c: preds[i](x)
    raise SystemExit(f"unknown variant {name}")


@torch.no_grad()
def make_selector(name: str, s: float, st: "Stats", allocation: str = "uniform"):
    """``sel(i, x, u, a, c) -> keep bool [..., I]`` for variant ``name`` at sparsity ``s``.

    ``allocation="greedy"``: per-layer sparsities on a 0.05 grid with mean ``s``, chosen
    by edgeprune.countdown's greedy rule on the relative MLP output error."""
    from edgeprune import countdown as cd
    L = len(st.layers)
    I = st.layers[0]["u"].shape[-1]
    n_keep = I - int(round(s * I))
    if name in ("oracle-topk", "oracle-topk-w"):
        w = name.endswith("-w")

        def sel(i, x, u, a, c):
            sc = c.abs() * (st.layers[i]["dn"] if w else 1.0)
            idx = sc.topk(n_keep, dim=-1).indices
            return torch.zeros_like(c, dtype=torch.bool).scatter_(-1, idx, True)
        return sel
    fn = score_fn(name, st)
    taus = []
    per = [s] * L
    if allocation in ("greedy", "greedy-mlp"):
        acc = {g: {"err": []} for g in GRID}
        tau_g = {g: [] for g in GRID}
        for i in range(L):
            ly = st.layers[i]
            sc = fn(i, ly["X"], ly["u"], ly["c"])
            ne = min(512, sc.shape[0])
            Wd = st.mlps[i].down_proj.weight
            for g in GRID:
                t = pooled_tau(sc, g)
                tau_g[g].append(t)
                dy = (ly["c"][:ne] * (sc[:ne] <= t)) @ Wd.T
                den = st.resid[i] if allocation == "greedy" else ly["ynorm"]
                acc[g]["err"].append(float(dy.pow(2).sum(-1).mean()) / den)
        per = cd._greedy_allocation(acc, [0.0] + GRID, s, L)
        taus = [tau_g[p][i] if p > 0 else -1.0 for i, p in enumerate(per)]
        log(f"{name}@{s:g} greedy per-layer sparsity {per}")
    else:
        for i in range(L):
            ly = st.layers[i]
            sc = fn(i, ly["X"], ly["u"], ly["c"])
            taus.append(cd.per_token_threshold(sc, s)[0] if name == "m-median"
                        else pooled_tau(sc, s))

    def sel(i, x, u, a, c):
        return fn(i, x, u, c) > taus[i]
    return sel


def train_predictor(mlp, X, rank, loss="mse", epochs=4, dn=None, seed=0):
    """D predictor ``act(x Vg Ug) * (x Vu Uu)`` from edgeprune.countdown: closed-form
    reduced-rank regression ("rrr": scored ``|c_hat|``; "rrrw": scored ``|c_hat| * dn``)
    or then trained ("mse": :func:`edgeprune.countdown.train_predictor`, scored
    ``|c_hat| * dn``). Returns ``fn(x) -> score``."""
    from edgeprune import countdown as cd
    Vg, Ug = cd.lowrank_factors(mlp.gate_proj.weight.detach(), X, rank)
    Vu, Uu = cd.lowrank_factors(mlp.up_proj.weight.detach(), X, rank)
    p = {"v_gate": Vg, "u_gate": Ug, "v_up": Vu, "u_up": Uu}
    if loss == "mse":
        p = cd.train_predictor(mlp, X, p, epochs=epochs, weight=dn, seed=seed)
    elif loss not in ("rrr", "rrrw"):
        raise SystemExit(f"unknown loss {loss}")
    w = 1.0 if loss == "rrr" else dn

    def fn(x):
        return cd.predictor_score(p, x, mlp.act_fn).abs() * w
    return fn


class Patch:
    """Replace every MLP forward by ``down(c * keep)``, counting kept coefficients."""

    def __init__(self, mlps, sel, s=None):
        self.mlps, self.sel, self.s = mlps, sel, s
        self.kept = 0
        self.total = 0
        self.hit = 0
        self.top = 0

    def __enter__(self):
        for i, m in enumerate(self.mlps):
            def fwd(x, _m=m, _i=i):
                u = _m.up_proj(x)
                a = _m.act_fn(_m.gate_proj(x))
                c = a * u
                keep = self.sel(_i, x, u, a, c)
                self.kept += int(keep.sum())
                self.total += keep.numel()
                if self.s:
                    nk = c.shape[-1] - int(round(self.s * c.shape[-1]))
                    top = torch.zeros_like(keep).scatter_(-1, c.abs().topk(nk, -1).indices, True)
                    self.hit += int((top & keep).sum())
                    self.top += int(top.sum())
                return _m.down_proj(c * keep.to(c.dtype))
            m.forward = fwd
        return self

    def __exit__(self, *exc):
        for m in self.mlps:
            m.__dict__.pop("forward", None)


@torch.no_grad()
def evaluate(model, windows, mlps, variants: dict) -> dict:
    """``{name: {ppl, ppl_dense, ppl_increase_pct, kl, top1_agree, realised}}``."""
    acc = {n: dict(nll=0.0, kl=0.0, agree=0, kept=0, total=0, hit=0, top=0) for n in variants}
    nll_d, N = 0.0, 0
    for w in windows:
        ids = w[None]
        ld = F.log_softmax(model(ids, use_cache=False).logits[0, :-1].float(), -1)
        nll_d += F.nll_loss(ld, w[1:], reduction="sum").item()
        N += w.numel() - 1
        pd = ld.exp()
        for n, sel in variants.items():
            with Patch(mlps, sel, float(n.split("@")[1].split("-")[0])) as p:
                lm = F.log_softmax(model(ids, use_cache=False).logits[0, :-1].float(), -1)
            a = acc[n]
            a["nll"] += F.nll_loss(lm, w[1:], reduction="sum").item()
            a["kl"] += (pd * (ld - lm)).sum().item()
            a["agree"] += int((ld.argmax(-1) == lm.argmax(-1)).sum())
            a["kept"] += p.kept
            a["total"] += p.total
            a["hit"] += p.hit
            a["top"] += p.top
    pdn = math.exp(nll_d / N)
    out = {}
    for n, a in acc.items():
        ppl = math.exp(a["nll"] / N)
        out[n] = dict(ppl=ppl, ppl_dense=pdn, ppl_increase_pct=100 * (ppl / pdn - 1),
                      kl=a["kl"] / N, top1_agree=a["agree"] / N,
                      realised=1 - a["kept"] / a["total"],
                      recall_top=a["hit"] / max(a["top"], 1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nwindows", type=int, default=8)
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4096, help="tokens/layer kept (D training)")
    ap.add_argument("--stat-tokens", type=int, default=4096, help="tokens/layer for thresholds")
    ap.add_argument("--sparsities", default="0.5,0.7,0.9")
    ap.add_argument("--variants", default="oracle-topk,oracle-topk-w,oracle-thr-w")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--allocation", default="uniform", help="uniform | greedy | both")
    benchlib.add_common_args(ap, "2 windows, 8 x 256 calibration tokens, sparsity 0.7, two "
                                 "variants (~3 min)")
    a = ap.parse_args(argv)
    if a.quick:
        a.nwindows, a.nsamples, a.sparsities = 2, 8, "0.7"
        a.variants, a.max_tokens, a.stat_tokens = "oracle-topk,m-chan", 1024, 1024
    torch.set_num_threads(a.threads)
    from edgeprune.calibration import build_calibration
    from edgeprune.evaluate import eval_windows
    from edgeprune.models import load_model

    model, tok = load_model("smollm2-135m")
    cal = build_calibration(tok, C4, nsamples=a.nsamples, seqlen=a.seqlen, seed=0)
    t0 = time.time()
    st = Stats(model, cal.input_ids, a.max_tokens, a.stat_tokens)
    log(f"stats on {a.nsamples}x{a.seqlen} C4 in {time.time() - t0:.0f}s")
    windows, _ = eval_windows(tok, WIKI, seqlen=512, nwindows=a.nwindows)
    allocs = ["uniform", "greedy"] if a.allocation == "both" else a.allocation.split(",")
    variants = {f"{v}@{float(s):g}" + ("" if al == "uniform" else "-" + al):
                make_selector(v, float(s), st, al)
                for s in a.sparsities.split(",") for v in a.variants.split(",")
                for al in allocs if not (al == "greedy" and "topk" in v)}
    t0 = time.time()
    res = evaluate(model, windows, st.mlps, variants)
    log(f"evaluated {len(variants)} variants on {a.nwindows} windows in {time.time() - t0:.0f}s")
    for n, r in res.items():
        log(f"{n:22s} ppl {r['ppl']:8.3f} (dense {r['ppl_dense']:.3f}, {r['ppl_increase_pct']:+7.1f}%) "
            f"KL {r['kl']:.4f} top1 {r['top1_agree']:.3f} skipped {r['realised']:.3f} "
            f"recall {r['recall_top']:.3f}")
    if a.json:
        units = {"ppl": "ppl", "ppl_dense": "ppl_dense", "ppl_increase_pct": "ppl_increase_pct",
                 "kl": "kl_nats", "top1_agree": "top1_agreement", "realised": "act_sparsity",
                 "recall_top": "recall_top"}
        benchlib.write_records(a.json, [benchlib.record(n, units[k], float(v))
                                        for n, r in res.items() for k, v in r.items()])
    return res


if __name__ == "__main__":
    main()
