"""SignRound: Optimize Weight Rounding via Signed Gradient Descent for the Quantization of
LLMs (Cheng, Zhang, Shen, Guo, Lv, Chen & Liu, 2023; the algorithm of Intel's AutoRound).

For every quantized linear of a decoder block, a rounding offset ``V`` per weight and two
clipping factors ``alpha`` (min) and ``beta`` (max) per group of ``group_size`` weights are
learned; the group's grid and codes are (Eq. 1-3 of the paper, asymmetric case)::

    s = (beta * max(w) - alpha * min(w)) / (2^bits - 1)       # max(w) >= 0 >= min(w)
    z = round(-alpha * min(w) / s)
    q = clamp(round(w / s + V) + z, 0, 2^bits - 1),    w_hat = (q - z) * s

(symmetric: ``s = 2 max(-alpha min(w), beta max(w)) / (2^bits - 1)``, ``z = 2^(bits-1)``;
symmetric with ``full_range``, the grid of AutoRound's ``int_sym`` and llama.cpp's Q4_0:
``s = -beta max(w) / 2^(bits-1)`` when ``beta max(w) > -alpha min(w)``, else
``-alpha min(w) / 2^(bits-1)``, ``z = 2^(bits-1)``: the scale carries the sign that puts the
group's largest magnitude on code 0, so all ``2^bits`` codes are used, a step of
``max|w| / 2^(bits-1)`` instead of ``2 max|w| / (2^bits - 1)``).
``V`` starts at 0 and ``alpha = beta = 1``, which is exactly round-to-nearest
(:func:`edgeprune.quantize.rtn_quantize`). The block is then tuned on its own output
(Eq. 4)::

    min_{V, alpha, beta}  || block(X_q; W) - block(X_q; W_hat(V, alpha, beta)) ||^2

by signed gradient descent (``p <- p - lr_t sign(dL/dp)``, the rounding's gradient passed
straight through), ``lr_t`` decaying linearly from ``lr`` to 0 over ``iters`` steps, each
step on ``batch_size`` calibration windows drawn at random; ``V`` stays in ``[-0.5, 0.5]``
and ``alpha, beta`` in ``[0, 1]``; the parameters with the lowest step loss are kept (the
loss is measured before each step, so step 0 is RTN). All the block's target linears are
tuned jointly.

Blocks are processed in order; block ``i`` sees the outputs of the already-quantized
blocks ``0..i-1`` (``X_q``, the engine's calibration stream). The reference output is, with
``fp_targets`` (default, AutoRound's ``enable_quanted_input``), the block's unquantized
output on the *unquantized* stream (the model before this stage), so each block also
corrects the error its predecessors left; without it, the unquantized block's output on
``X_q`` (as GPTQ's layer targets).

The learned grid ends as a :class:`~edgeprune.quantize.QuantizedWeight` (codes, scales,
zero points), so the exported ``MatMulNBits`` codes are exactly SignRound's codes.
Composition: after AWQ (its scales already folded into the weights) SignRound rounds the
scaled weights; after a pruning stage (e.g. SparseGPT 2:4) a pruned weight gets the code
of the zero point (dequantizes to exactly 0), so the mask survives.

Schedules (``schedule``): ``"fast"`` (the default, AutoRound's "light" recipe: 50 steps,
``lr = 5e-3``, 4 windows per step) and ``"thorough"`` (AutoRound's default: 200 steps,
``lr = 1/200``, 8 windows per step); ``iters``, ``lr``, ``minmax_lr`` and ``batch_size``
override them. The fast schedule's work per block: one forward pass over the calibration
windows for the targets, then 50 forward+backward passes over 4 windows (2,048 tokens at
512 per window), then one forward pass over the windows for the next block's inputs (no
statistics pass: :attr:`SignRound.needs_stats` is false; with the targets under autocast
that pass runs under it too, :attr:`SignRound.stream_autocast`, as AutoRound's bfloat16
model does); for SmolLM2-135M (30 blocks)
about 1,500 block passes, a few times GPTQ's time (``bench/compare_methods.py --cases
gptq_w4g64,signround_w4g64`` prints both). The fake quantization of every weight at every
step is one fused autograd function (:class:`_FakeQuant`). Each step's windows are drawn
by ``sampler`` (random by default; ``"cyclic"`` uses every window equally often).
Measured there (32 x 512 C4 windows, WikiText-2 40 x 512, W4 g64 symmetric): perplexity
34.11 vs GPTQ's 39.83 (dense 28.74). Against AutoRound 0.16.1 at the same schedule and windows
(``--cases signround_w4g64,signround_w4g64_fullrange``, 2 threads): 33.91 on the default grid
and 32.64 with ``full_range`` (AutoRound's own grid) vs AutoRound's 33.15, in 413 / 398 s vs 402 s;
with the targets and the quantized stream under autocast and no statistics pass, full range:
32.89 in 357 s (Gemma-3-270M: 71.74 in 332 s vs AutoRound's 71.97 in 379 s; Qwen2.5-Coder-0.5B:
45.12 in 915 s vs 45.21 in 881 s; ``docs/signround-fista.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError
from ..quantize import QuantizedWeight, check_quant_args, round_scale
from .base import LayerResult, LayerTask, Method
from .config import QuantOptions
from .registry import register_method

#: schedule name -> (iters, lr (None: 1/iters), batch_size)
SCHEDULES = {"fast": (50, 5e-3, 4), "thorough": (200, None, 8)}
SAMPLERS = ("random", "cyclic")


@dataclass
class SignRoundConfig(QuantOptions):
    """SignRound settings (``bits``, ``group_size``, ``sym`` from :class:`QuantOptions`).

    ``schedule``: ``"fast"`` or ``"thorough"`` (see the module docstring); ``iters``
    (signed-gradient steps per block, 0 = round-to-nearest), ``lr`` (the rounding offsets'
    step, default per schedule), ``minmax_lr`` (the clipping factors' step, default
    ``lr``), ``batch_size`` (calibration windows per step) override it.
    ``minmax_tuning``: learn the clipping factors (else only ``V``). ``fp_targets``: the
    reference output comes from the unquantized stream (AutoRound's default). ``amp``: the
    tuning steps' and the targets' matrix products in bfloat16 (autocast; about 2x faster on
    a CPU with AVX512-BF16; AutoRound runs its whole model in bfloat16). The targets under
    the same autocast as the tuned block make the loss compare like with like: the
    bfloat16 rounding of the block's inputs no longer adds a floor the rounding offsets
    cannot lower (Gemma-3-270M at seed 0: 70.68 against 73.10 with float32 targets; the
    window draw moves the result by 1-3 %: 72.69 against 72.62 at seed 1). The final
    codes are computed in float32. ``amp_targets=False`` computes the targets in float32
    while the steps stay under autocast (and the quantized stream in the model's dtype,
    :attr:`SignRound.stream_autocast`): on Qwen2.5-Coder-0.5B (full range, W4 g64) that
    gave 44.82 against 45.12 at seed 0 with autocast targets and stream (45.55 / 45.01 at
    seeds 0 / 1 with autocast targets and a float32 stream), so which is better depends
    on the model and the draw (``docs/signround-fista.md``).
    ``full_range`` (with ``sym``): the signed-scale symmetric grid above (AutoRound's
    ``int_sym``); the scales it exports may be negative. ``sampler``: how each step's
    windows are drawn, ``"random"`` (a batch and its rows at random) or ``"cyclic"`` (every
    window equally often, as AutoRound). ``seed``: the draw of the windows per step.
    """

    schedule: str = "fast"
    iters: Optional[int] = None
    lr: Optional[float] = None
    minmax_lr: Optional[float] = None
    batch_size: Optional[int] = None
    minmax_tuning: bool = True
    fp_targets: bool = True
    amp: bool = True
    amp_targets: bool = True
    full_range: bool = False
    sampler: str = "random"
    seed: int = 0
    method = "signround"

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a bad grid, schedule, step count, step size or batch."""
        super().validate()
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"signround schedule={self.schedule!r} is unknown",
                              f"use one of {', '.join(SCHEDULES)}")
        if self.iters is not None and self.iters < 0:
            raise ConfigError(f"signround iters={self.iters} must be >= 0",
                              "use e.g. iters=50 (0 gives round-to-nearest)")
        for attr in ("lr", "minmax_lr"):
            v = getattr(self, attr)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"signround {attr}={v} must be a positive number",
                                  f"use e.g. {attr}=0.005, or leave it unset (1/iters)")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"signround batch_size={self.batch_size} must be >= 1", "use e.g. 4")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"signround sampler={self.sampler!r} is unknown",
                              f"use one of {', '.join(SAMPLERS)}")
        if self.full_range and not self.sym:
            raise ConfigError("signround full_range applies to the symmetric grid only",
                              "set sym: true with full_range: true, or drop full_range")

    def resolved(self) -> tuple[int, float, float, int]:
        """``(iters, lr, minmax_lr, batch_size)`` after the schedule's defaults."""
        iters, lr, bs = SCHEDULES[self.schedule]
        iters = iters if self.iters is None else self.iters
        lr = self.lr if self.lr is not None else (lr if lr is not None and self.iters is None
                                                  else 1.0 / max(iters, 1))
        return iters, lr, (self.minmax_lr if self.minmax_lr is not None else lr), \
            (bs if self.batch_size is None else self.batch_size)


