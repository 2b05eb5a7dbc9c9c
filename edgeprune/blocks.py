"""A causal LM's decoder blocks and the calibration activations that flow through them.

What :func:`edgeprune.engine.compress` runs the methods on: the blocks
(:func:`find_decoder_blocks`); the inputs of block 0 and the keyword arguments the model
passes each decoder layer (``position_embeddings``, ``attention_mask``,
``position_ids``...; per layer, since Gemma 3's local and global layers get different
ones), captured with hooks while the blocks are skipped (:func:`capture_block_inputs`);
one block's outputs as the next one's inputs, with that block's own kwargs
(:func:`run_block`, :class:`BlockBatch`); per-linear input statistics gathered with forward hooks
(:class:`StatsCollector`; linears that read the same tensor, q/k/v and gate/up, share
one); and the true-sequential order of a block's linears (:func:`sequential_groups`).

Padded positions (``attention_mask == 0``) and tokens whose activations are NaN/inf never
enter a statistic.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .errors import UnsupportedArchitectureError
from .methods.base import InputStats


def find_decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder blocks of a causal LM: ``("model.layers", ModuleList)`` for llama/qwen2.

    Raises:
        UnsupportedArchitectureError: no ``ModuleList`` of blocks found.
    """
    for prefix in ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers"):
        try:
            mod = model.get_submodule(prefix)
        except AttributeError:
            continue
        if isinstance(mod, nn.ModuleList) and len(mod):
            return prefix, mod
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and any(isinstance(m, nn.Linear) for m in mod[0].modules()):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise UnsupportedArchitectureError(
            f"cannot find the decoder blocks of {type(model).__name__}",
            "use a llama/qwen2-style causal LM whose blocks live in model.layers")
    return best


class _StopForward(Exception):
    pass


class BlockBatch(list):
    """One calibration batch as the blocks see it: ``[hidden, kwargs, tokmask]`` (a list,
    so ``hidden, kwargs, tokmask = batch`` and ``block(batch[0], **batch[1])`` work) for
    the block that ``hidden`` feeds.

    Models whose layers differ get each block's own keyword arguments: Gemma 3 passes its
    local (sliding-window) layers another attention mask and other rotary tables than its
    global layers. :attr:`layer_kwargs` holds what the model passes every block (the same
    objects for layers of one type, so nothing is copied); :meth:`advance` moves the batch
    on to the next block's inputs.

    Attributes:
        layer_kwargs: ``[num_blocks]`` keyword-argument dicts.
        block: index of the block ``self[0]`` feeds.
    """

    def __init__(self, hidden, layer_kwargs: list, tokmask):
        super().__init__([hidden, layer_kwargs[0], tokmask])
        self.layer_kwargs = layer_kwargs
        self.block = 0

    def advance(self, out) -> None:
        """``out`` (block ``block``'s output) becomes the next block's input, with its kwargs."""
        self[0] = out
        self.block += 1
        if self.block < len(self.layer_kwargs):
            self[1] = self.layer_kwargs[self.block]


def _own_kwargs(args, kwargs) -> tuple:
    """``(hidden, kwargs)`` of a block call, without the cache (blocks run without one)."""
    kwargs = dict(kwargs)
    hidden = args[0] if args else kwargs.pop("hidden_states")
    for k in ("past_key_values", "cache", "past_key_value"):
        kwargs.pop(k, None)
    kwargs["use_cache"] = False
    return hidden, kwargs


