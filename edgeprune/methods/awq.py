"""AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration
(Lin, Tang, Tang, Yang, Chen, Wang, Xiao, Dang, Gan & Han, MLSys 2024).

AWQ protects the weights that meet large activations by scaling input channels before
rounding. For a group of linears that read the same input ``x`` (produced by a
preceding op ``P``), with per-input-channel scales ``s``::

    W x = (W diag(s)) (diag(s)^-1 x)      # exact: s^-1 is folded into P

and ``W diag(s)`` is quantized (Sec. 3.2, Eq. 4-5). Steps, per decoder block
(:meth:`AWQ.compress_block`):

1. **Scale search** (Eq. 5): ``s = mean|x|^a`` (or, with ``duo_scaling`` as in AutoAWQ
   and llm-compressor, ``s = mean|x|^a / mean|w_hat|^(1-a)`` with ``w_hat`` the
   group-normalized weight magnitude), normalized by ``sqrt(max(s) min(s))``, for ``a`` on a
   grid of ``n_grid`` points ``0, 1/n, ..., (n-1)/n`` in ``[0, 1)``; plus ``s = 1`` (plain
   RTN), so the search never does worse than RTN on its loss. The loss is the
   calibration output error of the group's linears,
   ``sum_l ||W_l X - Q(W_l diag(s)) diag(s)^-1 X||^2 = sum_l tr(dW_l H dW_l^T)``, computed
   from the Hessian ``H = X^T X / n`` (all calibration tokens, no subsampling; AutoAWQ
   measures the output of the parent module instead, e.g. the whole attention).
   NaN/inf scales are replaced by 1 and the layer reported.
2. **Folding** (exact before rounding; tested): ``input_layernorm.weight /= s`` for
   q/k/v; ``post_attention_layernorm.weight /= s`` for gate/up; ``v_proj`` rows ``/= s``
   for ``o_proj``; ``up_proj`` rows ``/= s`` for ``down_proj``. With grouped-query
   attention, o_proj input channel ``h*d_head + d`` (query head ``h``) reads v_proj output
   channel ``(h // n_rep)*d_head + d``, so the fold is exact only when all query heads of a
   kv group share the scale: the scale is searched per v_proj output channel (statistics
   averaged over the group's query heads) and repeated for o_proj. A prev linear that is
   not a target of this stage (so might already be quantized) is never rescaled: that
   group is quantized without scales, and reported.
3. **Clipping search** (AutoAWQ ``auto_clip``): per output row and group, the range
   shrink ``c in {1, 1-1/n_grid, ..., 1-max_shrink}`` minimizing the group's output error
   ``dw H_gg dw^T``; q_proj/k_proj are not clipped (as in AutoAWQ).
4. **Quantization**: round-to-nearest on the scaled, clipped weights, unless a later
   recipe stage quantizes the layer (AWQ then GPTQ): then only steps 1-3 apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..quantize import check_quant_args, fake_quant_groups, fake_quantize, qparams, rtn_quantize, search_clip
from .base import LayerResult, LayerTask, Method, relative_error, single_thread
from .config import QuantOptions, check_clip_grid
from .registry import register_method

_NO_CLIP = ("q_proj", "k_proj")


@dataclass
class AWQConfig(QuantOptions):
    """AWQ settings (``bits``, ``group_size``, ``sym`` from :class:`QuantOptions`).

    ``n_grid``: points of the scale search (and steps of the clipping search).
    ``clip_search``: run step 3. ``duo_scaling`` (AutoAWQ / llm-compressor default) uses
    ``s = mean|x|^a / mean|w|^(1-a)``; set it to ``False`` for the paper's ``s = mean|x|^a``.
    ``max_shrink`` bounds the clipping search (clip ratios ``1, 1-1/n_grid, ...,
    1-max_shrink``).

    AWQ may precede another quantizer of the same layer (:attr:`may_precede_quantizer`):
    it then only folds its scales and clips, and that stage produces the integer codes.
    """

    n_grid: int = 20
    clip_search: bool = True
    duo_scaling: bool = True
    max_shrink: float = 0.5
    method = "awq"
    may_precede_quantizer = True

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a bad grid or search setting."""
        super().validate()
        check_clip_grid(self)


