"""The sequential, layer-wise compression engine: :func:`compress`.

Calibration activations flow through the decoder block by block (the "sequential"
mode of the GPTQ/SparseGPT/Wanda reference code and llm-compressor):

1. The inputs of block 0 (hidden states plus the keyword arguments the model passes to
   its decoder layers: ``position_embeddings``, ``attention_mask``, ``position_ids``...)
   are captured with a pre-hook on block 0 that stops the forward pass
   (:mod:`edgeprune.blocks` holds this capture, the replay and the statistics hooks).
2. For block ``i`` and each recipe stage: one forward pass of the block over all
   calibration batches, with forward hooks on the stage's target linears accumulating
   their input statistics (:class:`~edgeprune.methods.base.InputStats`; linears that read
   the same tensor, q/k/v and gate/up, share one Hessian); then the method compresses the
   block's targets and the engine writes the new weights back in place.
3. The compressed block is run again to produce the inputs of block ``i+1``, so block
   ``i`` sees the outputs of the already-compressed blocks ``0..i-1``.

With ``forward_dtype=torch.bfloat16`` on a float32 model, the calibration forward passes
(statistics, next block's inputs) run on a bfloat16 shadow copy of each block, re-synced
after every weight write-back; weights, Hessians and every method's arithmetic stay
float32 (methods that run the block themselves get float32 inputs). On CPUs with
AVX512-BF16 or AMX a linear runs 2.4x faster in bfloat16. A method may instead ask for
the next block's inputs under autocast (:attr:`Method.stream_autocast`; SignRound with its
targets under bfloat16 autocast): the engine honours it when every data-driven stage of
the recipe asks for the same dtype.

Memory is bounded by one block's activations (``nsamples x seqlen x hidden``) plus one
block's Hessians. Padded positions (``attention_mask == 0``) and tokens whose activations
are NaN/inf never enter a statistic.

Nothing is downgraded silently: a layer whose method fell back to another (RTN,
magnitude, AWQ without its scaling) is listed in :attr:`CompressionResult.fallbacks` and
counted in one :class:`FallbackWarning`; a compressed model whose activations or logits
stop being finite on the calibration windows fails the run, naming the layer
(:mod:`edgeprune.finite`).

The model is modified IN PLACE: every compressed linear holds its dense equivalent
(masked weight, or dequantized fake-quant weight in the original dtype), so the PyTorch
model evaluates exactly what is exported; the integer codes are in
:attr:`CompressionResult.quantized`.
"""

from __future__ import annotations

import copy
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from .blocks import (StatsCollector, capture_block_inputs, cast_batches, find_decoder_blocks, move_own_tensors,
                     run_block, sequential_groups)
from .errors import CalibrationError, ConfigError, EdgePruneError
from .finite import FiniteWatch
from .models import check_device
from .methods import config_classes, get_method
from .methods.base import InputStats, LayerResult, LayerTask, relative_error
from .methods.config import check_group_size, pattern_matches
from .methods.magnitude import Magnitude, MagnitudeConfig
from .methods.rtn import RTN, RTNConfig
from .recipe import Recipe, as_recipe


#: A fallback note whose last step names the method that ran instead ("... -> RTN",
#: "... -> magnitude", "... -> clip + RTN only"); "... -> damp x10 (4 tries)" is not one.
_METHOD_CHANGE = re.compile(r"-> (RTN|magnitude|clip \+ RTN only)\b[^>]*$")


class FallbackWarning(UserWarning):
    """:func:`compress` applied another method than the recipe's to some layers (the one
    line of :meth:`CompressionResult.fallback_summary`); the CLI prints it."""


