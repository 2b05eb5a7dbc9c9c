"""Block capture and replay on models whose layers differ (Gemma 3: local sliding-window
layers and global layers get different attention masks and rotary tables)."""

from __future__ import annotations

import pytest
import torch

from edgeprune.blocks import BlockBatch, capture_block_inputs, find_decoder_blocks, run_block

from tiny import tiny_gemma3

CPU = torch.device("cpu")


def _hidden_states(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("padded", [False, True])
def test_every_block_sees_the_models_own_inputs(padded):
    """Each block's captured input and replayed output equal the model's own hidden states
    (16 tokens, 4x the window; with left padding too): block 1 (global) used to be fed
    block 0's (local) mask and rotary tables, which put its output (block 2's input)
    off by 4.4 here."""
    model = tiny_gemma3()
    ids = torch.randint(0, 255, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
    ref = _hidden_states(model, ids, mask)
    _, blocks = find_decoder_blocks(model)
    with torch.no_grad():
        batches = capture_block_inputs(model, blocks, ids, mask, 2, CPU)
        assert [type(b) for b in batches] == [BlockBatch, BlockBatch]
        h0, kw0, tok0 = batches[0]                                  # unpacks as a 3-list
        assert kw0 is batches[0].layer_kwargs[0]
        local, glob = batches[0].layer_kwargs[0], batches[0].layer_kwargs[1]
        assert local["position_embeddings"][0] is batches[0].layer_kwargs[2]["position_embeddings"][0]
        assert not torch.equal(local["position_embeddings"][0], glob["position_embeddings"][0])
        keep = (mask if mask is not None else torch.ones_like(ids)).bool().unsqueeze(-1)
        for i, blk in enumerate(blocks):
            got = torch.cat([b[0] for b in batches])
            assert all(b.block == i and b[1] is b.layer_kwargs[i] for b in batches)
            torch.testing.assert_close(got * keep, ref[i] * keep, atol=1e-5, rtol=1e-5)
            run_block(blk, batches)
        h = torch.cat([b[0] for b in batches])
        logits = model.lm_head(model.model.norm(h))
        torch.testing.assert_close(logits * keep, model(ids, attention_mask=mask).logits * keep,
                                   atol=1e-4, rtol=1e-4)


def test_llama_capture_skips_the_blocks(tiny_llama):
    """The capture runs no block (their forward returns its input) and leaves the blocks'
    own forward in place afterwards; every llama block gets the same kwargs objects."""
    _, blocks = find_decoder_blocks(tiny_llama)
    calls = []
    hooks = [b.mlp.register_forward_pre_hook(lambda m, a: calls.append(1)) for b in blocks]
    ids = torch.randint(0, 255, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        batches = capture_block_inputs(tiny_llama, blocks, ids, None, 2, CPU)
    assert calls == [] and all("forward" not in vars(b) for b in blocks)
    lk = batches[0].layer_kwargs
    assert lk[0]["position_embeddings"] is lk[1]["position_embeddings"]
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_awq_mappings_name_what_each_family_computes(family, tiny_llama, tiny_qwen2):
    """Every AWQ smoothing site of a block exists; a norm's balance linears read exactly
    its output (checked on a forward pass); Gemma's (1 + w) norms are marked not
    foldable, and llama's row (post_attention_layernorm -> gate/up) would be wrong for it."""
    from edgeprune.methods.awq_mappings import GEMMA3, LLAMA, block_model_type, mappings_for
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2, "gemma3": tiny_gemma3()}[family]
    block = model.model.layers[0]
    rows = mappings_for(block)
    assert rows is (GEMMA3 if family == "gemma3" else LLAMA)
    assert block_model_type(block) == {"gemma3": "gemma3_text"}.get(family, family)
    outputs, inputs = {}, {}
    hooks = [block.get_submodule(r.smooth).register_forward_hook(
        lambda m, a, out, n=r.smooth: outputs.setdefault(n, out)) for r in rows]
    hooks += [block.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: inputs.setdefault(n, a[0])) for r in rows for n in r.balance]
    if family == "gemma3":
        hooks.append(block.post_attention_layernorm.register_forward_hook(
            lambda m, a, out: outputs.setdefault("post_attention_layernorm", out)))
    ids = torch.randint(0, 255, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    for r in rows:
        if r.smooth.endswith("layernorm"):
            assert all(torch.equal(inputs[n], outputs[r.smooth]) for n in r.balance), r
        assert (r.no_fold is not None) == (family == "gemma3" and r.smooth.endswith("layernorm"))
    if family == "gemma3":
        assert not torch.equal(inputs["mlp.gate_proj"], outputs["post_attention_layernorm"])
        assert all(not r.smooth.endswith(("q_proj", "k_proj")) for r in rows)   # QK-norm follows them