def awq_scales(x_mean: torch.Tensor, w_mean: Optional[torch.Tensor], ratio: float,
               duo_scaling: bool = True) -> tuple[torch.Tensor, int]:
    """One AWQ scale candidate ``[in]`` for exponent ``ratio``; NaN/inf entries -> 1.

    Args:
        x_mean: ``[in]`` mean ``|x|`` per input channel.
        w_mean: ``[in]`` mean group-normalized ``|W|`` per input channel (duo scaling).
        ratio: the exponent ``alpha`` in ``[0, 1]``.

    Returns:
        ``(s, n_bad)``: scales normalized by ``sqrt(max*min)``, and how many were not
        finite (replaced by 1).
    """
    x = x_mean.float()
    if duo_scaling and w_mean is not None:
        s = x.pow(ratio) / (w_mean.float().pow(1 - ratio) + 1e-4)
    else:
        s = x.pow(ratio)
    s = s.clamp(min=1e-4)
    fin = torch.isfinite(s)
    if fin.any():
        s = s / (s[fin].max() * s[fin].min()).sqrt()
    bad = ~torch.isfinite(s) | ~(s > 0)
    n_bad = int(bad.sum())
    if n_bad:
        s = torch.where(bad, torch.ones_like(s), s)
    return s, n_bad