@dataclass
class CompressionResult:
    """What :func:`compress` did.

    Attributes:
        quantized: module name (as in ``model.named_modules()``) -> integer codes of
            quantized layers, in original column order.
        masks: module name -> ``bool [out, in]`` kept weights of pruned layers.
        sparsity_pattern: module name -> ``"2:4"``-style or ``"unstructured"``.
        layer_errors: module name -> relative reconstruction error
            ``||W X - W' X||^2 / ||W X||^2`` on the calibration inputs the layer saw.
        fallbacks: human-readable fallbacks taken, e.g.
            ``"model.layers.3.mlp.down_proj: Hessian singular -> damp x10 (4 tries) -> RTN"``.
        seconds: wall time of :func:`compress`.
        recipe: ``Recipe.to_dict()`` of what ran.
        tuning: ``"<stage>:<method>"`` -> what each model-scope stage reports (E2E-QP:
            steps, mean KL per token of its first and last epoch, scale changes).
    """

    quantized: dict = field(default_factory=dict)
    masks: dict = field(default_factory=dict)
    sparsity_pattern: dict = field(default_factory=dict)
    layer_errors: dict = field(default_factory=dict)
    fallbacks: list = field(default_factory=list)
    seconds: float = 0.0
    recipe: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    tuning: dict = field(default_factory=dict)

    def method_fallbacks(self) -> list[str]:
        """The :attr:`fallbacks` that changed the method applied to a layer (the layer got
        RTN, magnitude or AWQ without its scaling instead of what the recipe asked), as
        opposed to notes that only report (excluded tokens, extra damping)."""
        return [n for n in self.fallbacks if _METHOD_CHANGE.search(n)]

    def fallback_summary(self, limit: int = 3) -> Optional[str]:
        """One line on :meth:`method_fallbacks`: how many layers, grouped by what happened
        (at most ``limit`` groups, each with one example layer); ``None`` when there are
        none. :func:`compress` warns with it (:class:`FallbackWarning`)."""
        changed = self.method_fallbacks()
        if not changed:
            return None
        groups: dict[str, list[str]] = {}
        for note in changed:
            names, _, what = note.partition(": ")
            groups.setdefault(what, []).extend(n.strip() for n in names.split(","))
        n_layers = len({n for v in groups.values() for n in v})
        total = len(self.quantized) + len(set(self.masks) - set(self.quantized))
        parts = [f"{len(v)} x {what} (e.g. {v[0]})"
                 for what, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:limit]]
        more = f"; {len(groups) - limit} more kinds" if len(groups) > limit else ""
        return (f"{n_layers} of {total} compressed layers fell back to another method: "
                + "; ".join(parts) + more + " (all in the summary's 'fallbacks')")

    def sparsity(self) -> dict:
        """Module name -> fraction of pruned weights."""
        return {n: 1.0 - float(m.float().mean()) for n, m in self.masks.items()}

    def summary(self) -> dict:
        """JSON-able summary: recipe, counts, mean error, bits per weight, fallbacks."""
        errs = [e for e in self.layer_errors.values() if e == e]
        bpw = None
        if self.quantized:
            tot_bits = sum(q.bits_per_weight() * q.codes.numel() for q in self.quantized.values())
            tot = sum(q.codes.numel() for q in self.quantized.values())
            bpw = tot_bits / tot
        return {
            "recipe": self.recipe,
            "seconds": round(self.seconds, 3),
            "calibration": self.calibration,
            "n_quantized": len(self.quantized),
            "n_pruned": len(self.masks),
            "quantized": {n: {"bits": q.bits, "group_size": q.group_size, "sym": q.sym,
                              "act_order_g_idx": q.g_idx is not None}
                          for n, q in self.quantized.items()},
            "sparsity": {n: round(s, 6) for n, s in self.sparsity().items()},
            "sparsity_pattern": dict(self.sparsity_pattern),
            "avg_bits_per_weight": None if bpw is None else round(bpw, 4),
            "mean_layer_error": (sum(errs) / len(errs)) if errs else None,
            "layer_errors": {n: float(e) for n, e in self.layer_errors.items()},
            "fallbacks": list(self.fallbacks),
            "method_fallbacks": self.method_fallbacks(),
            "tuning": dict(self.tuning),
        }


