"""E2E-QP: end-to-end training of the quantization step sizes, the integer codes frozen.

After a block-wise quantizer (GPTQ, RTN, SignRound...) has fixed every layer's codes ``q``
and zero points ``z``, each layer's group scales ``s`` are trained jointly over the whole
model, as the second phase of EfficientQAT (Chen, Shao, Zhang et al., "EfficientQAT:
Efficient Quantization-Aware Training for Large Language Models", ACL 2025; E2E-QP, Sec.
3.3), with the loss replaced by distillation from the unquantized model on the calibration
windows (as in knowledge-distillation QAT, e.g. LLM-QAT, Liu et al. 2023)::

    w_hat = (q - z) * s0 * (1 + d)                       # d [out, n_groups], starts at 0
    min_d  sum_t KL( p_dense(. | x_<t) || p_quant(. | x_<t; w_hat) ) / n_tokens

Block-wise methods fit each layer (or block) to its own output; this stage corrects the
error that the blocks leave *together*, measured where it matters, on the next-token
distribution. Only ``n_groups`` numbers per row move (``1 / group_size`` of the weights,
1.6 M on SmolLM2-135M at group 64), so a few passes over 32 windows do not overfit the way
training every weight would.

Adam (``lr`` on the relative change ``d``, cosine decay to 0 over ``epochs`` passes,
``batch_size`` windows per step, the windows in an order drawn from ``seed``), the forward
and backward passes under bfloat16 autocast with ``amp`` (the loss in float32). At the
end every scale is rounded to float16 (:func:`edgeprune.quantize.round_scale`, what the
ONNX export stores), the layer's weight becomes exactly ``(q - z) * s`` (masked where an
earlier stage pruned), so the exported ``MatMulNBits`` blocks equal the PyTorch model.
Codes, zero points, ``g_idx`` and bits per weight are unchanged.

The stage is model-scope (:attr:`E2EQP.model_scope`): the engine runs it once, after every
block of every block-wise stage, with a frozen copy of the model as it was before the
recipe (the teacher); it must be the recipe's last stage and tunes the layers an earlier
stage quantized that it selects.

Measured (``bench/compare_methods.py``; C4 calibration windows, WikiText-2 test 40 x 512,
PyTorch fake quant; ``docs/signround-fista.md``): SmolLM2-135M ``best-w4-e2e``
(best-w4-refit then this stage, 4.473 bits per weight) 30.91 on 128 windows and 31.14 on
32, against 31.35 / 31.48 without it (dense 28.74); after RTN int4 g64 asymmetric on 32
windows, Gemma-3-270M 108.4 -> 63.37 (dense 62.93) and Qwen2.5-Coder-0.5B 45.63 -> 43.84
(dense 43.05).

Memory: a frozen copy of the model (the teacher) and one step's activations. The head and
the KL run over chunks of positions (about 16 M logits each), so neither model's
``[batch_size, seqlen, vocab]`` logits are ever whole; models whose logits are not
``head(decoder(...))`` fall back to whole logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..quantize import QuantizedWeight, round_scale
from .base import Method
from .config import MethodConfig
from .registry import register_method


@dataclass
class E2EQPConfig(MethodConfig):
    """Settings of the end-to-end scale training (:mod:`edgeprune.methods.e2eqp`).

    Attributes:
        epochs: passes over the calibration windows (0: the scales stay as they are,
            bit for bit).
        lr: Adam step size on the relative scale change ``d = s / s0 - 1``.
        batch_size: calibration windows per step.
        amp: forward and backward under bfloat16 autocast (CPU and CUDA); the KL itself
            in float32.
        seed: the order of the windows in each epoch.
    """

    epochs: int = 2
    lr: float = 1e-3
    batch_size: int = 2
    amp: bool = True
    seed: int = 0
    method = "e2e-qp"

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a negative epoch count, a step size <= 0 or a
        batch < 1."""
        super().validate()
        if self.epochs < 0:
            raise ConfigError(f"e2e-qp epochs={self.epochs} must be >= 0",
                              "use e.g. epochs=2 (0 leaves the scales as they are)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"e2e-qp lr={self.lr} must be a positive number", "use e.g. lr=0.001")
        if self.batch_size < 1:
            raise ConfigError(f"e2e-qp batch_size={self.batch_size} must be >= 1", "use e.g. 2")


class _ScaledLinear(nn.Module):
    """``y = x (q - z) * s0 * (1 + d)`` for one quantized linear (its codes frozen)."""

    def __init__(self, lin: nn.Linear, q: QuantizedWeight, mask: Optional[torch.Tensor]):
        super().__init__()
        dev = lin.weight.device
        g = q.group_index().to(dev)
        # (q - z) is an integer in [-255, 255]: exact in bfloat16, half the bytes of float32
        cz = q.codes.to(dev).float() - q.zeros.to(dev).float()[:, g]
        if mask is not None:
            cz = cz * mask.to(dev)
        self.register_buffer("cz", cz.to(torch.bfloat16), persistent=False)
        self.register_buffer("s0", q.scales.to(dev).float(), persistent=False)
        self.register_buffer("g", g, persistent=False)
        self.d = nn.Parameter(torch.zeros_like(self.s0))
        self.bias = lin.bias
        self.grouped = q.g_idx is None and q.codes.shape[1] == q.n_groups * q.group_size
        self.gs = q.group_size

    def scales(self) -> torch.Tensor:
        return self.s0 * (1 + self.d)

    def weight(self) -> torch.Tensor:
        s = self.scales()
        if self.grouped:
            out, inp = self.cz.shape
            return (self.cz.float().view(out, -1, self.gs) * s[:, :, None]).view(out, inp)
        return self.cz.float() * s[:, self.g]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight()
        if x.dtype != w.dtype and not torch.is_autocast_enabled():
            w = w.to(x.dtype)
        return F.linear(x, w, self.bias)


def _kl(teacher_logits: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Sum over the valid positions of ``KL(softmax(teacher) || softmax(logits))``, in
    float32; logits ``[..., vocab]``, ``valid`` of their leading shape (1 = scored)."""
    lt = F.log_softmax(teacher_logits.float(), -1)
    ls = F.log_softmax(logits.float(), -1)
    return ((lt.exp() * (lt - ls)).sum(-1) * valid).sum()


def _decoder_and_head(model: nn.Module):
    """``(decoder, head)`` with ``logits = head(decoder(...).last_hidden_state)`` (the head
    with Gemma's final soft cap), or None when the model does not expose them."""
    try:
        dec, lin = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if dec is None or lin is None:
        return None
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)

    def head(h: torch.Tensor) -> torch.Tensor:
        y = lin(h)
        return torch.tanh(y / cap) * cap if cap else y
    return dec, head


@torch.no_grad()
def _split_head(model: nn.Module, teacher: nn.Module, ids: torch.Tensor):
    """``(decoder, head, teacher decoder, teacher head, positions per chunk)`` when both
    models' logits equal ``head(decoder(ids))`` on ``ids`` (checked), else None: the KL is
    then taken over chunks of positions so that only a chunk's ``[positions, vocab]``
    logits are alive at a time (:func:`_loss_backward`)."""
    parts = [_decoder_and_head(m) for m in (model, teacher)]
    if any(p is None for p in parts):
        return None
    for m, (dec, head) in zip((model, teacher), parts):
        full = m(input_ids=ids).logits.float()
        via = head(dec(input_ids=ids).last_hidden_state).float()
        if full.shape != via.shape or not torch.allclose(full, via, rtol=1e-5, atol=1e-5):
            return None
    return (*parts[0], *parts[1], max(16, 2 ** 24 // int(full.shape[-1])))


def _loss_backward(model, teacher, ids, m, amp, split) -> float:
    """The mean KL per valid token of one batch ``ids [b, seqlen]`` (mask ``m``), its
    gradient accumulated into the trainable parameters; NaN (no gradient applied) when
    the loss is not finite. With ``split``, the head and the KL run over chunks of
    positions and their gradient reaches the decoder through one backward pass from the
    final hidden states: the same gradient, without ``[b, seqlen, vocab]`` logits."""
    valid = m.float()
    n = valid.sum().clamp(min=1)
    if split is None:
        with torch.no_grad(), amp:
            t = teacher(input_ids=ids, attention_mask=m).logits
        with amp:
            s = model(input_ids=ids, attention_mask=m).logits
        loss = _kl(t, s, valid) / n
        del t, s
        if not bool(torch.isfinite(loss)):
            return float("nan")
        loss.backward()
        return loss.item()
    dec, head, tdec, thead, chunk = split
    with torch.no_grad(), amp:
        ht = tdec(input_ids=ids, attention_mask=m).last_hidden_state.flatten(0, 1)
    with amp:
        hs = dec(input_ids=ids, attention_mask=m).last_hidden_state
    hd = hs.detach().requires_grad_()
    flat, v = hd.flatten(0, 1), valid.flatten()
    total = 0.0
    for j in range(0, flat.shape[0], chunk):
        with torch.no_grad(), amp:
            t = thead(ht[j:j + chunk])
        with amp:
            loss = _kl(t, head(flat[j:j + chunk]), v[j:j + chunk]) / n
        if not bool(torch.isfinite(loss)):
            return float("nan")
        loss.backward()
        total += loss.item()
    hs.backward(hd.grad)
    return total


@register_method(E2EQPConfig)
class E2EQP(Method):
    """End-to-end scale training (:class:`E2EQPConfig`); see the module docstring."""

    #: runs once over the whole model after every block-wise stage (engine)
    model_scope = True
    needs_stats = False

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        """Every layer shape is fine: the grid is the earlier stage's."""

    def tune_model(self, model: nn.Module, teacher: nn.Module, targets: dict, calib_ids: torch.Tensor,
                   attention_mask: Optional[torch.Tensor] = None, *, progress: bool = False) -> dict:
        """Train the scales of ``targets`` in place.

        Args:
            model: the quantized causal LM (its target linears hold ``(q - z) * s``).
            teacher: the model before the recipe, frozen (not modified).
            targets: module name -> ``(nn.Linear, QuantizedWeight, keep-mask or None)``;
                each ``QuantizedWeight``'s ``scales`` is replaced by the trained, float16-
                rounded scales and the module's weight by its dequantized form.
            calib_ids: ``int64 [nsamples, seqlen]`` calibration windows.
            attention_mask: optional ``[nsamples, seqlen]`` (0 = padding, not scored).
            progress: show a tqdm bar over the steps.

        Returns:
            ``{"steps", "kl_first_epoch", "kl_last_epoch", "scale_change_mean",
            "scale_change_max", "notes"}``: mean KL per token (nats) of the first and last
            epoch, the mean and largest ``|s / s0 - 1|`` after rounding, and fallbacks
            (a non-finite loss leaves every scale as it was).
        """
        c = self.config
        n = int(calib_ids.shape[0])
        per_epoch = math.ceil(n / c.batch_size)
        steps = c.epochs * per_epoch
        info = {"steps": 0, "kl_first_epoch": None, "kl_last_epoch": None,
                "scale_change_mean": 0.0, "scale_change_max": 0.0, "notes": []}
        if steps == 0 or not targets:
            return info
        dev = next(model.parameters()).device
        mods = dict(model.named_modules())
        wrapped = {name: _ScaledLinear(lin, q, mask) for name, (lin, q, mask) in targets.items()}
        frozen = [(p, p.requires_grad) for p in model.parameters()]
        for p, _ in frozen:
            p.requires_grad_(False)
        for p in teacher.parameters():
            p.requires_grad_(False)
        was = model.training, teacher.training
        model.eval()
        teacher.eval()
        for name, w in wrapped.items():
            parent, _, child = name.rpartition(".")
            setattr(mods[parent], child, w)
        params = [w.d for w in wrapped.values()]
        opt = torch.optim.Adam(params, lr=c.lr, betas=(0.9, 0.99))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda i: 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
        g = torch.Generator().manual_seed(c.seed)
        mask = torch.ones_like(calib_ids) if attention_mask is None else attention_mask
        amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=c.amp)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=steps, desc="e2e-qp", unit="step", leave=True)
        ok = True
        try:
            split = _split_head(model, teacher, calib_ids[:1, :8].to(dev))
            for ep in range(c.epochs):
                order = torch.randperm(n, generator=g)
                total = 0.0
                for i in range(0, n, c.batch_size):
                    rows = order[i:i + c.batch_size]
                    ids, m = calib_ids[rows].to(dev), mask[rows].to(dev)
                    opt.zero_grad(set_to_none=True)
                    kl = _loss_backward(model, teacher, ids, m, amp, split)
                    if not math.isfinite(kl):
                        ok = False
                        info["notes"].append(f"e2e-qp: loss not finite at step {info['steps'] + 1} "
                                             "-> scales left as the earlier stage set them")
                        break
                    opt.step()
                    sched.step()
                    with torch.no_grad():
                        for p in params:
                            p.clamp_(min=-0.5, max=0.5)
                    info["steps"] += 1
                    total += kl
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(kl=f"{kl:.4f}")
                if not ok:
                    break
                if ep == 0:
                    info["kl_first_epoch"] = total / per_epoch
                info["kl_last_epoch"] = total / per_epoch
        finally:
            if bar is not None:
                bar.close()
            for name, (lin, _, _) in targets.items():
                parent, _, child = name.rpartition(".")
                setattr(mods[parent], child, lin)
            for p, r in frozen:
                p.requires_grad_(r)
            model.train(was[0])
            teacher.train(was[1])
        if not ok:
            return info
        changes = []
        with torch.no_grad():
            for name, (lin, q, keep) in targets.items():
                w = wrapped[name]
                new = round_scale(w.scales()).cpu()
                if not bool(torch.isfinite(new).all()):
                    info["notes"].append(f"{name}: e2e-qp scales not finite -> left as they were")
                    continue
                changes.append((new / q.scales.float() - 1).abs())
                q.scales = new.to(q.scales.dtype)
                wq = q.dequantize()
                if keep is not None:
                    wq = wq * keep
                lin.weight.data.copy_(wq.to(device=lin.weight.device, dtype=lin.weight.dtype))
        if changes:
            allc = torch.cat([x.flatten() for x in changes])
            info["scale_change_mean"] = float(allc.mean())
            info["scale_change_max"] = float(allc.max())
        return info


__all__ = ["E2EQPConfig", "E2EQP"]
