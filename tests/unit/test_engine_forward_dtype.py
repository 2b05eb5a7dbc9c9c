"""``compress(..., forward_dtype=torch.bfloat16)``: the calibration forward passes run on a
bfloat16 shadow of each block; weights, Hessians and methods stay float32."""

from __future__ import annotations

import copy

import pytest
import torch

from edgeprune.blocks import BlockBatch, capture_block_inputs, cast_batches, find_decoder_blocks
from edgeprune.engine import compress
from edgeprune.errors import ConfigError
from edgeprune.recipe import Recipe, method_config_from_name

from tiny import tiny_gemma3


def _ids():
    return torch.randint(0, 250, (16, 64), generator=torch.Generator().manual_seed(0))


def _run(model, method, forward_dtype, **kw):
    m = copy.deepcopy(model)
    res = compress(m, Recipe(stages=[method_config_from_name(method, **kw)], name=method), _ids(),
                   progress=False, forward_dtype=forward_dtype)
    return m, res


def _output_error(model, base):
    ids = _ids()[:4]
    with torch.no_grad():
        return float((model(ids).logits - base(ids).logits).pow(2).mean())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("method,kw", [("gptq", dict(bits=4, group_size=32)), ("awq", dict(bits=4, group_size=32)),
                                       ("sparsegpt", dict(sparsity=0.5)),
                                       ("signround", dict(bits=4, group_size=32, iters=2))])
def test_bfloat16_forwards_compress_as_well_as_float32(request, family, method, kw):
    """Same model, same windows: the bfloat16-forward run leaves float32 weights whose
    output error is within 5 % of the float32-forward run's (measured here: within
    0.1-2.3 %), and its layer errors within 5 % too. SignRound runs the block itself: it
    gets float32 inputs."""
    base = request.getfixturevalue("tiny_llama") if family == "llama" else tiny_gemma3()
    a, ra = _run(base, method, None, **kw)
    b, rb = _run(base, method, torch.bfloat16, **kw)
    assert all(p.dtype == torch.float32 for p in b.parameters())
    if method != "signround":       # its rounding may not move at all on this tiny model
        assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))   # not the same run
    ea, eb = _output_error(a, base), _output_error(b, base)
    assert eb == pytest.approx(ea, rel=0.05)
    la, lb = sum(ra.layer_errors.values()), sum(rb.layer_errors.values())
    assert lb == pytest.approx(la, rel=0.05)


def test_the_models_own_dtype_is_the_plain_run(tiny_llama):
    """forward_dtype equal to the model's: exactly the run without it."""
    a, _ = _run(tiny_llama, "gptq", None, bits=4, group_size=32)
    b, _ = _run(tiny_llama, "gptq", torch.float32, bits=4, group_size=32)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("bad", [torch.int8, "int8", "nonsense", 3])
def test_a_forward_dtype_that_is_not_floating_is_refused(tiny_llama, bad):
    with pytest.raises(ConfigError, match="not a floating dtype") as e:
        _run(tiny_llama, "gptq", bad, bits=4, group_size=32)
    assert "torch.bfloat16" in e.value.hint
    assert all(p.dtype == torch.float32 for p in tiny_llama.parameters())


def test_cast_batches_keeps_sharing_and_masks():
    """Gemma 3's local layers share one rotary table: still one tensor after the cast;
    floating tensors in bfloat16, boolean masks and token masks the same objects."""
    model = tiny_gemma3()
    _, blocks = find_decoder_blocks(model)
    with torch.no_grad():
        batches = capture_block_inputs(model, blocks, _ids()[:4], None, 2, torch.device("cpu"))
    out = cast_batches(batches, torch.bfloat16)
    assert [type(b) for b in out] == [BlockBatch, BlockBatch]
    for a, b in zip(batches, out):
        assert b[0].dtype == torch.bfloat16 and b[2] is a[2] and b[1] is b.layer_kwargs[0]
        local, glob = b.layer_kwargs[0]["position_embeddings"][0], b.layer_kwargs[1]["position_embeddings"][0]
        assert local is b.layer_kwargs[2]["position_embeddings"][0] and local is not glob
        assert b.layer_kwargs[0]["attention_mask"] is a.layer_kwargs[0]["attention_mask"]     # bool: kept
        cos, sin = b.layer_kwargs[1]["position_embeddings"]
        assert cos.dtype == torch.bfloat16 and torch.equal(cos, a.layer_kwargs[1]["position_embeddings"][0].bfloat16())
        assert a[0].dtype == torch.float32                   # the originals are left as they were