def capture_block_inputs(model, blocks, calib_ids, attention_mask, batch_size, device):
    """Run the model's forward to its decoder blocks on each batch of ``batch_size``
    calibration windows and capture what it passes them.

    Each block's keyword arguments are captured (attention mask, rotary
    ``position_embeddings``, ``position_ids``...: Gemma 3's local and global layers get
    different ones); the blocks themselves are skipped during the capture (their
    ``forward`` returns its input), and the forward stops at the last block, so the
    capture costs the embedding and the model's mask / rotary set-up only.

    Args:
        calib_ids: ``int64 [nsamples, seqlen]``; attention_mask: ``[nsamples, seqlen]`` or ``None``.

    Returns:
        one :class:`BlockBatch` ``[hidden [b, seqlen, hidden_size], kwargs, tokmask bool
        [b, seqlen]]`` per batch, for block 0 (padded positions of ``hidden`` zeroed);
        :func:`run_block` replaces the hidden states in place and moves each batch on to
        the next block's kwargs.

    Raises:
        UnsupportedArchitectureError: the forward never reached the blocks.
    """
    calls: list = []
    last = len(blocks) - 1

    def pre_hook(i):
        def hook(mod, args, kwargs):
            calls.append(_own_kwargs(args, kwargs))
            if i == last:
                raise _StopForward
        return hook

    def skip(*args, **kwargs):         # a block's forward during the capture: its input
        return args[0] if args else kwargs["hidden_states"]

    hooks = [b.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, b in enumerate(blocks)]
    for b in blocks[:-1]:
        b.forward = skip
    batches = []
    try:
        for b0 in range(0, calib_ids.shape[0], batch_size):
            ids = calib_ids[b0:b0 + batch_size].to(device)
            kw = {"use_cache": False}
            if attention_mask is not None:
                am = attention_mask[b0:b0 + batch_size].to(device)
                kw["attention_mask"] = am
                kw["position_ids"] = (am.long().cumsum(-1) - 1).clamp(min=0)
                tokmask = am.bool()
            else:
                tokmask = torch.ones_like(ids, dtype=torch.bool)
            calls.clear()
            try:
                model(input_ids=ids, **kw)
            except _StopForward:
                pass
            if len(calls) != len(blocks):
                raise UnsupportedArchitectureError(
                    "the model's forward never reached its decoder blocks",
                    "use a llama/qwen2/gemma3-style causal LM")
            hidden = calls[0][0]
            if not bool(tokmask.all()):
                hidden = hidden.masked_fill(~tokmask.unsqueeze(-1), 0.0)
            batches.append(BlockBatch(hidden, [kwargs for _, kwargs in calls], tokmask))
    finally:
        for h in hooks:
            h.remove()
        for b in blocks[:-1]:
            del b.forward
    return batches


def cast_batches(batches, dtype: torch.dtype) -> list:
    """New :class:`BlockBatch` objects with every floating tensor (hidden states, rotary
    tables, float masks) in ``dtype``; tensors shared between blocks' kwargs stay shared,
    token masks and integer tensors are reused as they are."""
    memo: dict[int, object] = {}

    def cast(v):
        if isinstance(v, torch.Tensor):
            if not v.is_floating_point() or v.dtype == dtype:
                return v
            if id(v) not in memo:
                memo[id(v)] = v.to(dtype)
            return memo[id(v)]
        if isinstance(v, tuple):
            return tuple(cast(x) for x in v)
        return v

    out = []
    for b in batches:
        kws = getattr(b, "layer_kwargs", None) or [b[1]]
        seen: dict[int, dict] = {}
        new_kws = [seen.setdefault(id(kw), {k: cast(v) for k, v in kw.items()}) for kw in kws]
        nb = BlockBatch(cast(b[0]), new_kws, b[2])
        nb.block = getattr(b, "block", 0)
        if nb.block < len(new_kws):
            nb[1] = new_kws[nb.block]
        out.append(nb)
    return out


def run_block(block, batches):
    """Replace each batch's hidden states by the block's output (a :class:`BlockBatch`
    also moves on to the next block's kwargs).

    Padded positions are reset to zero so that nothing non-finite computed there (a
    fully masked attention row) can leak into real tokens through ``0 * NaN``.
    """
    for b in batches:
        out = block(b[0], **b[1])
        out = out[0] if isinstance(out, (tuple, list)) else out
        if not bool(b[2].all()):
            out = out.masked_fill(~b[2].unsqueeze(-1), 0.0)
        if isinstance(b, BlockBatch):
            b.advance(out)
        else:
            b[0] = out