def _plan(recipe: Recipe, methods, prefix: str, blocks) -> list[list[tuple[int, list[str]]]]:
    """Per block: ``[(stage index, [target names])]``; checks every rule before any change.

    Raises:
        ConfigError: a shape the method cannot handle, pruning after quantization, a layer
            quantized twice (other than after a method that ``may_precede_quantizer``,
            AWQ), or no target at all.
    """
    plan = []
    any_target = False
    every = [(f"{prefix}.{bi}.{n}", m) for bi, block in enumerate(blocks)
             for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    for cfg in recipe.stages:       # a group_size hint that fits every layer a stage targets
        check_group_size(cfg, [(n, m.in_features) for n, m in every if cfg.selects(n)])
    for bi, block in enumerate(blocks):
        linears = [(f"{prefix}.{bi}.{n}", m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]
        history: dict[str, list] = {}
        per_stage = []
        for si, (cfg, meth) in enumerate(zip(recipe.stages, methods)):
            names = []
            if meth.model_scope:      # runs once after the blocks (_model_stage_targets)
                per_stage.append((si, names))
                continue
            for name, mod in linears:
                if not cfg.selects(name):
                    continue
                meth.check_layer(name, mod.out_features, mod.in_features)
                prev = history.setdefault(name, [])  # (quantized, may precede a quantizer) per stage
                if cfg.is_pruner and any(q for q, _ in prev):
                    raise ConfigError(f"{name}: stage {si + 1} ({cfg.method}) prunes a layer an earlier "
                                      "stage already quantized",
                                      "put pruning stages before quantization stages in the recipe")
                if cfg.quantizes and any(q and not precedes for q, precedes in prev):
                    raise ConfigError(f"{name}: stage {si + 1} ({cfg.method}) quantizes a layer an earlier "
                                      "stage already quantized",
                                      f"quantize each layer once{_may_precede_note()}, "
                                      "or narrow the stages' targets")
                prev.append((cfg.quantizes, cfg.may_precede_quantizer))
                names.append(name)
            per_stage.append((si, names))
            any_target |= bool(names)
        plan.append(per_stage)
    for si, (cfg, meth) in enumerate(zip(recipe.stages, methods)):
        if not meth.model_scope:
            continue
        later = [c.method for c, m in zip(recipe.stages[si + 1:], methods[si + 1:]) if not m.model_scope]
        if later:
            raise ConfigError(f"stage {si + 1} ({cfg.method}) tunes the whole model after the block-wise "
                              f"stages, but {later[0]} comes after it",
                              f"move {cfg.method} to the end of the recipe")
        if not _model_stage_targets(recipe, si, [n for n, _ in every]):
            raise ConfigError(f"stage {si + 1} ({cfg.method}) selects no layer that an earlier stage "
                              "quantizes", f"put {cfg.method} after a quantization stage (e.g. gptq) "
                              "covering the layers it targets")
    if not any_target:
        raise ConfigError("the recipe selects no linear layer of the model's decoder blocks",
                          "check the stages' targets/ignore patterns (e.g. targets = [\"q_proj\"])")
    _check_patterns_match(recipe, [n for n, _ in every])
    return plan


def _model_stage_targets(recipe: Recipe, si: int, names: list[str]) -> list[str]:
    """The layers model-scope stage ``si`` tunes: those it selects that an earlier stage
    quantizes."""
    cfg = recipe.stages[si]
    return [n for n in names if cfg.selects(n) and any(c.quantizes and c.selects(n) for c in recipe.stages[:si])]


def _may_precede_note() -> str:
    """`` (only awq may precede another quantizer)``: the registered methods whose scaling
    may run before another quantizer of the same layer."""
    names = [n for n, c in config_classes().items() if c.may_precede_quantizer]
    return f" (only {' or '.join(names)} may precede another quantizer)" if names else ""


def _check_patterns_match(recipe: Recipe, names: list[str]) -> None:
    """Every ``targets`` pattern of every stage selects a decoder-block linear, and every
    ``ignore`` pattern one of those or ``lm_head`` (a typo would otherwise silently leave a
    layer at another precision).

    Raises:
        ConfigError: naming the stage and the pattern.
    """
    for si, cfg in enumerate(recipe.stages):
        for attr, pool in (("targets", names), ("ignore", names + ["lm_head"])):
            for p in getattr(cfg, attr) or []:
                if not any(pattern_matches(p, n) for n in pool):
                    raise ConfigError(f"stage {si + 1} ({cfg.method}): {attr} pattern {p!r} matches "
                                      f"no linear layer (names look like {names[0]!r})",
                                      "correct the pattern (exact name, dotted suffix such as "
                                      "'v_proj', glob, or 're:' regex) or remove it")


def check_recipe(model: nn.Module, recipe) -> Recipe:
    """Check a recipe against a model's layers without touching any weight: the recipe's
    own settings, then every selected layer's shape (e.g. a ``group_size`` that does not
    divide a layer's input size) and the stage order. Cheap (no forward pass), so
    callers run it before building calibration data.

    Returns:
        The recipe as a :class:`~edgeprune.recipe.Recipe`.

    Raises:
        ConfigError, UnsupportedArchitectureError: as :func:`compress` would, before
            any weight changes.
    """
    return _checked_plan(model, recipe)[0]


def _checked_plan(model: nn.Module, recipe):
    """``(recipe, prefix, blocks, methods, plan)`` after every check :func:`compress` makes
    before touching a weight (shared by :func:`check_recipe` and :func:`compress`)."""
    recipe = as_recipe(recipe)
    recipe.validate()
    prefix, blocks = find_decoder_blocks(model)
    methods = [get_method(c) for c in recipe.stages]
    return recipe, prefix, blocks, methods, _plan(recipe, methods, prefix, blocks)


def _later_quantizes(recipe: Recipe, si: int, name: str) -> bool:
    return any(c.quantizes and c.selects(name) for c in recipe.stages[si + 1:])


def _baseline_results(cfg, tasks: list[LayerTask], why: str) -> dict[str, LayerResult]:
    """Data-free fallback for a group: RTN for stages that quantize (from the config's
    ``bits``, ``group_size``, ``sym``), magnitude for the others (``sparsity``,
    ``prune_n``, ``prune_m``)."""
    if cfg.quantizes:
        meth = RTN(RTNConfig(bits=cfg.bits, group_size=cfg.group_size, sym=cfg.sym))
        label = "RTN"
    else:
        meth = Magnitude(MagnitudeConfig(sparsity=cfg.sparsity, prune_n=cfg.prune_n, prune_m=cfg.prune_m))
        label = "magnitude"
    out = {}
    for t in tasks:
        r = meth.compress_layer(t)
        if r.quantized is not None:
            r.quantized.meta.update(method=cfg.method, fallback="rtn")
        r.notes = [f"{t.name}: {why} -> {label}"]
        out[t.name] = r
    return out


def _check_calibration(model: nn.Module, calib_ids, attention_mask) -> dict:
    """Check the calibration ids (and mask) against the model; returns the result's
    ``calibration`` record (``nsamples``, ``seqlen``, ``tokens``).

    Raises:
        CalibrationError: empty or malformed ids / mask, ids outside the vocabulary.
    """
    if not isinstance(calib_ids, torch.Tensor) or calib_ids.dim() != 2 or calib_ids.numel() == 0:
        raise CalibrationError(
            f"calibration ids must be a non-empty [nsamples, seqlen] tensor, got "
            f"{tuple(calib_ids.shape) if isinstance(calib_ids, torch.Tensor) else type(calib_ids).__name__}",
            "build them with edgeprune.calibration (e.g. 32 windows of 512 tokens)")
    if calib_ids.dtype not in (torch.int64, torch.int32):
        raise CalibrationError(f"calibration ids have dtype {calib_ids.dtype}", "pass integer token ids")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(calib_ids.shape):
            raise CalibrationError(f"attention_mask shape {tuple(attention_mask.shape)} differs from the "
                                   f"ids' {tuple(calib_ids.shape)}", "pass one mask entry per token")
        if not bool(attention_mask.bool().any()):
            raise CalibrationError("attention_mask masks out every calibration token",
                                   "pass 1 for real tokens and 0 for padding")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is not None and calib_ids.numel() and \
            (int(calib_ids.max()) >= vocab or int(calib_ids.min()) < 0):
        raise CalibrationError(f"calibration ids span {int(calib_ids.min())}..{int(calib_ids.max())} "
                               f"but the model's vocabulary has {vocab} tokens",
                               "tokenize the calibration text with this model's tokenizer")
    return {"nsamples": int(calib_ids.shape[0]), "seqlen": int(calib_ids.shape[1]),
            "tokens": int(attention_mask.sum()) if attention_mask is not None else int(calib_ids.numel())}


def needs_calibration(recipe) -> bool:
    """Whether a recipe needs calibration data: True when any stage's method is not
    ``data_free`` (the class attribute each method sets, read from the registry; RTN and
    magnitude are data-free). Cheap: no model, no forward pass.

    Raises:
        ConfigError: an invalid recipe or an unknown method.
    """
    recipe = as_recipe(recipe)
    return not all(get_method(c).data_free for c in recipe.stages)


def compress(model: nn.Module, recipe, calib_ids: Optional[torch.Tensor] = None, *,
             attention_mask: Optional[torch.Tensor] = None, device: str | torch.device = "cpu",
             progress: bool = True, batch_size: int = 8, measure_errors: Optional[bool] = None,
             error_tokens: int = 2048, check_finite: bool = True,
             on_block: Optional[Callable[[int, int], None]] = None,
             forward_dtype: Optional[torch.dtype] = None) -> CompressionResult:
    """Compress ``model`` in place with a recipe, block by block (sequential mode).

    Args:
        model: a transformers causal LM (llama/qwen2 style: blocks in ``model.layers``),
            in eval mode.
        recipe: a :class:`~edgeprune.recipe.Recipe`, one method config
            (e.g. ``GPTQConfig(bits=4)``), a list of configs, a dict, or a recipe file path.
        calib_ids: ``int64 [nsamples, seqlen]`` calibration token windows; may be
            ``None`` when every stage's method is ``data_free`` (:func:`needs_calibration`)
            and no error is measured: then no window is needed and no forward pass runs.
        attention_mask: optional ``[nsamples, seqlen]`` (1 = token, 0 = padding). Padded
            positions never enter a statistic; position ids follow the mask, so left- or
            right-padded batches give the same statistics as the unpadded samples.
        device: where blocks are processed (``"cpu"``, ``"cuda"``); each block moves there
            in turn and returns to its original device.
        progress: show a tqdm bar per block ("block 3/30: gptq q_proj,k_proj,...").
        batch_size: calibration samples per forward pass.
        measure_errors: fill ``layer_errors`` (needs ``calib_ids``); ``None``: when
            ``calib_ids`` are given.
        error_tokens: the errors are measured on the first ``error_tokens`` valid
            calibration tokens seen by each layer (the same tokens for every method, so
            errors of different methods compare; methods that need a Hessian still use
            all tokens for compression).
        check_finite: fail the run when the compressed model's activations or logits
            stop being finite on a calibration window that was finite before
            (:mod:`edgeprune.finite`; costs one more block forward). A data-free recipe
            run without ``measure_errors`` makes no forward pass, so it is not checked.
        on_block: called with ``(blocks done, blocks)`` after each block (a caller's own
            progress display, e.g. the study's grid bar).
        forward_dtype: dtype of the calibration forward passes, or its name
            (``torch.bfloat16`` / ``"bfloat16"`` or float16 on a float32 model: a shadow copy of each block in that dtype
            computes the activations the statistics are taken from; the weights and the
            methods stay in the model's dtype). None: the model's dtype.

    Returns:
        :class:`CompressionResult`.

    Raises:
        ConfigError: invalid recipe or a layer shape the recipe cannot handle (raised
            before any weight changes); a ``device`` not available here; a
            ``forward_dtype`` that is not a floating dtype.
        CalibrationError: empty or malformed calibration ids / mask, ids outside the
            model's vocabulary; no ids for a recipe that needs data or for
            ``measure_errors=True``.
        CompressionError: (``check_finite``) the compressed model's activations or logits
            stop being finite, naming the layer where they stop (the model is left
            compressed in place; nothing is saved by the caller).
        UnsupportedArchitectureError: decoder blocks not found.

    Numerical trouble in one layer (singular Hessian, NaN/zero activations, a method
    failing) never stops the run: the layer falls back to RTN / magnitude and the
    fallback is listed in ``result.fallbacks``; weights are never left non-finite.
    """
    t0 = time.perf_counter()
    recipe, prefix, blocks, methods, plan = _checked_plan(model, recipe)
    if measure_errors is None:
        measure_errors = calib_ids is not None
    # data-free recipes (magnitude / RTN) without error measurement need no forward pass
    need_data = measure_errors or not all(m.data_free for m in methods)
    if calib_ids is None and need_data:
        needy = sorted({c.method for c, m in zip(recipe.stages, methods) if not m.data_free})
        raise CalibrationError(
            f"no calibration ids: {' and '.join(needy)} needs calibration data" if needy else
            "no calibration ids: measure_errors=True measures the errors on calibration data",
            "build them with edgeprune.calibration (e.g. 32 windows of 512 tokens)"
            + ("" if needy else ", or pass measure_errors=False"))
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be >= 1", "use e.g. 8")
    calibration = {} if calib_ids is None else _check_calibration(model, calib_ids, attention_mask)
    device = check_device(device)
    model_dtype = next(model.parameters()).dtype
    fdt = _check_forward_dtype(forward_dtype, model_dtype)
    stream_amp = _stream_autocast(methods)

    result = CompressionResult(recipe=recipe.to_dict(), calibration=calibration)
    # model-scope stages (E2E-QP) distil from the model as it is before the recipe
    teacher = copy.deepcopy(model).eval() if any(m.model_scope for m in methods) else None
    was_training = model.training
    model.eval()
    # Non-block modules (embeddings, rotary, final norm) go to `device` for the capture.
    base_dev = next(model.parameters()).device
    moved = []
    if device != base_dev:
        in_blocks = {id(m) for b in blocks for m in b.modules()}
        moved = [m for m in model.modules() if id(m) not in in_blocks]
        for mod in moved:
            move_own_tensors(mod, device)
    bar = None
    try:
        batches = []
        if need_data:
            with torch.no_grad():
                batches = capture_block_inputs(model, blocks, calib_ids, attention_mask, batch_size, device)
            if fdt is not None:
                batches = cast_batches(batches, fdt)
        watch = FiniteWatch(batches, fdt or model_dtype) if check_finite and need_data else None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(blocks), desc="compress", unit="block", leave=True)
        seq_groups: dict[tuple, list] = {}
        for bi, block in enumerate(blocks):
            blk_dev = next(block.parameters()).device
            block.to(device)
            modules = {f"{prefix}.{bi}.{n}": m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
            shadow = _Shadow(block, fdt) if fdt is not None and need_data else None
            fwd = shadow.block if shadow is not None else block
            fwd_modules = {f"{prefix}.{bi}.{n}": m for n, m in fwd.named_modules() if isinstance(m, nn.Linear)}
            ref = {}
            final_stats: dict[str, InputStats] = {}
            for si, names in plan[bi]:
                if not names:
                    continue
                cfg, meth = recipe.stages[si], methods[si]
                if bar is not None:
                    short = ",".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))
                    bar.set_description(f"block {bi + 1}/{len(blocks)}: {cfg.method} {short}")
                if getattr(cfg, "true_sequential", False) and need_data and len(names) > 1:
                    key = tuple(n[len(f"{prefix}.{bi}."):] for n in names)  # names relative to the block
                    if key not in seq_groups:
                        seq_groups[key] = sequential_groups(fwd, {n: fwd_modules[n] for n in names},
                                                             batches[0], key)
                    groups = [[f"{prefix}.{bi}.{sfx}" for sfx in g] for g in seq_groups[key]]
                else:
                    groups = [names]
                for group in groups:
                    final_stats.update(_compress_group(block, modules, group, cfg, meth, recipe, si, batches,
                                                       result, ref, measure_errors, error_tokens, device,
                                                       in_call_order=len(groups) > 1, fwd=fwd,
                                                       fwd_modules=fwd_modules, model_dtype=model_dtype))
                    if shadow is not None:
                        shadow.sync()
            if measure_errors:
                for n, st in final_stats.items():
                    He = st.error_hessian
                    if He is not None:
                        result.layer_errors[n] = relative_error(ref[n], modules[n].weight.detach().float(), He)
            amp = torch.autocast(device.type, dtype=stream_amp, enabled=stream_amp is not None)
            if watch is not None:                  # outputs feed the next block, and are checked
                with torch.no_grad(), amp:
                    watch.run(fwd, f"{prefix}.{bi}", batches)
            elif need_data and bi < len(blocks) - 1:  # the last block's outputs feed nothing
                with torch.no_grad(), amp:
                    run_block(fwd, batches)
            del shadow, fwd, fwd_modules
            block.to(blk_dev)
            if bar is not None:
                bar.update(1)
            if on_block is not None:
                on_block(bi + 1, len(blocks))
        if watch is not None:
            watch.check_logits(model, prefix, batches)
        del batches, watch
        if bar is not None:
            bar.close()
            bar = None
        if teacher is not None:
            _run_model_stages(model, teacher, recipe, methods, prefix, blocks, result, calib_ids,
                              attention_mask, device, progress)
    finally:
        if bar is not None:           # also on an error: its line ends before the error's
            bar.close()
        for mod in moved:
            move_own_tensors(mod, base_dev)
        model.train(was_training)
    result.seconds = time.perf_counter() - t0
    line = result.fallback_summary()
    if line:
        warnings.warn(line, FallbackWarning, stacklevel=2)
    return result


