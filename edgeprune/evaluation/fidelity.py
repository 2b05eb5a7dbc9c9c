"""Fidelity of a compressed model to its dense one (the pruning-vs-quantization study's
point that perplexity alone misleads), on the windows of the perplexity protocol
(:mod:`edgeprune.evaluation.perplexity`):

* ``kl``: mean per-token ``KL(p_dense || p_compressed)`` in nats;
* ``top1_agree``: the share of positions where both models' argmax agree;
* ``snr_db``: **activation SNR** per decoder layer, the study's Table 7 metric. For layer
  ``l`` with output hidden states (the residual stream after the block) ``h_l`` of the
  dense and ``h~_l`` of the compressed model on the same windows, over every token and
  channel: ``SNR_l = 10 log10( sum h_l^2 / sum (h_l - h~_l)^2 )`` dB; ``snr_db`` is the
  mean over layers of ``SNR_l`` (``snr_db_layers`` holds each). Both models must be torch
  models (an ONNX graph exposes no layer outputs: None then). Identical outputs: ``inf``.
* ``continuation_change``: the share of prompts whose greedy continuation of
  ``new_tokens`` (default 32) tokens differs anywhere (or stops at end-of-sequence at a
  different step); the prompts are consecutive ``prompt_len``-token pieces of the same
  windows. ``continuation_agree_tokens`` is the mean count of leading tokens that agree.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import ConfigError
from .perplexity import Protocol, _as_tensor, _check_context, _exp_nll, _logits_fn, eval_windows


@dataclass
class FidelityResult:
    """Fidelity of a compressed model to the dense one on the same windows.

    Attributes:
        kl: mean per-token KL(dense || compressed), nats.
        top1_agree: fraction in [0, 1] of positions with the same argmax.
        ppl_dense, ppl: perplexities of both models on these windows.
        protocol: the windows' :class:`~edgeprune.evaluation.perplexity.Protocol`.
        snr_db: mean over decoder layers of the activation SNR (dB); None without layers.
        snr_db_layers: the SNR of each decoder layer's output (dB).
        continuation_change: share in [0, 1] of prompts whose greedy continuation changes
            (None when not asked for).
        continuation_agree_tokens: mean count of leading continuation tokens that agree.
        continuation_prompts, continuation_tokens: prompts and new tokens per prompt.
    """

    kl: float
    top1_agree: float
    ppl_dense: float
    ppl: float
    protocol: Protocol
    snr_db: Optional[float] = None
    snr_db_layers: list = field(default_factory=list)
    continuation_change: Optional[float] = None
    continuation_agree_tokens: Optional[float] = None
    continuation_prompts: int = 0
    continuation_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["protocol"] = self.protocol.to_dict()
        return d


class _LayerOutputs:
    """Forward hooks keeping each decoder layer's output hidden states ``[B, S, H]``."""

    def __init__(self, model):
        from ..models import decoder_layers

        self.outputs: list[Optional[torch.Tensor]] = []
        self.handles = []
        layers = list(decoder_layers(model))
        self.outputs = [None] * len(layers)
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_hook(self._hook(i)))

    def _hook(self, i):
        def keep(_module, _inputs, out):
            h = out[0] if isinstance(out, (tuple, list)) else out
            self.outputs[i] = h.detach().float().cpu()

        return keep

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _layered(model) -> bool:
    if not isinstance(model, torch.nn.Module):
        return False
    try:
        from ..models import decoder_layers

        return len(decoder_layers(model)) > 0
    except (AttributeError, TypeError):
        return False