class _WindowSampler:
    """The calibration windows of each step: ``(engine batch index, [rows])``.

    ``"random"``: a batch and ``batch_size`` of its rows drawn at random every step.
    ``"cyclic"``: the batches in a shuffled cycle and each batch's rows in a shuffled
    cycle of its own, so every window is used equally often (as AutoRound's
    ``IndexSampler``; a remainder smaller than ``batch_size`` is reshuffled away).
    """

    def __init__(self, sizes: list[int], batch_size: int, kind: str, generator: torch.Generator):
        self.sizes, self.bs, self.kind, self.g = sizes, batch_size, kind, generator
        self.order: list[int] = []
        self.left: dict[int, list[int]] = {}

    def next(self) -> tuple[int, list[int]]:
        if self.kind == "random":
            bi = int(torch.randint(len(self.sizes), (1,), generator=self.g))
            n = self.sizes[bi]
            return bi, torch.randperm(n, generator=self.g)[:min(self.bs, n)].tolist()
        if not self.order:
            self.order = torch.randperm(len(self.sizes), generator=self.g).tolist()
        bi = self.order.pop(0)
        k = min(self.bs, self.sizes[bi])
        if len(self.left.get(bi, ())) < k:
            self.left[bi] = torch.randperm(self.sizes[bi], generator=self.g).tolist()
        rows, self.left[bi] = self.left[bi][:k], self.left[bi][k:]
        return bi, rows