def _run_model_stages(model, teacher, recipe, methods, prefix, blocks, result, calib_ids, attention_mask,
                      device, progress) -> None:
    """Run the model-scope stages in order on the whole model (on ``device``); their
    reports go to ``result.tuning`` and their fallbacks to ``result.fallbacks``."""
    names = [f"{prefix}.{bi}.{n}" for bi, b in enumerate(blocks) for n, m in b.named_modules()
             if isinstance(m, nn.Linear)]
    mods = dict(model.named_modules())
    base_dev = next(model.parameters()).device
    model.to(device)
    teacher.to(device)
    try:
        for si, (cfg, meth) in enumerate(zip(recipe.stages, methods)):
            if not meth.model_scope:
                continue
            targets = {n: (mods[n], result.quantized[n], result.masks.get(n))
                       for n in _model_stage_targets(recipe, si, names) if n in result.quantized}
            info = meth.tune_model(model, teacher, targets, calib_ids, attention_mask, progress=progress)
            result.fallbacks.extend(info.pop("notes", []))
            result.tuning[f"{si + 1}:{cfg.method}"] = info
    finally:
        model.to(base_dev)


def _first_tokens(batches, n: int) -> list:
    """The shortest prefix of ``batches`` holding ``n`` real tokens (all of them if fewer)."""
    seen = 0
    for i, b in enumerate(batches):
        seen += int(b[2].sum())
        if seen >= n:
            return batches[:i + 1]
    return batches


