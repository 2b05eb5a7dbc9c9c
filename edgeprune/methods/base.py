"""The one small interface every compression method implements, and the helpers the
score-based pruners share (keep-masks) or every method uses (:func:`relative_error`).

The engine (:mod:`edgeprune.engine`) runs the calibration data block by block, gathers
per-linear input statistics (:class:`InputStats`) with forward hooks and hands each
method the target linears of one decoder block as :class:`LayerTask` objects. The
method returns one :class:`LayerResult` per layer: a new dense weight (masked or
fake-quantized), plus the keep-mask (pruning) or integer codes (quantization). The
engine writes the weights back; it never special-cases a method by name.

Layers that read the *same* input tensor (q/k/v_proj; gate/up_proj) share one
:class:`InputStats` object, so their Hessian is computed once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError
from ..quantize import QuantizedWeight, check_quant_args


@dataclass
class InputStats:
    """Calibration statistics of one linear-layer input ``X [n_tokens, in]``.

    Padded positions (``attention_mask == 0``) and tokens whose activations are not
    finite never enter these sums.

    Attributes:
        h_sum: ``float32 [in, in]`` ``X^T X`` (``None`` when no method needs it).
        sq_sum: ``float32 [in]`` ``sum_t x_tj^2`` (``||X_j||_2^2``, Wanda's norm squared).
        abs_sum: ``float32 [in]`` ``sum_t |x_tj|`` (AWQ's activation magnitude).
        n_tokens: tokens accumulated.
        n_excluded: tokens dropped because their activations were NaN/inf.
    """

    h_sum: Optional[torch.Tensor]
    sq_sum: torch.Tensor
    abs_sum: torch.Tensor
    n_tokens: int = 0
    n_excluded: int = 0
    e_sum: Optional[torch.Tensor] = None
    e_tokens: int = 0
    e_cap: int = 0

    @classmethod
    def empty(cls, in_features: int, hessian: bool, device="cpu", error_tokens: int = 0) -> "InputStats":
        """Zeroed statistics; ``error_tokens > 0`` also keeps ``X_e^T X_e`` of the first
        ``error_tokens`` tokens (:attr:`error_hessian`, used to report layer errors)."""
        z = lambda *s: torch.zeros(*s, dtype=torch.float32, device=device)  # noqa: E731
        return cls(h_sum=z(in_features, in_features) if hessian else None,
                   sq_sum=z(in_features), abs_sum=z(in_features), e_cap=int(error_tokens))

    def add(self, x: torch.Tensor) -> None:
        """Accumulate ``x [tokens, in]`` (already filtered to valid, finite tokens)."""
        n = x.shape[0]
        if n == 0:
            return
        x = x.float()
        k = min(max(self.e_cap - self.e_tokens, 0), n)
        if self.h_sum is not None:
            if k and self.e_sum is None and self.e_tokens + k >= self.e_cap:
                # reaching the cap (inside this batch or exactly at its end): snapshot the prefix
                self.h_sum.addmm_(x[:k].t(), x[:k])
                self.e_sum = self.h_sum.clone()
                if k < n:
                    self.h_sum.addmm_(x[k:].t(), x[k:])
            else:
                self.h_sum.addmm_(x.t(), x)
        elif k:
            if self.e_sum is None:
                self.e_sum = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
            self.e_sum.addmm_(x[:k].t(), x[:k])
        self.e_tokens += k
        self.sq_sum += (x * x).sum(0)
        self.abs_sum += x.abs().sum(0)
        self.n_tokens += n

    @property
    def error_hessian(self) -> Optional[torch.Tensor]:
        """``X_e^T X_e / n_e`` over the first ``e_cap`` tokens (all tokens when fewer), or ``None``."""
        if self.e_tokens == 0:
            return None
        if self.e_sum is None:  # never crossed the cap: the full Hessian is the prefix
            return None if self.h_sum is None else self.h_sum / self.e_tokens
        return self.e_sum / self.e_tokens

    @property
    def hessian(self) -> torch.Tensor:
        """``H = X^T X / n_tokens`` ``[in, in]`` (the GPTQ/SparseGPT Hessian up to the factor 2)."""
        if self.h_sum is None:
            raise RuntimeError("Hessian was not accumulated for this layer")
        return self.h_sum / max(self.n_tokens, 1)

    @property
    def act_norm(self) -> torch.Tensor:
        """``||X_j||_2`` per input channel ``[in]`` (Wanda)."""
        return self.sq_sum.sqrt()

    @property
    def abs_mean(self) -> torch.Tensor:
        """``mean_t |x_tj|`` per input channel ``[in]`` (AWQ)."""
        return self.abs_sum / max(self.n_tokens, 1)

    def scaled(self, s: torch.Tensor) -> "InputStats":
        """Statistics of ``x / s`` (AWQ folds ``s`` into the preceding op): exact transform."""
        inv = 1.0 / s.float()
        sc = lambda m: None if m is None else m * inv[:, None] * inv[None, :]  # noqa: E731
        return InputStats(h_sum=sc(self.h_sum), sq_sum=self.sq_sum * inv * inv, abs_sum=self.abs_sum * inv,
                          n_tokens=self.n_tokens, n_excluded=self.n_excluded, e_sum=sc(self.e_sum),
                          e_tokens=self.e_tokens, e_cap=self.e_cap)


@dataclass
class LayerTask:
    """One target linear of the current block, as a method sees it.

    Attributes:
        name: module name as in ``model.named_modules()``.
        module: the ``nn.Linear`` (methods may read it; the engine writes the result back).
        weight: ``float32 [out, in]`` copy of the current weight.
        mask: ``bool [out, in]`` kept weights from an earlier pruning stage, or ``None``.
        stats: calibration statistics of the layer's input (shared within q/k/v, gate/up).
        quantize: ``False`` when a later stage will quantize this layer (AWQ then only
            folds scales and clips).
    """

    name: str
    module: nn.Linear
    weight: torch.Tensor
    mask: Optional[torch.Tensor]
    stats: InputStats
    quantize: bool = True


@dataclass
class LayerResult:
    """What a method returns for one layer.

    Attributes:
        weight: ``float32 [out, in]`` new dense-equivalent weight (masked and/or
            dequantized); the engine writes it back in the layer's dtype.
        mask: ``bool [out, in]`` kept weights (pruning methods), else ``None``.
        pattern: ``"2:4"``-style or ``"unstructured"`` for pruned layers.
        quantized: integer codes/scales/zeros (quantization methods).
        notes: fallbacks taken, human-readable (end up in ``CompressionResult.fallbacks``).
        reference: the layer's uncompressed weight expressed in the coordinates of its new
            input/output when the method rescaled them (AWQ folding); errors are measured
            against it.
        stats: input statistics in those new coordinates (AWQ), else ``None``.
        error: relative reconstruction error when the method computed it.
    """

    weight: torch.Tensor
    mask: Optional[torch.Tensor] = None
    pattern: Optional[str] = None
    quantized: Optional[QuantizedWeight] = None
    notes: list = field(default_factory=list)
    reference: Optional[torch.Tensor] = None
    stats: Optional[InputStats] = None
    error: Optional[float] = None


def _from_config(attr: str, doc: str) -> property:
    """A read-only :class:`Method` property answered by its config (the one place it is set)."""
    return property(lambda self: getattr(self.config, attr), doc=doc)


class Method:
    """Base class of the compression methods.

    A subclass is joined to its config class by
    :func:`~edgeprune.methods.registry.register_method` (which sets :attr:`name` and
    :attr:`config_class`), sets what it needs (:attr:`needs_hessian`, :attr:`data_free`,
    :attr:`needs_block_inputs`, :attr:`needs_stats`), and implements
    :meth:`compress_layer` (one layer), or :meth:`compress_group` (layers sharing one
    input, e.g. q/k/v), or :meth:`compress_block` for methods that rewrite several modules
    jointly (AWQ). What the method does to a layer (prunes, quantizes, may precede a
    quantizer) is its config's: :attr:`is_pruner`, :attr:`is_quantizer`,
    :attr:`quantizes`, :attr:`may_precede_quantizer` read it.
    """

    #: the registered name (set by ``register_method``)
    name = ""
    #: the config class (set by ``register_method``)
    config_class: Optional[type] = None
    #: the engine accumulates ``X^T X`` of each target's input (GPTQ, SparseGPT, AWQ)
    needs_hessian = False
    #: True when the method uses no calibration statistics (magnitude, RTN): with
    #: ``measure_errors=False`` the engine then runs no forward pass for it.
    data_free = False
    #: True for methods that reconstruct a block's outputs (SignRound-style): the engine
    #: then calls ``compress_block(block, tasks, inputs=batches)`` with the block's
    #: calibration inputs ``[[hidden [b, seqlen, hidden_size], kwargs, tokmask bool [b,
    #: seqlen]]]`` (the outputs of the already-compressed blocks before it; read-only).
    needs_block_inputs = False
    #: False for methods that never read :attr:`LayerTask.stats` (SignRound and FISTAPruner
    #: work from the block inputs): with ``measure_errors=False`` the engine then skips the
    #: statistics pass, one forward of the block over every calibration window per stage;
    #: with it, the pass covers only the batches holding the ``error_tokens``.
    needs_stats = True
    #: the autocast dtype under which the engine carries the calibration stream past a
    #: block this method compressed (None: the model's dtype). SignRound with ``amp``
    #: produces its unquantized stream under bfloat16 autocast, so the quantized stream
    #: goes the same way; the engine uses it only when every data-driven stage agrees.
    stream_autocast: Optional[torch.dtype] = None
    #: True for a method that runs once over the whole model after every block-wise stage
    #: (E2E-QP): the engine leaves it out of the per-block plan and calls
    #: :meth:`tune_model` with a frozen copy of the model as it was before the recipe.
    model_scope = False

    def __init__(self, config):
        self.config = config

    is_pruner = _from_config("is_pruner", "The method removes weights (see MethodConfig).")
    is_quantizer = _from_config("is_quantizer", "The method rounds weights to an integer grid.")
    quantizes = _from_config("quantizes", "This stage leaves integer codes (SparseGPT: only with bits).")
    may_precede_quantizer = _from_config("may_precede_quantizer",
                                         "The method may run on a layer a later stage quantizes (AWQ).")

    # -- validation -------------------------------------------------------------
    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        """Raise :class:`ConfigError` when this method cannot handle a layer's shape."""
        c = self.config
        if getattr(c, "prune_m", 0):
            if in_features % c.prune_m:
                raise ConfigError(
                    f"{name}: input size {in_features} is not divisible by prune_m={c.prune_m}",
                    f"use an N:M pattern whose M divides {in_features} (e.g. 2:4), or add "
                    f"{name.rsplit('.', 1)[-1]!r} to ignore")
        bits = getattr(c, "bits", None)
        if bits is not None:
            check_quant_args(bits, c.group_size, in_features, name=name)

    # -- compression ------------------------------------------------------------
    def compress_block(self, block: nn.Module, tasks: list[LayerTask]) -> dict[str, LayerResult]:
        """Compress the target linears of one block; default: by shared-input group."""
        groups: dict[int, list[LayerTask]] = {}
        for t in tasks:
            groups.setdefault(id(t.stats), []).append(t)
        out: dict[str, LayerResult] = {}
        for g in groups.values():
            for t, r in zip(g, self.compress_group(g)):
                out[t.name] = r
        return out

    def compress_group(self, tasks: list[LayerTask]) -> list[LayerResult]:
        """Compress layers that share one input (same :class:`InputStats`)."""
        return [self.compress_layer(t) for t in tasks]

    def compress_layer(self, task: LayerTask) -> LayerResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def tune_model(self, model: nn.Module, teacher: nn.Module, targets: dict, calib_ids: torch.Tensor,
                   attention_mask: Optional[torch.Tensor] = None, *,
                   progress: bool = False) -> dict:  # pragma: no cover - abstract
        """A :attr:`model_scope` method's work on the whole model (see
        :meth:`edgeprune.methods.e2eqp.E2EQP.tune_model`); returns its report, whose
        ``"notes"`` are fallbacks."""
        raise NotImplementedError


# -- shared helpers ---------------------------------------------------------------

def pattern_name(cfg) -> str:
    """``"2:4"`` for N:M configs, else ``"unstructured"``."""
    return f"{cfg.prune_n}:{cfg.prune_m}" if getattr(cfg, "prune_n", 0) else "unstructured"


def nm_keep_mask(score: torch.Tensor, prune_n: int, prune_m: int) -> torch.Tensor:
    """Keep the ``prune_n`` highest-scoring weights of every ``prune_m`` consecutive inputs.

    Args:
        score: ``[out, in]`` importance (higher = keep); ``in % prune_m == 0``.

    Returns:
        ``bool [out, in]`` keep-mask with exactly ``prune_n`` True per group of ``prune_m``.
    """
    out, inp = score.shape
    s = score.reshape(out, inp // prune_m, prune_m)
    idx = torch.topk(s, prune_n, dim=-1, largest=True).indices
    keep = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, True)
    return keep.reshape(out, inp)


def row_keep_mask(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Per-output-row pruning (Wanda's comparison group) with an exact layer total.

    Each row prunes ``k`` or ``k+1`` of its lowest scores so the layer removes exactly
    ``round(out*in*sparsity)`` weights (per-layer sparsity within ``1/(out*in)`` of the
    target); the ``k+1``-th weight is removed in the rows where it scores lowest.

    Returns:
        ``bool [out, in]`` keep-mask.
    """
    out, inp = score.shape
    total = int(round(out * inp * sparsity))
    k, extra = divmod(total, out)
    order = torch.argsort(score, dim=1, stable=True)  # ascending: first = pruned first
    n_prune = torch.full((out,), k, dtype=torch.long, device=score.device)
    if extra and k < inp:
        nxt = score.gather(1, order[:, k:k + 1]).squeeze(1)
        rows = torch.argsort(nxt, stable=True)[:extra]
        n_prune[rows] += 1
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(inp, device=score.device).expand(out, inp).contiguous())
    return ranks >= n_prune[:, None]


def layer_keep_mask(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Per-layer pruning: remove exactly ``round(numel*sparsity)`` lowest scores."""
    total = int(round(score.numel() * sparsity))
    keep = torch.ones(score.numel(), dtype=torch.bool, device=score.device)
    if total:
        idx = torch.argsort(score.flatten(), stable=True)[:total]
        keep[idx] = False
    return keep.reshape(score.shape)


def keep_mask_from_score(score: torch.Tensor, sparsity: float = 0.5, prune_n: int = 0,
                         prune_m: int = 0, mask: torch.Tensor | None = None,
                         per_row: bool = True) -> torch.Tensor:
    """Keep-mask from an importance score (higher = keep), shared by the score-only
    pruners (magnitude, Wanda).

    Args:
        score: ``[out, in]`` importance.
        sparsity: fraction removed; ignored when ``prune_n`` is set.
        prune_n, prune_m: N:M pattern (:func:`nm_keep_mask`).
        mask: an earlier ``bool [out, in]`` keep-mask; already-pruned weights score lowest
            so they stay pruned.
        per_row: compare within output rows (:func:`row_keep_mask`, Wanda) or across the
            layer (:func:`layer_keep_mask`, magnitude).

    Returns:
        ``bool [out, in]`` keep-mask.
    """
    score = score.float()
    if mask is not None:
        score = torch.where(mask.to(torch.bool), score, torch.full_like(score, -1.0))
    if prune_n:
        return nm_keep_mask(score, prune_n, prune_m)
    return row_keep_mask(score, sparsity) if per_row else layer_keep_mask(score, sparsity)


def relative_error(w_ref: torch.Tensor, w_new: torch.Tensor, H: torch.Tensor) -> float:
    """``||W X - W' X||^2 / ||W X||^2`` computed as ``tr(dW H dW^T) / tr(W H W^T)``.

    Args:
        w_ref, w_new: ``[out, in]``; H: ``[in, in]`` ``= X^T X / n``.
    """
    d = (w_ref.float() - w_new.float())
    num = float(((d @ H) * d).sum())
    den = float(((w_ref.float() @ H) * w_ref.float()).sum())
    if not den > 0:
        return 0.0 if num == 0 else float("inf")
    return num / den


class single_thread:
    """Context manager: torch intra-op threads = 1 on CPU (restored on exit).

    Used around loops of many small or medium element-wise ops (the OBS column sweep,
    the AWQ grid searches): thread fork/join per op costs more than it saves there, by
    3-8x when the machine's cores are shared with other jobs.
    """

    def __init__(self, device="cpu"):
        self.active = torch.device(device).type == "cpu"
        self.prev = None

    def __enter__(self):
        if self.active:
            self.prev = torch.get_num_threads()
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        if self.active and self.prev is not None:
            torch.set_num_threads(self.prev)
        return False


__all__ = ["InputStats", "LayerTask", "LayerResult", "Method", "nm_keep_mask", "row_keep_mask",
           "layer_keep_mask", "keep_mask_from_score", "pattern_name", "relative_error", "single_thread"]
