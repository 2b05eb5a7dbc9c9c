"""Small 4-bit checkpoints: packed codes for asymmetric layers too, the embedding in 16
bits, and plain transformers (with compressed-tensors) giving our loader's logits."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from edgeprune.checkpoint import load_checkpoint, round_embeddings, save_checkpoint, storage_dtype
from edgeprune.errors import CheckpointError
from edgeprune.quantize import rtn_quantize
from tiny import tiny_model

IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _rtn(model, group_size=32, sym=False):
    from types import SimpleNamespace

    res = SimpleNamespace(quantized={}, masks={}, sparsity_pattern={},
                          recipe={"method": "rtn", "group_size": group_size, "sym": sym})
    for n, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in n:
            qw = rtn_quantize(mod.weight.data, 4, group_size, sym=sym)
            mod.weight.data = qw.dequantize()
            res.quantized[n] = qw
    return res


def _size(folder) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _tied_llama():
    from transformers import LlamaConfig

    return tiny_model(LlamaConfig, tie_word_embeddings=True)     # tied, as SmolLM2


def test_4bit_checkpoint_is_at_most_0_3x_fp32_and_transformers_agrees(tmp_path):
    pytest.importorskip("compressed_tensors")
    m = _tied_llama()
    fp32 = save_checkpoint(copy.deepcopy(m), None, None, tmp_path / "fp32", format="dense")
    assert round_embeddings(m) == "float16"          # random float32 weights: rounded to float16
    res = _rtn(m)                                    # asymmetric 4-bit g32, as rtn --asym
    ref = _logits(m)
    out = save_checkpoint(m, None, res, tmp_path / "w4", provenance={"method": "rtn"})
    ratio = _size(out) / _size(fp32)
    assert ratio <= 0.3, ratio
    from safetensors.torch import load_file

    st = load_file(str(out / "model.safetensors"))
    assert st["model.embed_tokens.weight"].dtype == torch.float16 and "lm_head.weight" not in st
    q = "model.layers.1.mlp.down_proj"
    assert f"{q}.weight" not in st and st[f"{q}.weight_packed"].dtype == torch.int32
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    ours, _, info = load_checkpoint(out)
    assert ours.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(_logits(ours), ref)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert torch.equal(_logits(hf), _logits(ours))


def test_naive_layout_and_float32_embedding_are_the_large_ones(tmp_path):
    """The old default (int8 codes, float32 embedding) for comparison: its weights file
    is over 1.5x the new one's (SmolLM2-135M: 221 MB against 125 MB)."""
    m = _tied_llama()
    res = _rtn(m)
    naive = save_checkpoint(m, None, res, tmp_path / "n", asym_layout="naive-quantized")
    m2 = _tied_llama()
    round_embeddings(m2)
    packed = save_checkpoint(m2, None, _rtn(m2), tmp_path / "p")
    weights = "model.safetensors"
    assert (naive / weights).stat().st_size > 1.5 * (packed / weights).stat().st_size


def test_round_embeddings_keeps_exact_values_and_untied_heads():
    from transformers import LlamaConfig

    m = tiny_model(LlamaConfig)                      # untied head
    with torch.no_grad():
        m.model.embed_tokens.weight.copy_(m.model.embed_tokens.weight.to(torch.bfloat16).float())
    emb = m.model.embed_tokens.weight.detach().clone()
    head = m.lm_head.weight.detach().clone()
    assert round_embeddings(m, "float32") is None and torch.equal(m.lm_head.weight, head)
    round_embeddings(m, "auto", skip=["lm_head"])     # a head the recipe quantizes: untouched
    assert torch.equal(m.model.embed_tokens.weight, emb)   # bfloat16-exact: unchanged
    assert torch.equal(m.lm_head.weight, head)
    assert round_embeddings(m, "bfloat16") == "bfloat16"
    assert storage_dtype(m.lm_head.weight.detach()) == torch.bfloat16
    assert storage_dtype(torch.tensor([0.1])) is None
    with pytest.raises(CheckpointError, match="unknown embedding dtype"):
        round_embeddings(m, "int3")
    with torch.no_grad():
        m.model.embed_tokens.weight[0, 0] = 1e6
    with pytest.raises(CheckpointError, match="float16's range"):
        round_embeddings(m, "float16")


def test_dense_format_keeps_float32(tmp_path):
    m = _tied_llama()
    round_embeddings(m)
    out = save_checkpoint(m, None, None, tmp_path / "d", format="dense")
    from safetensors.torch import load_file

    assert load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"].dtype == torch.float32