def _compress_group(block, modules, names, cfg, meth, recipe, si, batches, result, ref,
                    measure_errors, error_tokens, device, *, in_call_order: bool, fwd, fwd_modules,
                    model_dtype) -> dict:
    """Gather statistics for ``names`` in one pass of ``fwd`` (``block`` itself, or its
    shadow in the forward dtype, whose linears are ``fwd_modules``), compress them, write
    back into ``block``.

    ``in_call_order``: ``names`` are in the block's call order (true-sequential groups),
    so the statistics pass can stop after the last one from the first batch on.
    Returns ``{name: InputStats}`` of the statistics each layer's error is measured on.
    """
    final_stats = {}
    if (meth.data_free or not meth.needs_stats) and not measure_errors:   # no statistics pass
        stats = {n: InputStats.empty(modules[n].in_features, False, device) for n in names}
    else:                # a method that reads no statistics: only the error tokens' batches
        feed = batches if meth.needs_stats else _first_tokens(batches, error_tokens)
        stats = StatsCollector({n: fwd_modules[n] for n in names}, meth.needs_hessian, device,
                                error_tokens if measure_errors else 0).run(
            fwd, feed, stop_at=names[-1] if in_call_order else None)
    tasks = []
    for n in names:
        w = modules[n].weight.detach().float().clone()
        ref.setdefault(n, w)
        tasks.append(LayerTask(name=n, module=modules[n], weight=w, mask=result.masks.get(n),
                               stats=stats[n], quantize=not _later_quantizes(recipe, si, n)))
    excluded = {id(t.stats): t for t in tasks if t.stats.n_excluded}
    for t in excluded.values():
        result.fallbacks.append(f"{t.name}: {t.stats.n_excluded} calibration tokens with NaN/inf "
                                "activations excluded from the statistics")
    try:
        with torch.no_grad():
            inputs = {}
            if meth.needs_block_inputs:         # the method runs ``block`` itself: its dtype
                inputs = {"inputs": batches if fwd is block else cast_batches(batches, model_dtype)}
            res = meth.compress_block(block, tasks, **inputs)
    except EdgePruneError:
        raise
    except Exception as e:  # numerical failure inside a method: fall back, keep going
        res = _baseline_results(cfg, tasks, f"{cfg.method} failed ({type(e).__name__}: {e})")
    for t in tasks:
        r = res[t.name]
        if not bool(torch.isfinite(r.weight).all()):
            r = _baseline_results(cfg, [t], f"{cfg.method} produced non-finite weights")[t.name]
        _write_back(t, r, result)
        if r.reference is not None:
            ref[t.name] = r.reference.float()
        final_stats[t.name] = r.stats if r.stats is not None else t.stats
    return final_stats