class _FakeQuant(torch.autograd.Function):
    """``w_hat = (clamp(round(w / s + V) + z, 0, maxq) - z) * s`` with the rounding's
    gradient passed straight through and the clamp's gradient zero outside ``[0, maxq]``:
    the values and ``V``'s gradient bit for bit those of the written-out form
    (:func:`_round_ste` and ``torch.clamp``), the scale's and zero point's gradients equal
    up to float32 rounding, in fewer elementwise passes (1.5x faster on a Gemma-3-270M
    block's weights; the tuning loop runs it on every weight at every step).

    Shapes: ``w, V [groups, gs]``; ``s, z [groups, 1]``; returns ``[groups, gs]``.
    """

    @staticmethod
    def forward(ctx, w, v, s, z, maxq: int):
        ws = torch.div(w, s)
        t = (ws + v).round_().add_(z)
        outside = (t < 0) | (t > maxq)
        qz = t.clamp_(0, maxq).sub_(z)
        ctx.save_for_backward(s, qz - ws.masked_fill_(outside, 0), outside)  # (q - z) - inside w / s
        return qz * s

    @staticmethod
    def backward(ctx, g):
        s, res, outside = ctx.saved_tensors
        gs = gz = None
        if ctx.needs_input_grad[2]:   # d w_hat / d s = (q - z) - inside w / s
            gs = (g * res).sum(1, keepdim=True)
        gv = g * s                    # d w_hat / d V = s inside
        total = gv.sum(1, keepdim=True) if ctx.needs_input_grad[3] else None
        gv.masked_fill_(outside, 0)
        if total is not None:         # d w_hat / d z = -s (1 - inside)
            gz = gv.sum(1, keepdim=True) - total
        return None, gv, gs, gz, None


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` forward, identity backward (straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


def signround_grid(wmin: torch.Tensor, wmax: torch.Tensor, alpha, beta, bits: int, sym: bool,
                   ste: bool = False, full_range: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and integer zero point of each group with clipping factors ``alpha, beta``.

    Args:
        wmin, wmax: ``[groups, 1]`` ``min(min(w), 0)`` and ``max(max(w), 0)`` of each group.
        alpha, beta: ``[groups, 1]`` (or scalars) clipping factors of the min and the max.
        ste: round the zero point with a straight-through gradient (tuning).
        full_range: with ``sym``, the signed-scale grid (module docstring).

    Returns:
        ``(scale [groups, 1], zero [groups, 1])``. With ``alpha = beta = 1`` these are
        bit for bit :func:`edgeprune.quantize.qparams`' (round-to-nearest's grid); a group
        whose range is 0 gets scale 1.
    """
    maxq = 2 ** bits - 1
    if sym and full_range:
        lo, hi = -wmin * alpha, wmax * beta
        scale = round_scale(torch.where(hi > lo, -hi, lo) / 2 ** (bits - 1))
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
    elif sym:
        scale = round_scale(torch.maximum(-wmin * alpha, wmax * beta) * 2 / maxq)
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
    else:
        xmin = wmin * alpha
        scale = round_scale((wmax * beta - xmin) / maxq)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = (_round_ste if ste else torch.round)(-xmin / safe)
    bad = (scale == 0) | ~torch.isfinite(scale)   # alpha, beta in [0, 1]: only full range gives scale < 0
    scale = torch.where(bad, torch.ones_like(scale), scale)
    zero = torch.where(bad, torch.full_like(zero, float(2 ** (bits - 1)) if sym else 0.0), zero)
    return scale, zero.clamp(0, maxq)


class _Layer:
    """One target linear's tuning state: its weight in groups ``[out * G, gs]``, the fixed
    group ranges, and the learnable ``V [out * G, gs]``, ``alpha``, ``beta [out * G, 1]``."""

    def __init__(self, task: LayerTask, key: str, bits: int, group_size: int, sym: bool, minmax: bool,
                 full_range: bool = False):
        out, inp = task.weight.shape
        self.task, self.key, self.bits, self.sym, self.full_range = task, key, bits, sym, full_range
        self.gs = check_quant_args(bits, group_size, inp, name=task.name)
        w = task.weight.float()
        self.mask = None if task.mask is None else task.mask.to(w.device, torch.bool)
        if self.mask is not None:
            w = w * self.mask
        self.shape = (out, inp)
        self.wg = w.reshape(-1, self.gs)
        self.wmin = self.wg.amin(1, keepdim=True).clamp(max=0)
        self.wmax = self.wg.amax(1, keepdim=True).clamp(min=0)
        dev = w.device
        self.v = torch.zeros_like(self.wg, requires_grad=True)
        self.alpha = torch.ones(self.wg.shape[0], 1, device=dev, requires_grad=minmax)
        self.beta = torch.ones(self.wg.shape[0], 1, device=dev, requires_grad=minmax)

    def params(self) -> list[torch.Tensor]:
        return [self.v] + ([self.alpha, self.beta] if self.alpha.requires_grad else [])

    def fake_quant(self) -> torch.Tensor:
        """Differentiable ``W_hat [out, in]`` from the current ``V, alpha, beta``."""
        maxq = 2 ** self.bits - 1
        s, z = signround_grid(self.wmin, self.wmax, self.alpha, self.beta, self.bits, self.sym, ste=True,
                              full_range=self.full_range)
        w = _FakeQuant.apply(self.wg, self.v, s, z, maxq).reshape(self.shape)
        return w if self.mask is None else w * self.mask

    def quantized(self, v, alpha, beta) -> QuantizedWeight:
        """The integer form for offsets/factors ``v, alpha, beta`` (plain rounding)."""
        out, inp = self.shape
        s, z = signround_grid(self.wmin, self.wmax, alpha, beta, self.bits, self.sym, full_range=self.full_range)
        codes = torch.round(self.wg / s + v).add_(z).clamp_(0, 2 ** self.bits - 1).reshape(out, inp)
        zeros = z.reshape(out, -1)
        if self.mask is not None:  # a pruned weight takes its group's zero point: exactly 0
            codes = torch.where(self.mask, codes, zeros.repeat_interleave(self.gs, 1))
        return QuantizedWeight(codes=codes.to(torch.uint8).cpu(), scales=s.reshape(out, -1).float().cpu(),
                               zeros=zeros.to(torch.uint8).cpu(), bits=self.bits, group_size=self.gs,
                               sym=self.sym, meta={"method": "signround"})


def _block_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _take(x, rows: torch.Tensor, n: int):
    """Rows ``rows`` of a batch keyword argument: tensors (and tuples of them, e.g.
    ``position_embeddings``) of 2+ dims whose first dimension is the batch size ``n``;
    anything else (broadcast tensors, ``cache_position``, flags) as is."""
    if isinstance(x, torch.Tensor):
        return x[rows] if x.dim() >= 2 and x.shape[0] == n else x
    if isinstance(x, tuple):
        return tuple(_take(t, rows, n) for t in x)
    return x


def _block_index(block: nn.Module, task: LayerTask) -> Optional[int]:
    """The decoder-block index in ``task.name`` (``model.layers.<i>.self_attn.q_proj``)."""
    rel = next((n for n, m in block.named_modules() if m is task.module), None)
    if not rel or not task.name.endswith("." + rel):
        return None
    tail = task.name[:-len(rel) - 1].rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else None


@register_method(SignRoundConfig)
class SignRound(Method):
    """SignRound quantization (:class:`SignRoundConfig`): the block's target linears are
    tuned jointly on the block's output (:attr:`needs_block_inputs`).

    Attributes:
        last_losses: ``{block index: (loss at step 0 (RTN), best loss)}``, for reports.
    """

    needs_block_inputs = True
    needs_stats = False

    @property
    def stream_autocast(self) -> Optional[torch.dtype]:
        """bfloat16 when the targets run under autocast (``amp`` and ``amp_targets``): the
        quantized stream into the next block is then made as the unquantized one is."""
        return torch.bfloat16 if self.config.amp and self.config.amp_targets else None

    def __init__(self, config):
        super().__init__(config)
        self._fp_next: Optional[tuple] = None  # (block index, unquantized stream into it)
        self.last_losses: dict = {}

    def compress_block(self, block: nn.Module, tasks: list[LayerTask], inputs=None) -> dict[str, LayerResult]:
        """Tune and quantize the target linears of ``block`` (see the module docstring).

        Args:
            block: the decoder block (its weights are read, never changed here).
            tasks: the block's target linears.
            inputs: the engine's calibration batches ``[[hidden [b, seqlen, d], kwargs,
                tokmask [b, seqlen]]]`` (the quantized stream into this block).

        Returns:
            ``{name: LayerResult}`` with the dequantized weight and its codes.
        """
        c = self.config
        iters, lr, minmax_lr, bs = c.resolved()
        rel = {id(m): n for n, m in block.named_modules()}
        layers = [_Layer(t, rel[id(t.module)] + ".weight", c.bits, c.group_size, c.sym, c.minmax_tuning,
                         c.full_range)
                  for t in tasks]
        best = [(ly.v.detach().clone(), ly.alpha.detach().clone(), ly.beta.detach().clone()) for ly in layers]
        notes = []
        idx = _block_index(block, tasks[0])
        if inputs and iters > 0:
            targets = self._targets(block, inputs, idx)
            best, (loss0, loss_best) = self._tune(block, layers, inputs, targets, iters, lr, minmax_lr, bs)
            self.last_losses[idx] = (loss0, loss_best)
        elif inputs and c.fp_targets:
            self._targets(block, inputs, idx)  # keeps the unquantized stream going
        elif iters > 0:
            notes.append(f"{', '.join(t.name for t in tasks)}: no calibration inputs -> RTN")
        out = {}
        for ly, (v, a, b) in zip(layers, best):
            q = ly.quantized(v, a, b)
            w = q.dequantize().to(ly.wg.device)
            out[ly.task.name] = LayerResult(weight=w, quantized=q)
        out[tasks[0].name].notes = notes
        return out

    def _targets(self, block, inputs, idx) -> list[torch.Tensor]:
        """The reference outputs per batch; with ``fp_targets`` they run on the unquantized
        stream, which is kept for the next block (restarted from the engine's stream when
        a block was skipped)."""
        fp_in = [b[0] for b in inputs]
        if self.config.fp_targets and self._fp_next is not None and idx is not None \
                and self._fp_next[0] == idx and [t.shape for t in self._fp_next[1]] == [t.shape for t in fp_in]:
            fp_in = self._fp_next[1]
        dev = fp_in[0].device.type if fp_in else "cpu"
        amp = self.stream_autocast       # the targets' precision is the stream's
        with torch.no_grad(), torch.autocast(dev, dtype=amp or torch.bfloat16, enabled=amp is not None):
            outs = []
            for x, b in zip(fp_in, inputs):
                o = _block_output(block(x, **b[1])).float()
                outs.append(o.masked_fill(~b[2].unsqueeze(-1), 0.0) if not bool(b[2].all()) else o)
        if self.config.fp_targets and idx is not None:
            self._fp_next = (idx + 1, outs)
        return outs

    def _tune(self, block, layers, inputs, targets, iters, lr, minmax_lr, bs):
        """Signed gradient descent; returns the best ``[(V, alpha, beta)]`` and
        ``(loss at step 0, best loss)``."""
        g = torch.Generator().manual_seed(self.config.seed)
        # (parameter, step size, bounds): the offsets V in [-0.5, 0.5], the clipping factors in [0, 1]
        groups = [(ly.v, lr, -0.5, 0.5) for ly in layers] + \
            [(p, minmax_lr, 0.0, 1.0) for ly in layers for p in ly.params()[1:]]
        best_loss, best, loss0 = float("inf"), None, None
        sampler = _WindowSampler([b[0].shape[0] for b in inputs], bs, self.config.sampler, g)
        with torch.enable_grad():
            for step in range(iters):
                bi, picked = sampler.next()
                hidden, kwargs, tokmask = inputs[bi]
                n = hidden.shape[0]
                rows = torch.tensor(picked, dtype=torch.long, device=hidden.device)
                kw = {k: _take(v, rows, n) for k, v in kwargs.items()}
                weights = {ly.key: ly.fake_quant() for ly in layers}
                with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=self.config.amp):
                    out = _block_output(torch.func.functional_call(block, weights, (hidden[rows],), kw,
                                                                   strict=False))
                m = tokmask[rows].unsqueeze(-1).to(out.dtype)
                d = (out.float() - targets[bi][rows].float()) * m
                loss = (d * d).sum() / (m.sum() * out.shape[-1]).clamp(min=1)
                val = float(loss.detach())
                loss0 = val if step == 0 else loss0
                if val < best_loss:  # measured before this step's update (step 0: RTN)
                    best_loss = val
                    best = [(ly.v.detach().clone(), ly.alpha.detach().clone(), ly.beta.detach().clone())
                            for ly in layers]
                grads = torch.autograd.grad(loss, [p for p, *_ in groups], allow_unused=True)
                frac = 1.0 - step / iters  # linear decay to 0
                with torch.no_grad():
                    for (p, size, lo, hi), gr in zip(groups, grads):
                        if gr is not None:
                            p.sub_(torch.sign(gr), alpha=size * frac).clamp_(lo, hi)
        return best, (loss0, best_loss)


__all__ = ["SignRoundConfig", "SignRound", "signround_grid", "SCHEDULES"]