def snr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)`` in dB; ``inf`` for zero noise, ``-inf`` for zero signal."""
    if noise <= 0.0:
        return math.inf
    if signal <= 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


class WindowScores:
    """Sums of one model pair's per-window scores (KL, argmax agreement, both NLLs) over
    windows, turned into a :class:`FidelityResult` by :meth:`result`."""

    def __init__(self):
        self.kl = self.agree = self.nll_dense = self.nll = 0.0
        self.ntokens = 0

    def add(self, dense_logits, logits, window: torch.Tensor) -> None:
        """Add one window: both models' logits ``[1, S, V]`` (torch or numpy) of
        ``window`` ``int64 [S]``; positions ``0..S-2`` predict ``window[1:]``."""
        ld = F.log_softmax(_as_tensor(dense_logits)[0, :-1], -1)
        lm = F.log_softmax(_as_tensor(logits)[0, :-1], -1)
        # 0 log 0 = 0: a token both models rule out (-inf) adds nothing (it was NaN)
        self.kl += torch.where(ld > -math.inf, ld.exp() * (ld - lm), 0.0).sum().item()
        self.agree += (ld.argmax(-1) == lm.argmax(-1)).sum().item()
        self.nll_dense += F.nll_loss(ld, window[1:], reduction="sum").item()
        self.nll += F.nll_loss(lm, window[1:], reduction="sum").item()
        self.ntokens += int(window.numel()) - 1

    def result(self, protocol: Protocol) -> FidelityResult:
        """The means per scored token (KL clamped at 0: a float32 sum over identical
        models can land a hair below it).

        Raises:
            EvaluationError: NaN logits (see :func:`~edgeprune.evaluation.perplexity.perplexity`).
        """
        n = max(self.ntokens, 1)
        return FidelityResult(kl=max(self.kl / n, 0.0), top1_agree=self.agree / n,
                              ppl_dense=_exp_nll(self.nll_dense / n), ppl=_exp_nll(self.nll / n),
                              protocol=protocol)


def _greedy_callable(fn, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of a plain logits function (no cache: the whole sequence each step)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(_as_tensor(fn(torch.tensor([ids], dtype=torch.long)))[0, -1].argmax()))
    return ids[len(prompt):]


def _greedy_fns(dense, model, f_dense, f_model):
    """Greedy generators of both models, each ``(prompts, n) -> [tokens per prompt]``: their
    backends (KV cache, the prompts in one batch, stop at end-of-sequence) when both have
    one, else the plain loop for both (the same rule on both sides)."""
    from .backends import RuntimeModel, backend_for

    kinds = (torch.nn.Module, RuntimeModel)
    if isinstance(dense, kinds) and isinstance(model, kinds):
        bd, bm = backend_for(dense), backend_for(model)
        return bd.greedy_many, bm.greedy_many

    def plain(fn):
        return lambda ps, n: [_greedy_callable(fn, p, n) for p in ps]

    return plain(f_dense), plain(f_model)


def continuation_prompts(windows: torch.Tensor, count: int, prompt_len: int) -> torch.Tensor:
    """``count`` consecutive ``prompt_len``-token prompts from the windows' tokens, ``[count, prompt_len]``.

    Raises:
        ConfigError: the windows hold too few tokens, or a count / length below 1.
    """
    if count < 1 or prompt_len < 1:
        raise ConfigError(f"continuations={count}, prompt_len={prompt_len} must be positive",
                          "pass e.g. continuations=32, prompt_len=32")
    flat = windows.reshape(-1)
    if flat.numel() < count * prompt_len:
        raise ConfigError(f"{count} prompts of {prompt_len} tokens need {count * prompt_len} tokens; "
                          f"the windows hold {flat.numel()}", "score more windows or ask for fewer prompts")
    return flat[: count * prompt_len].view(count, prompt_len)


@torch.no_grad()
def fidelity(dense, model, tokenizer, text: str | Path | None = None, *, seqlen: int = 512,
             nwindows: int | None = 40, progress: bool = True, snr: bool = True,
             continuations: int = 0, prompt_len: int = 32, new_tokens: int = 32) -> FidelityResult:
    """KL(dense || compressed), top-1 agreement, both perplexities, activation SNR and the
    greedy-continuation change on the same windows.

    Args:
        dense: the reference model (torch module, export :class:`RuntimeModel` or logits callable).
        model: the compressed model (same kinds).
        tokenizer, text, seqlen, nwindows, progress: as in :func:`~edgeprune.evaluation.perplexity.perplexity`.
        snr: compute the per-layer activation SNR (both must be torch models with decoder layers).
        continuations: prompts for the greedy-continuation change (0: not computed).
        prompt_len: tokens per prompt.
        new_tokens: greedy tokens compared per prompt.

    Returns:
        :class:`FidelityResult` (KL in nats per token; agreement and change in [0, 1]; SNR in dB).

    Raises:
        ConfigError, CalibrationError: as :func:`~edgeprune.evaluation.perplexity.perplexity`;
            too few tokens for the prompts.
    """
    _check_context(seqlen, dense, model)
    windows, proto = eval_windows(tokenizer, text, seqlen=seqlen, nwindows=nwindows)
    prompts = continuation_prompts(windows, continuations, prompt_len) if continuations else None
    f_dense, f_model = _logits_fn(dense), _logits_fn(model)
    with_snr = snr and _layered(dense) and _layered(model)
    hooks = (_LayerOutputs(dense), _LayerOutputs(model)) if with_snr else None
    signal = noise = None
    scores = WindowScores()
    try:
        for w in tqdm(windows, desc="fidelity", unit="win", disable=not progress, leave=False):
            scores.add(f_dense(w[None]), f_model(w[None]), w)
            if hooks is not None:
                hd, hm = hooks[0].outputs, hooks[1].outputs
                s = torch.tensor([h.double().pow(2).sum().item() for h in hd])
                e = torch.tensor([(a.double() - b.double()).pow(2).sum().item() for a, b in zip(hd, hm)])
                signal, noise = (s, e) if signal is None else (signal + s, noise + e)
    finally:
        for h in hooks or ():
            h.close()
    layers = [snr_db(float(s), float(e)) for s, e in zip(signal, noise)] if signal is not None else []
    res = scores.result(proto)
    res.snr_db_layers, res.snr_db = layers, (_mean_db(layers) if layers else None)
    if prompts is not None:
        changed = agree_tokens = 0
        g_dense, g_model = _greedy_fns(dense, model, f_dense, f_model)
        ps = prompts.tolist()
        for a, b in zip(g_dense(ps, new_tokens), g_model(ps, new_tokens)):
            changed += a != b
            agree_tokens += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        res.continuation_change = changed / len(prompts)
        res.continuation_agree_tokens = agree_tokens / len(prompts)
        res.continuation_prompts, res.continuation_tokens = len(prompts), new_tokens
    return res


def _mean_db(layers: list[float]) -> float:
    """Mean of per-layer dB values; ``inf`` when every layer is exact, finite layers only otherwise."""
    finite = [x for x in layers if math.isfinite(x)]
    if not finite:
        return math.inf if all(x == math.inf for x in layers) else -math.inf
    return sum(finite) / len(finite)


__all__ = ["FidelityResult", "WindowScores", "fidelity", "snr_db", "continuation_prompts"]
