"""edgeprune.checkpoint on tiny random models: format, exact round trips, safety of writes."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from edgeprune.checkpoint import pack as ckpt_pack
from edgeprune.checkpoint import save as ckpt_save
from edgeprune.checkpoint import (load_checkpoint, pack_int32, save_checkpoint, unpack_int32,
                                  is_edgeprune_checkpoint)
from edgeprune.errors import CheckpointError
from edgeprune.quantize import rtn_quantize

PROV = {"method": "rtn", "calibration": {"source": "random", "nsamples": 2, "seqlen": 8, "seed": 0},
        "seed": 0}


def _linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]


def _quantize(model, bits_of=lambda n: 4, sym_of=lambda n: False, group_size=32, g_idx_of=None):
    """RTN every decoder linear in place; returns a CompressionResult-like namespace."""
    res = SimpleNamespace(quantized={}, masks={}, sparsity_pattern={},
                          recipe={"method": "rtn", "group_size": group_size})
    for n in _linears(model):
        mod = model.get_submodule(n)
        qw = rtn_quantize(mod.weight.data, bits_of(n), group_size, sym=sym_of(n))
        if g_idx_of is not None and g_idx_of(n):
            # a non-default group assignment (as GPTQ act_order with dynamic groups makes)
            perm = torch.randperm(qw.shape[1], generator=torch.Generator().manual_seed(1))
            qw.g_idx = (perm // group_size).to(torch.int32)
        mod.weight.data = qw.dequantize()
        res.quantized[n] = qw
    return res


def _prune_24(model, names):
    res = SimpleNamespace(quantized={}, masks={}, sparsity_pattern={}, recipe={"method": "magnitude"})
    for n in names:
        w = model.get_submodule(n).weight.data
        g = w.abs().reshape(w.shape[0], -1, 4)
        keep = torch.zeros_like(g, dtype=torch.bool).scatter_(2, g.topk(2, dim=2).indices, True)
        mask = keep.reshape(w.shape)
        w.mul_(mask)
        res.masks[n] = mask
        res.sparsity_pattern[n] = "2:4"
    return res


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------ packing

@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_pack_roundtrip_and_matches_compressed_tensors(bits, packed_dim):
    g = torch.Generator().manual_seed(bits)
    vals = torch.randint(0, 2 ** bits, (13, 45), generator=g, dtype=torch.uint8)
    packed = pack_int32(vals, bits, packed_dim)
    n_words = -(-45 * bits // 32) if packed_dim == 1 else -(-13 * bits // 32)
    assert packed.dtype == torch.int32
    assert packed.shape == ((13, n_words) if packed_dim == 1 else (n_words, 45))
    assert torch.equal(unpack_int32(packed, bits, vals.shape, packed_dim), vals)
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    signed = (vals.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)
    assert torch.equal(packed, helpers.pack_to_int32(signed, bits, packed_dim=packed_dim))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_whole_word_pack_matches_compressed_tensors(bits, packed_dim):
    """Whole int32 words (the shift-and-add path): the same words as compressed-tensors."""
    vals = torch.randint(0, 2 ** bits, (32, 64), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack_int32(vals, bits, packed_dim)
    assert torch.equal(unpack_int32(packed, bits, vals.shape, packed_dim), vals)
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    signed = (vals.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)
    assert torch.equal(packed, helpers.pack_to_int32(signed, bits, packed_dim=packed_dim))


def test_pack_layout_known_value():
    # 4-bit codes 1..8 in one row -> one word 0x87654321, little-endian nibbles
    vals = torch.arange(1, 9, dtype=torch.uint8)[None]
    assert pack_int32(vals, 4).item() == 0x87654321 - 2 ** 32
    with pytest.raises(CheckpointError, match="outside"):
        pack_int32(torch.tensor([[16]]), 4)


# ------------------------------------------------------------------ round trips

def test_compressed_tensors_roundtrip_identical_logits_and_codes(tiny_llama, tmp_path):
    res = _quantize(tiny_llama, bits_of=lambda n: 8 if "v_proj" in n else 4,
                    sym_of=lambda n: "k_proj" in n)
    ref = _logits(tiny_llama, IDS)
    out = save_checkpoint(tiny_llama, None, res, tmp_path / "ck", provenance=PROV,
                          asym_layout="pack-quantized-compact")
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    # one config group per (bits, group, sym): 4-bit asym, 4-bit sym (k_proj), 8-bit asym (v_proj)
    schemes = sorted((g["weights"]["num_bits"], g["weights"]["symmetric"]) for g in qc["config_groups"].values())
    assert schemes == [(4, False), (4, True), (8, False)]
    assert cfg["edgeprune"]["calibration"]["source"] == "random" and cfg["edgeprune"]["seed"] == 0
    from safetensors.torch import load_file
    st = load_file(str(out / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    assert f"{q}.weight" not in st and st[f"{q}.weight_packed"].dtype == torch.int32
    assert st[f"{q}.weight_packed"].shape == (64, 64 * 4 // 32)
    assert st[f"{q}.weight_zero_point"].shape == (64 * 4 // 32, 2)
    assert "model.layers.0.self_attn.k_proj.weight_zero_point" not in st  # symmetric: none stored

    model, tok, info = load_checkpoint(out)
    assert tok is None and info.format == "compressed-tensors"
    assert torch.equal(_logits(model, IDS), ref)
    assert set(info.quantized) == set(res.quantized)
    for n, qw in res.quantized.items():
        got = info.quantized[n]
        assert torch.equal(got.codes, qw.codes) and torch.equal(got.zeros, qw.zeros)
        assert torch.equal(got.scales, qw.scales)
        assert (got.bits, got.group_size, got.sym) == (qw.bits, qw.group_size, qw.sym)
    assert info.provenance["method"] == "rtn"
    rec = json.loads((out / "edgeprune_checkpoint.json").read_text())
    assert rec["quantized_layers"][q]["bits"] == 4
    assert abs(rec["avg_bits_per_weight"] - info.avg_bits_per_weight) < 1e-4


def test_dense_format_roundtrip_recovers_codes(tiny_qwen2, tmp_path):
    res = _quantize(tiny_qwen2, group_size=16, sym_of=lambda n: "mlp" in n)
    ref = _logits(tiny_qwen2, IDS)
    out = save_checkpoint(tiny_qwen2, None, res, tmp_path / "d", format="dense", provenance=PROV)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model, _, info = load_checkpoint(out)
    assert info.format == "dense" and torch.equal(_logits(model, IDS), ref)
    for n, qw in res.quantized.items():
        assert torch.equal(info.quantized[n].codes, qw.codes)
        assert torch.equal(info.quantized[n].zeros, qw.zeros)
    # and a dense folder is a plain transformers folder
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert torch.equal(_logits(hf, IDS), ref)


def test_act_order_g_idx_roundtrip(tiny_llama, tmp_path):
    res = _quantize(tiny_llama, g_idx_of=lambda n: "o_proj" in n)
    ref = _logits(tiny_llama, IDS)
    out = save_checkpoint(tiny_llama, None, res, tmp_path / "g", provenance=PROV)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert any(g["weights"].get("actorder") == "group" for g in qc["config_groups"].values())
    model, _, info = load_checkpoint(out)
    assert torch.equal(_logits(model, IDS), ref)
    o = "model.layers.1.self_attn.o_proj"
    assert torch.equal(info.quantized[o].g_idx, res.quantized[o].g_idx)
    assert not info.quantized[o].has_default_order()


# ------------------------------------------------------------------ plain transformers

def _hf_load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


def test_symmetric_mixed_precision_loads_in_plain_transformers(tiny_llama, tmp_path):
    pytest.importorskip("compressed_tensors")
    res = _quantize(tiny_llama, bits_of=lambda n: 8 if "down_proj" in n else 4, sym_of=lambda n: True)
    ref = _logits(tiny_llama, IDS)
    out = save_checkpoint(tiny_llama, None, res, tmp_path / "s", provenance=PROV)
    assert torch.equal(_logits(_hf_load(out), IDS), ref)


def test_asymmetric_naive_layout_loads_in_plain_transformers(tiny_llama, tmp_path):
    pytest.importorskip("compressed_tensors")
    res = _quantize(tiny_llama, sym_of=lambda n: "k_proj" in n)
    ref = _logits(tiny_llama, IDS)
    out = save_checkpoint(tiny_llama, None, res, tmp_path / "n", provenance=PROV,
                          asym_layout="naive-quantized")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    assert torch.equal(_logits(_hf_load(out), IDS), ref)
    model, _, info = load_checkpoint(out)
    assert torch.equal(_logits(model, IDS), ref)
    assert all(torch.equal(info.quantized[n].codes, q.codes) for n, q in res.quantized.items())


@pytest.mark.xfail(strict=True, reason="upstream: transformers 5.24 + compressed-tensors 0.20 allocate "
                   "an unpacked weight_zero_point for pack-quantized asymmetric layers (size mismatch; "
                   "llm-compressor#1618). The default 'pack-quantized' layout pads the zero points to "
                   "that shape (test_asymmetric_packed_loads_in_plain_transformers).")
def test_asymmetric_compact_packed_loads_in_plain_transformers(tiny_llama, tmp_path):
    pytest.importorskip("compressed_tensors")
    res = _quantize(tiny_llama)
    ref = _logits(tiny_llama, IDS)
    out = save_checkpoint(tiny_llama, None, res, tmp_path / "a", provenance=PROV,
                          asym_layout="pack-quantized-compact")
    assert torch.equal(_logits(_hf_load(out), IDS), ref)


def test_asymmetric_packed_loads_in_plain_transformers(tiny_llama, tmp_path):
    """The work-around of llm-compressor#1618: packed codes, and packed zero points
    zero-padded to the [out, n_groups] shape transformers allocates; transformers, and
    our loader, give the compressed model's logits exactly."""
    pytest.importorskip("compressed_tensors")
    res = _quantize(tiny_llama, bits_of=lambda n: 8 if "v_proj" in n else 4, sym_of=lambda n: "k_proj" in n)
    ref = _logits(tiny_llama, IDS)
    out = save_checkpoint(tiny_llama, None, res, tmp_path / "a", provenance=PROV,
                          asym_layout="pack-quantized")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    from safetensors.torch import load_file
    st = load_file(str(out / "model.safetensors"))
    q, v = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"
    assert st[f"{q}.weight_packed"].shape == (64, 64 * 4 // 32)
    zp = st[f"{q}.weight_zero_point"]
    assert zp.dtype == torch.int32 and zp.shape == (64, 2) and not zp[64 * 4 // 32:].any()
    assert st[f"{v}.weight_zero_point"].shape == (32, 2) and not st[f"{v}.weight_zero_point"][32 * 8 // 32:].any()
    assert torch.equal(_logits(_hf_load(out), IDS), ref)
    model, _, info = load_checkpoint(out)
    assert torch.equal(_logits(model, IDS), ref)
    assert all(torch.equal(info.quantized[n].zeros, qw.zeros) for n, qw in res.quantized.items())


def test_padded_zero_points_must_be_zero_padding():
    zeros = torch.randint(0, 16, (64, 2), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_int32(zeros, 4, 0)
    padded = ckpt_pack.pad_rows(packed, 64)
    assert padded.shape == (64, 2) and torch.equal(ckpt_pack.unpad_rows(padded, 64, 4), packed)
    assert torch.equal(unpack_int32(ckpt_pack.unpad_rows(padded, 64, 4), 4, (64, 2), 0), zeros)
    assert ckpt_pack.unpad_rows(packed, 64, 4) is packed                  # compact: as it is
    with pytest.raises(CheckpointError, match="expected"):               # padding is not codes
        unpack_int32(padded, 4, (64, 2), 0)
    padded[40, 1] = 7
    with pytest.raises(ValueError, match="padding rows 8..63 are not zero"):
        ckpt_pack.unpad_rows(padded, 64, 4)


def test_default_checkpoint_of_an_asymmetric_recipe_loads_in_plain_transformers(tiny_llama, tmp_path):
    """The default layout is the one transformers loads (the packed default failed for
    every asymmetric recipe, best-w4 included)."""
    pytest.importorskip("compressed_tensors")
    res = _quantize(tiny_llama)
    ref = _logits(tiny_llama, IDS)
    out = save_checkpoint(tiny_llama, None, res, tmp_path / "d", provenance=PROV)
    assert torch.equal(_logits(_hf_load(out), IDS), ref)


# ------------------------------------------------------------------ tied embeddings

def _tied_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    m = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    return m


def test_tied_embedding_kept_tied_and_present(tmp_path):
    m = _tied_llama()
    res = _quantize(m)
    ref = _logits(m, IDS)
    out = save_checkpoint(m, None, res, tmp_path / "t", provenance=PROV)
    from safetensors.torch import load_file
    st = load_file(str(out / "model.safetensors"))
    assert "model.embed_tokens.weight" in st and "lm_head.weight" not in st
    model, _, info = load_checkpoint(out)
    assert info.tied_embeddings == "tied"
    assert torch.equal(model.model.embed_tokens.weight, m.model.embed_tokens.weight)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(_logits(model, IDS), ref)


def test_quantized_head_unties_and_keeps_embedding(tmp_path):
    m = _tied_llama()
    res = _quantize(m)
    emb = m.model.embed_tokens.weight.detach().clone()
    qh = rtn_quantize(m.lm_head.weight.data, 8, 32)
    m.lm_head.weight = torch.nn.Parameter(qh.dequantize())  # untie: head now quantized
    res.quantized["lm_head"] = qh
    ref = _logits(m, IDS)
    out = save_checkpoint(m, None, res, tmp_path / "h", provenance=PROV)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert cfg["edgeprune"]["tied_embeddings"] == "untied-quantized-head"
    model, _, info = load_checkpoint(out)
    assert torch.equal(model.model.embed_tokens.weight, emb)
    assert torch.equal(info.quantized["lm_head"].codes, qh.codes)
    assert torch.equal(_logits(model, IDS), ref)


# ------------------------------------------------------------------ sparsity

def test_24_masks_roundtrip_and_marked(tiny_llama, tmp_path):
    names = _linears(tiny_llama)
    res = _prune_24(tiny_llama, names)
    # a kept weight that is exactly zero: the mask is no longer `weight != 0` and must be stored
    n0 = names[0]
    keep = res.masks[n0].nonzero()[0]
    tiny_llama.get_submodule(n0).weight.data[keep[0], keep[1]] = 0.0
    ref = _logits(tiny_llama, IDS)
    out = save_checkpoint(tiny_llama, None, res, tmp_path / "p", provenance=PROV)
    rec = json.loads((out / "edgeprune_checkpoint.json").read_text())
    assert rec["sparse_layers"][n0]["mask"] == "stored"
    assert rec["sparse_layers"][names[1]]["mask"] == "nonzero"
    assert rec["sparse_layers"][names[1]]["pattern"] == "2:4"
    assert abs(rec["sparse_layers"][names[1]]["sparsity"] - 0.5) < 1e-9
    model, _, info = load_checkpoint(out)
    assert torch.equal(_logits(model, IDS), ref)
    for n in names:
        assert torch.equal(info.masks[n], res.masks[n]), n
        assert info.sparsity_pattern[n] == "2:4"


def test_24_plus_int4_marks_sparsity_config(tiny_llama, tmp_path):
    names = _linears(tiny_llama)
    pr = _prune_24(tiny_llama, names)
    res = _quantize(tiny_llama, sym_of=lambda n: True)
    res.masks, res.sparsity_pattern = pr.masks, pr.sparsity_pattern
    ref = _logits(tiny_llama, IDS)
    out = save_checkpoint(tiny_llama, None, res, tmp_path / "pq", provenance=PROV)
    sc = json.loads((out / "config.json").read_text())["quantization_config"]["sparsity_config"]
    assert sc["sparsity_structure"] == "2:4" and sc["format"] == "dense"
    assert abs(sc["global_sparsity"] - 0.5) < 1e-6 and sorted(sc["targets"]) == sorted(names)
    model, _, info = load_checkpoint(out)
    assert torch.equal(_logits(model, IDS), ref)
    assert all(torch.equal(info.masks[n], pr.masks[n]) for n in names)
    assert torch.equal(_logits(_hf_load(out), IDS), ref)


# ------------------------------------------------------------------ safety of writes

def test_refuses_non_empty_dir_of_other_run_unless_overwrite(tiny_llama, tmp_path):
    res = _quantize(tiny_llama)
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("someone's file")
    # a folder of other files is never replaced, not even with overwrite
    for ow in (False, True):
        with pytest.raises(CheckpointError, match="not an edgeprune checkpoint.*notes.txt"):
            save_checkpoint(tiny_llama, None, res, out, provenance=PROV, overwrite=ow)
    assert (out / "notes.txt").read_text() == "someone's file"
    (out / "notes.txt").unlink()
    save_checkpoint(tiny_llama, None, res, out, provenance=PROV, overwrite=True)
    assert is_edgeprune_checkpoint(out)
    # same run again: allowed without overwrite; a different run: refused
    save_checkpoint(tiny_llama, None, res, out, provenance=PROV)
    with pytest.raises(CheckpointError, match="different run"):
        save_checkpoint(tiny_llama, None, res, out, provenance={**PROV, "seed": 1})


def test_failing_write_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    res = _quantize(tiny_llama)

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt_save, "_write_safetensors", boom)
    with pytest.raises(CheckpointError, match="disk full"):
        save_checkpoint(tiny_llama, None, res, tmp_path / "f", provenance=PROV)
    assert os.listdir(tmp_path) == []
    # an existing checkpoint survives a failed overwrite untouched
    monkeypatch.undo()
    out = save_checkpoint(tiny_llama, None, res, tmp_path / "f", provenance=PROV)
    before = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(ckpt_save, "_write_safetensors", boom)
    with pytest.raises(CheckpointError):
        save_checkpoint(tiny_llama, None, res, out, provenance={**PROV, "seed": 5}, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["f"]
    assert (out / "model.safetensors").read_bytes() == before

    # Ctrl-C / SIGTERM (KeyboardInterrupt) mid-write: the temp folder and the parent
    # folders made for it go too (a hidden .f.tmp-* folder with half the files was left)
    def interrupt(tensors, path):
        path.write_bytes(b"partial")
        raise KeyboardInterrupt
    monkeypatch.setattr(ckpt_save, "_write_safetensors", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tiny_llama, None, res, tmp_path / "new" / "g", provenance=PROV)
    assert sorted(os.listdir(tmp_path)) == ["f"]


def test_refuses_writing_into_source_folder(tiny_llama, tmp_path):
    src = tmp_path / "src"
    tiny_llama.save_pretrained(str(src))
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(src)).eval()
    res = _quantize(m)
    for bad in (src, src / "compressed"):
        with pytest.raises(CheckpointError, match="input model"):
            save_checkpoint(m, None, res, bad, provenance=PROV, overwrite=True)
    with pytest.raises(CheckpointError, match="holds the input model folder"):
        save_checkpoint(m, None, res, tmp_path, provenance=PROV, overwrite=True)
    assert (src / "config.json").exists()


def test_rejects_weights_that_disagree_with_codes(tiny_llama, tmp_path):
    res = _quantize(tiny_llama)
    tiny_llama.model.layers[0].mlp.up_proj.weight.data.add_(0.01)
    with pytest.raises(CheckpointError, match="differs from its integer codes"):
        save_checkpoint(tiny_llama, None, res, tmp_path / "x", provenance=PROV)
    assert os.listdir(tmp_path) == []


def test_bad_format_and_missing_files(tiny_llama, tmp_path):
    with pytest.raises(CheckpointError, match="unknown checkpoint format"):
        save_checkpoint(tiny_llama, None, None, tmp_path / "y", format="gguf")
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path)
    out = save_checkpoint(tiny_llama, None, None, tmp_path / "z")
    (out / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(out)


def test_uncompressed_model_with_tokenizer(tiny_llama, tmp_path):
    tok_mod = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast
    t = tok_mod.Tokenizer(tok_mod.models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = tok_mod.pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")
    ref = _logits(tiny_llama, IDS)
    out = save_checkpoint(tiny_llama, tok, None, tmp_path / "u", provenance=PROV)
    model, tok2, info = load_checkpoint(out)
    assert info.quantized == {} and info.avg_bits_per_weight is None
    assert tok2 is not None and tok2("a b")["input_ids"] == tok("a b")["input_ids"]
    assert torch.equal(_logits(model, IDS), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["compressed-tensors", "dense"])
def test_half_precision_model_saves_and_reloads_exactly(tiny_llama, tmp_path, dtype, fmt):
    """A bf16/fp16 model holds its dequantized weights rounded to its dtype: that is what
    was compressed, not an edit (the save refused it as 'modified after compression'),
    and the reload in that dtype gives back the same weights and logits."""
    from edgeprune.engine import compress
    from edgeprune.recipe import RTNConfig
    model = tiny_llama.to(dtype)
    g = torch.Generator().manual_seed(0)
    res = compress(model, RTNConfig(bits=4, group_size=32), torch.randint(0, 256, (4, 32), generator=g),
                   progress=False)
    out = save_checkpoint(model, None, res, tmp_path / "ck", format=fmt, provenance=PROV)
    back, _, info = load_checkpoint(out, dtype=dtype)
    assert sorted(info.quantized) == sorted(res.quantized)
    for (k, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b), k
    ids = torch.randint(0, 256, (1, 16), generator=g)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)


def test_overwrite_never_deletes_the_users_files(tiny_llama, tmp_path):
    """A checkpoint folder the user added files to is refused even with overwrite (its
    marker file was enough to delete everything in it)."""
    res = _quantize(tiny_llama)
    out = save_checkpoint(tiny_llama, None, res, tmp_path / "ck", provenance=PROV)
    (out / "notes.txt").write_text("mine")
    (out / "mydata").mkdir()
    with pytest.raises(CheckpointError, match=r"holds files that are not an edgeprune checkpoint \(mydata, notes.txt\)"):
        save_checkpoint(tiny_llama, None, res, out, provenance={**PROV, "seed": 3}, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "mydata").is_dir()
    (out / "notes.txt").unlink()
    (out / "mydata").rmdir()
    save_checkpoint(tiny_llama, None, res, out, provenance={**PROV, "seed": 3}, overwrite=True)


def test_a_second_writer_is_refused_at_once(tiny_llama, tmp_path):
    """Two compress runs into one new folder both reported success and one result was
    silently lost (the existence check came before the rename, in both). While another
    process holds the folder, the save is refused and writes nothing; after it, the
    checkpoint is written and nothing is left beside it."""
    from _claims import claim_held_elsewhere

    res = _quantize(tiny_llama)
    with claim_held_elsewhere(tmp_path / "racek") as pid:
        with pytest.raises(CheckpointError, match=rf"racek is being written by another edgeprune "
                                                  rf"process \(pid {pid}\)"):
            save_checkpoint(tiny_llama, None, res, tmp_path / "racek", provenance=PROV)
        assert os.listdir(tmp_path) == [".racek.lock"]
    save_checkpoint(tiny_llama, None, res, tmp_path / "racek", provenance=PROV)
    assert os.listdir(tmp_path) == ["racek"] and is_edgeprune_checkpoint(tmp_path / "racek")


def test_a_killed_save_is_cleaned_up_by_the_next(tiny_llama, tmp_path):
    """A save killed mid-write (SIGKILL: no exception handler runs) left its lock and a
    hidden temporary folder; the next save into that folder removes both."""
    import socket
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    (tmp_path / ".ck.lock").write_text(json.dumps({"pid": p.pid, "host": socket.gethostname(),
                                                   "start": None, "token": "gone"}))
    (tmp_path / f".ck.tmp-{p.pid}-x1y2z3").mkdir()
    (tmp_path / f".ck.tmp-{p.pid}-x1y2z3" / "model.safetensors").write_bytes(b"half")
    out = save_checkpoint(tiny_llama, None, _quantize(tiny_llama), tmp_path / "ck", provenance=PROV)
    assert os.listdir(tmp_path) == ["ck"] and is_edgeprune_checkpoint(out)