class StatsCollector:
    """Forward hooks accumulating :class:`InputStats` for a set of linears.

    Linears called back to back on the very same input tensor (q/k/v; gate/up) are
    detected on the first batch and share one statistics object.
    """

    def __init__(self, modules: dict[str, nn.Linear], hessian: bool, device, error_tokens: int = 0):
        self.modules = modules
        self.hessian = hessian
        self.device = device
        self.error_tokens = error_tokens
        self.stats: dict[str, InputStats] = {}
        self.leader: dict[str, str] = {}
        self.tokmask: Optional[torch.Tensor] = None
        self._prev = None  # (tensor, leader name) of the last hooked call
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name):
        def hook(mod, inp):
            x = inp[0]
            if name not in self.leader:
                if self._prev is not None and self._prev[0] is x:
                    self.leader[name] = self._prev[1]
                else:
                    self.leader[name] = name
                    self.stats[name] = InputStats.empty(x.shape[-1], self.hessian, self.device,
                                                        self.error_tokens)
            lead = self.leader[name]
            self._prev = (x, lead)
            if lead != name:
                return
            x2 = x.detach().reshape(-1, x.shape[-1])
            valid = self.tokmask.reshape(-1)
            st = self.stats[lead]
            all_valid = bool(valid.all())
            if all_valid and bool(torch.isfinite(x2.sum())):  # fast path: one reduction
                st.add(x2)
                return
            # per element: a row sum overflows in fp16 (finite "massive activations" > 65504)
            finite = torch.isfinite(x2).all(1)
            st.n_excluded += int((valid & ~finite).sum())
            st.add(x2[valid & finite])
        return hook

    def run(self, block, batches, stop_at: Optional[str] = None):
        """One forward pass of ``block`` over all batches; returns ``{name: InputStats}``.

        The pass stops right after the last target linear has seen its input (the
        block's remaining ops and outputs are not needed here): from the first batch on
        when ``stop_at`` names that linear, else from the second batch on (the first one
        finds the call order).
        """
        order: list[str] = []
        rec, stop = [], None
        if stop_at is not None:
            stop = self.modules[stop_at].register_forward_pre_hook(_raise_stop)
        else:
            rec = [m.register_forward_pre_hook(lambda mod, inp, n=n: order.append(n))
                   for n, m in self.modules.items()]
        with torch.no_grad():
            for bi, b in enumerate(batches):
                self.tokmask = b[2]
                self._prev = None
                try:
                    block(b[0], **b[1])
                except _StopForward:
                    pass
                if bi == 0 and stop is None:
                    for h in rec:
                        h.remove()
                    if order:
                        last = self.modules[order[-1]]
                        stop = last.register_forward_pre_hook(_raise_stop)
        self._prev = None
        for h in self.handles + ([stop] if stop is not None else []):
            h.remove()
        return {n: self.stats[self.leader[n]] for n in self.modules if n in self.leader}


def _raise_stop(mod, inp):
    raise _StopForward


def sequential_groups(block, modules: dict[str, nn.Linear], batch, suffixes: tuple) -> list[list[str]]:
    """Split a block's target linears into "true-sequential" groups, in forward order.

    Linears called back to back on the very same input tensor form one group (q/k/v;
    gate/up); the groups come in the order the block calls them, e.g. ``[[q, k, v], [o],
    [gate, up], [down]]`` for llama/qwen2. This is the ``true_sequential`` order of the
    GPTQ reference code (Frantar et al. 2023, ``llama.py``): each group is calibrated on
    the inputs produced by the already-compressed groups before it, so that e.g.
    ``o_proj``'s Hessian comes from the quantized attention output.

    Args:
        block: one decoder block.
        modules: full name -> linear, in ``block.named_modules()`` order.
        batch: one calibration batch ``[hidden, kwargs, tokmask]`` (one forward is run).
        suffixes: the names relative to the block, parallel to ``modules``.

    Returns:
        groups of suffixes. Linears never called by the forward go last, in one group.
    """
    calls: list[tuple[str, object]] = []
    by_mod = dict(zip(modules, suffixes))
    hooks = [m.register_forward_pre_hook(lambda mod, inp, n=n: calls.append((by_mod[n], inp[0])))
             for n, m in modules.items()]
    try:
        with torch.no_grad():
            block(batch[0], **batch[1])
    finally:
        for h in hooks:
            h.remove()
    groups: list[list[str]] = []
    seen: set = set()
    prev = None
    for sfx, x in calls:
        if sfx in seen:
            continue
        seen.add(sfx)
        if prev is not None and prev is x:
            groups[-1].append(sfx)
        else:
            groups.append([sfx])
        prev = x
    rest = [s for s in suffixes if s not in seen]
    if rest:
        groups.append(rest)
    return groups


def move_own_tensors(mod: nn.Module, device) -> None:
    """Move the parameters and buffers ``mod`` holds itself (not its children's) to ``device``."""
    for p in mod.parameters(recurse=False):
        p.data = p.data.to(device)
    for name, b in list(mod.named_buffers(recurse=False)):
        setattr(mod, name, b.to(device))


__all__ = ["find_decoder_blocks", "capture_block_inputs", "run_block", "BlockBatch", "StatsCollector",
           "sequential_groups", "move_own_tensors"]