def _w_mean(W: torch.Tensor, gs: int) -> torch.Tensor:
    out, inp = W.shape
    Wg = W.abs().reshape(out, inp // gs, gs)
    Wg = Wg / (Wg.amax(dim=-1, keepdim=True) + 1e-6)
    return Wg.reshape(out, inp).mean(0)


def search_scale(W: torch.Tensor, H: torch.Tensor, x_mean: torch.Tensor, *, bits: int, group_size: int,
                 sym: bool, n_grid: int = 20, duo_scaling: bool = True,
                 tie: Optional[tuple[int, int, int]] = None) -> tuple[torch.Tensor, dict]:
    """AWQ grid search of per-input-channel scales for stacked weights ``W [out, in]``.

    Args:
        W: rows of every linear reading the input; H: ``[in, in]`` ``X^T X / n``;
        x_mean: ``[in]`` mean ``|x|``.
        tie: ``(n_kv, n_rep, head_dim)`` for v_proj -> o_proj under GQA: scales are tied
            across the ``n_rep`` query heads of a kv group (see module docstring).

    Returns:
        ``(s [in], info)`` with ``info = {"ratio": best alpha or None for s=1, "loss": ...,
        "loss_rtn": ..., "n_bad": non-finite scales replaced}``.
    """
    out, inp = W.shape
    gs = inp if group_size == -1 else group_size
    W = W.float()
    wm = _w_mean(W, gs) if duo_scaling else None
    xm = x_mean.float()

    def tied(v):
        if tie is None or v is None:
            return v
        n_kv, n_rep, hd = tie
        return v.reshape(n_kv, n_rep, hd).mean(1).reshape(-1)

    def untie(v):
        if tie is None:
            return v
        n_kv, n_rep, hd = tie
        return v.reshape(n_kv, 1, hd).expand(n_kv, n_rep, hd).reshape(-1)

    xm_t, wm_t = tied(xm), tied(wm)

    def loss_of(s):
        d = W - fake_quant_groups(W * s[None, :], bits, gs, sym).div_(s[None, :])
        return float(torch.einsum("ij,ij->", d @ H, d))

    ones = torch.ones(inp, device=W.device)
    best_s, best_loss, best_ratio = ones, loss_of(ones), None
    loss_rtn = best_loss
    n_bad_total = 0
    for i in range(n_grid):
        ratio = i / n_grid
        s_t, n_bad = awq_scales(xm_t, wm_t, ratio, duo_scaling)
        n_bad_total = max(n_bad_total, n_bad)
        s = untie(s_t)
        loss = loss_of(s)
        if loss < best_loss:
            best_s, best_loss, best_ratio = s, loss, ratio
    return best_s, {"ratio": best_ratio, "loss": best_loss, "loss_rtn": loss_rtn, "n_bad": n_bad_total}


def _clamp_to_clip(W: torch.Tensor, clip: torch.Tensor, gs: int, sym: bool) -> torch.Tensor:
    """Clamp each group to its clipped range (what the quantizer sees with ``clip``)."""
    out, inp = W.shape
    Wg = W.reshape(out, inp // gs, gs)
    c = clip.unsqueeze(-1)
    if sym:
        m = Wg.abs().amax(-1, keepdim=True) * c
        return torch.maximum(torch.minimum(Wg, m), -m).reshape(out, inp)
    lo = Wg.amin(-1, keepdim=True).clamp(max=0) * c
    hi = Wg.amax(-1, keepdim=True).clamp(min=0) * c
    return torch.maximum(torch.minimum(Wg, hi), lo).reshape(out, inp)


@register_method(AWQConfig)
class AWQ(Method):
    """AWQ (:class:`AWQConfig`); see the module docstring for the maths."""

    needs_hessian = True

    def compress_block(self, block: nn.Module, tasks: list[LayerTask]) -> dict[str, LayerResult]:
        """Search, fold, clip and quantize the block's targets (see the module docstring)."""
        dev = tasks[0].weight.device if tasks else "cpu"
        with single_thread(dev):  # the searches are many medium element-wise ops
            return self._compress_block(block, tasks)

    def _compress_block(self, block: nn.Module, tasks: list[LayerTask]) -> dict[str, LayerResult]:
        c = self.config
        by_suffix = {}
        for t in tasks:
            parts = t.name.split(".")
            by_suffix[".".join(parts[-2:])] = t
        W = {t.name: t.weight.clone() for t in tasks}      # current (folded) weights
        ref = {t.name: t.weight.clone() for t in tasks}    # uncompressed, same coordinates
        stats = {t.name: t.stats for t in tasks}
        notes: dict[str, list] = {t.name: [] for t in tasks}
        norm_folds = []  # (norm module, s) applied at the end, after everything succeeded
        attn = getattr(block, "self_attn", None)

        def get(mod_path):
            try:
                return block.get_submodule(mod_path)
            except AttributeError:
                return None

        groups = [
            ("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], None),
            ("self_attn.v_proj", ["self_attn.o_proj"], "gqa"),
            ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], None),
            ("mlp.up_proj", ["mlp.down_proj"], None),
        ]
        done = set()
        for prev_path, layer_paths, kind in groups:
            members = [by_suffix[p] for p in layer_paths if p in by_suffix]
            if not members:
                continue
            prev = get(prev_path)
            prev_task = by_suffix.get(prev_path)
            # every reader of prev's output is rescaled, or none: a norm divided by s
            # would otherwise feed x/s to a reader this stage leaves alone
            outside = [p for p in layer_paths if p not in by_suffix and get(p) is not None]
            reason = None
            tie = None
            if prev is None:
                reason = f"no {prev_path} to fold scales into"
            elif outside:
                reason = (f"{', '.join(outside)} also read(s) {prev_path} but are not targets of "
                          "this stage (cannot rescale them)")
            elif isinstance(prev, nn.Linear) and prev_task is None:
                reason = f"{prev_path} is not a target of this stage (cannot rescale it)"
            elif not isinstance(prev, nn.Linear) and not self._norm_foldable(prev):
                reason = f"{prev_path} ({type(prev).__name__}) cannot absorb a scale exactly"
            elif not isinstance(prev, nn.Linear) and any(
                    m.stats is not members[0].stats for m in members):
                reason = "the group's linears do not share one input"
            if kind == "gqa" and reason is None:
                hd = getattr(attn, "head_dim", None)
                o = members[0].module
                if hd is None or prev.out_features % hd or o.in_features % prev.out_features:
                    reason = "head layout of v_proj/o_proj not understood"
                else:
                    n_kv = prev.out_features // hd
                    tie = (n_kv, o.in_features // prev.out_features, hd)
            if reason is not None:
                for m in members:
                    notes[m.name].append(f"{m.name}: AWQ scaling skipped ({reason}) -> clip + RTN only")
                continue
            st = members[0].stats
            if st.n_tokens == 0:
                for m in members:
                    notes[m.name].append(f"{m.name}: no usable calibration activations -> RTN (AWQ scale 1)")
                continue
            Wcat = torch.cat([W[m.name] for m in members], 0)
            gs = check_quant_args(c.bits, c.group_size, Wcat.shape[1], name=members[0].name)
            s, info = search_scale(Wcat, st.hessian, st.abs_mean, bits=c.bits, group_size=gs, sym=c.sym,
                                   n_grid=c.n_grid, duo_scaling=c.duo_scaling, tie=tie)
            if info["n_bad"]:
                for m in members:
                    notes[m.name].append(f"{m.name}: {info['n_bad']} NaN/inf AWQ scales replaced by 1")
            # fold: members' columns *= s, prev's output /= s
            new_stats = st.scaled(s)
            for m in members:
                W[m.name] = W[m.name] * s[None, :]
                ref[m.name] = ref[m.name] * s[None, :]
                stats[m.name] = new_stats
                done.add(m.name)
            s_prev = s
            if tie is not None:
                n_kv, n_rep, hd = tie
                s_prev = s.reshape(n_kv, n_rep, hd)[:, 0, :].reshape(-1)
            if isinstance(prev, nn.Linear):
                W[prev_task.name] = W[prev_task.name] / s_prev[:, None]
                ref[prev_task.name] = ref[prev_task.name] / s_prev[:, None]
                if prev.bias is not None:
                    norm_folds.append(("bias", prev, s_prev))
            else:
                norm_folds.append(("norm", prev, s_prev))

        results: dict[str, LayerResult] = {}
        for t in tasks:
            Wt = W[t.name]
            H = stats[t.name].hessian if stats[t.name].n_tokens else None
            gs = check_quant_args(c.bits, c.group_size, Wt.shape[1], name=t.name)
            clip = torch.ones(Wt.shape[0], Wt.shape[1] // gs, device=Wt.device)
            if c.clip_search and H is not None and not t.name.endswith(_NO_CLIP):
                clip = search_clip(Wt, H, bits=c.bits, group_size=gs, sym=c.sym, n_grid=c.n_grid,
                                   max_shrink=c.max_shrink)
            q = None
            if t.quantize:
                q = rtn_quantize(Wt.cpu(), c.bits, gs, c.sym, clip=clip.cpu(), name=t.name)
                q.meta.update(method="awq", clip_mean=float(clip.mean()))
                Wn = q.dequantize().to(Wt.device)
            else:
                Wn = _clamp_to_clip(Wt, clip, gs, c.sym) if c.clip_search else Wt.clone()
            if t.mask is not None:
                Wn = Wn * t.mask
            err = relative_error(ref[t.name], Wn, H) if H is not None else None
            results[t.name] = LayerResult(weight=Wn, quantized=q, notes=notes[t.name], reference=ref[t.name],
                                          stats=stats[t.name], error=err)
        for what, mod, s in norm_folds:  # everything computed: now touch the preceding ops
            if what == "norm":
                mod.weight.data.div_(s.to(mod.weight.device, mod.weight.dtype))
                if getattr(mod, "bias", None) is not None:
                    mod.bias.data.div_(s.to(mod.bias.device, mod.bias.dtype))
            else:
                mod.bias.data.div_(s.to(mod.bias.device, mod.bias.dtype))
        return results

    @staticmethod
    def _norm_foldable(norm: nn.Module) -> bool:
        """True when ``norm(x) / s == norm_with_weight/s(x)`` (scale-by-weight norms).

        Checked on a float32 copy of the norm: the property is the norm's arithmetic, not
        its precision, and in float16 / bfloat16 the rounding of ``weight / s`` alone
        exceeds any tolerance tight enough to tell a scale-by-weight norm from another
        (the check then refused the fold on every norm: AWQ skipped its scaling on 150
        of SmolLM2's 210 linears in float16)."""
        w = getattr(norm, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 1:
            return False
        if isinstance(getattr(norm, "bias", None), torch.Tensor):
            return False  # LayerNorm bias would need dividing too; keep it simple and exact
        import copy
        probe = copy.deepcopy(norm).float()
        pw = probe.weight
        with torch.no_grad():
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(3, pw.shape[0], generator=g).to(pw.device)
            s = (torch.rand(pw.shape[0], generator=g) + 0.5).to(pw.device)
            y0 = probe(x)
            pw.data.div_(s)
            y1 = probe(x)
        return bool(torch.allclose(y1 * s, y0, rtol=1e-4, atol=1e-5))