def _stream_autocast(methods) -> Optional[torch.dtype]:
    """The autocast dtype of the calibration stream between blocks: the data-driven
    stages' :attr:`~edgeprune.methods.base.Method.stream_autocast` when they all name the
    same one, else None (the stream in the model's or ``forward_dtype``'s precision)."""
    wanted = {m.stream_autocast for m in methods if not m.data_free and not m.model_scope}
    return wanted.pop() if len(wanted) == 1 else None


def _check_forward_dtype(forward_dtype, model_dtype) -> Optional[torch.dtype]:
    """The shadow dtype (None when the forward passes run in ``model_dtype``).

    Raises:
        ConfigError: not a floating torch dtype.
    """
    if forward_dtype is None:
        return None
    if isinstance(forward_dtype, str):
        forward_dtype = getattr(torch, forward_dtype, None)
    if not isinstance(forward_dtype, torch.dtype) or not forward_dtype.is_floating_point:
        raise ConfigError(f"forward_dtype={forward_dtype!r} is not a floating dtype",
                          "pass torch.bfloat16 (or None for the model's own dtype)")
    return None if forward_dtype == model_dtype else forward_dtype


class _Shadow:
    """A copy of ``block`` in ``dtype`` for the calibration forward passes; :meth:`sync`
    copies the block's (compressed) parameters and buffers into it."""

    def __init__(self, block: nn.Module, dtype: torch.dtype):
        import copy

        self.src = block
        self.block = copy.deepcopy(block).to(dtype)

    @torch.no_grad()
    def sync(self) -> None:
        for a, b in zip(self.block.parameters(), self.src.parameters()):
            a.copy_(b)
        for a, b in zip(self.block.buffers(), self.src.buffers()):
            a.copy_(b)


def _write_back(task: LayerTask, r: LayerResult, result: CompressionResult) -> None:
    """Copy a method's result into the module and the :class:`CompressionResult`."""
    mod = task.module
    w = r.weight
    mask = r.mask
    if task.mask is not None:
        mask = task.mask if mask is None else (mask & task.mask)
    if mask is not None:
        w = w * mask
        result.masks[task.name] = mask.cpu()
        pat = r.pattern or result.sparsity_pattern.get(task.name, "unstructured")
        result.sparsity_pattern[task.name] = pat
    mod.weight.data.copy_(w.to(device=mod.weight.device, dtype=mod.weight.dtype))
    if r.quantized is not None:
        q = r.quantized
        q.codes, q.scales, q.zeros = q.codes.cpu(), q.scales.cpu(), q.zeros.cpu()
        if q.g_idx is not None:
            q.g_idx = q.g_idx.cpu()
        result.quantized[task.name] = q
    result.fallbacks.extend(r.notes)


__all__ = ["compress", "check_recipe", "needs_calibration", "CompressionResult", "FallbackWarning",
           "find_decoder_blocks"]
