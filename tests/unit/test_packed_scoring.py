"""Packed task scoring (:class:`edgeprune.evaluation.backends.TorchBackend`): several
(context, continuations) groups in one row, a prefix-tree mask per group, equal to scoring
each continuation after its context in a forward pass of its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgeprune.evaluation.backends import TorchBackend

from tiny import tiny_gemma3, tiny_model


def _family(name):
    from transformers import LlamaConfig, Qwen2Config

    if name == "gemma3":
        return tiny_gemma3()
    return tiny_model(LlamaConfig if name == "llama" else Qwen2Config)


def _groups():
    """Contexts of 1 to 13 tokens (beyond the Gemma window of 4), continuations of 1 to 7."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, 250, (n,), generator=g).tolist()

    return [(ids(n), [ids(k) for k in ks]) for n, ks in
            [(5, [3, 1, 4]), (1, [2, 2]), (13, [7]), (2, [1]), (9, [5, 6, 1, 2]), (3, [2, 7])]]


@torch.no_grad()
def _reference(model, ctx, conts):
    """Each continuation scored in its own forward pass over context + continuation."""
    out = []
    for c in conts:
        lp = F.log_softmax(model(torch.tensor([ctx + c])).logits[0].float(), -1)
        pred = lp[len(ctx) - 1: len(ctx) + len(c) - 1]
        tgt = torch.tensor(c)
        out.append((float(pred.gather(1, tgt[:, None]).sum()), bool((pred.argmax(-1) == tgt).all())))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("pack_tokens", [16, 256])
def test_packed_rows_score_like_separate_passes(family, pack_tokens):
    """16 tokens: five rows (groups of 10, 3, 19, 2, 19, 10 tokens; the 19s alone);
    256: all in one row.
    Gemma's local layers see only their window inside a packed row too."""
    model = _family(family)
    be = TorchBackend(model, pack_tokens=pack_tokens)
    assert be.pack_tokens == pack_tokens
    groups = _groups()
    got = be.score_many(groups)
    rows = be.plan([be.group_tokens(c, k) for c, k in groups])
    assert rows == ([list(range(6))] if pack_tokens == 256 else [[0, 1], [2], [3], [4], [5]])
    for (ctx, conts), scores in zip(groups, got):
        for (a, ga), (b, gb) in zip(scores, _reference(model, ctx, conts)):
            assert a == pytest.approx(b, abs=1e-4) and ga == gb
    cached = TorchBackend(model, pack_tokens=0).score_many(groups)
    assert [[g for _, g in s] for s in cached] == [[g for _, g in s] for s in got]


def test_plan_fills_rows_in_order():
    be = TorchBackend(_family("llama"), pack_tokens=16)
    assert be.plan([5, 10, 30, 3, 3, 16, 1]) == [[0, 1], [2], [3, 4], [5], [6]]
    assert TorchBackend(_family("llama"), pack_tokens=0).plan([5, 10]) == [[0], [1]]
    assert be.group_tokens([1, 2, 3], [[4], [5, 6, 7]]) == 3 + 0 + 2


def test_packing_is_off_where_rows_must_stay_apart():
    """A hook on the whole model may act per batch row (IG-Pruning's router), and an
    attention other than sdpa/eager may ignore a custom mask: one group per pass then."""
    model = _family("llama")
    h = model.register_forward_pre_hook(lambda m, a: None)
    try:
        assert TorchBackend(model).pack_tokens == 0
    finally:
        h.remove()
    assert TorchBackend(model).pack_tokens > 0
    model.config._attn_implementation = "flex_attention"
    assert TorchBackend(model).pack_tokens == 0
