"""Exporter + runtime on the real SmolLM2-135M-Instruct (integration)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import exporters
import runtime

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wiki_ids(smollm2, wikitext_path):
    _, tok = smollm2
    text = wikitext_path.read_text()[:40000]
    return np.array([tok(text, add_special_tokens=False)["input_ids"][:512]], dtype=np.int64)


@pytest.fixture(scope="module")
def fp32_folder(smollm2, tmp_path_factory):
    model, tok = smollm2
    out = tmp_path_factory.mktemp("smol") / "fp32"
    res = exporters.export_onnx(model, tok, out, precision="fp32", max_length=1024,
                                validate=False)
    return out, res


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def test_fp32_prefill_512_and_decode_64(smollm2, fp32_folder, wiki_ids):
    model, _ = smollm2
    folder, _ = fp32_folder
    ref = _torch_logits(model, wiki_ids)
    with runtime.load(folder, threads=2) as s:
        got = s.logits(wiki_ids)
        assert np.abs(got - ref).max() <= 1e-3
        # 64 decode steps through the shared KV cache after a 64-token prefill
        st = s._prefill([wiki_ids[0, :64].tolist()])
        errs = [np.abs(st["logits"][0] - ref[0, 63]).max()]
        for t in range(64, 128):
            errs.append(np.abs(s._decode_step(st, wiki_ids[0, t:t + 1])[0] - ref[0, t]).max())
    assert max(errs) <= 1e-3, max(errs)


def test_fp32_greedy_matches_torch_64(smollm2, fp32_folder, wiki_ids):
    model, _ = smollm2
    folder, _ = fp32_folder
    prompt = wiki_ids[:, :32]
    with torch.no_grad():
        ref = model.generate(torch.from_numpy(prompt), max_new_tokens=64, min_new_tokens=64,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, 32:].tolist()
    with runtime.load(folder, threads=2) as s:
        s.eos_token_ids = []
        r = s.generate(prompt[0].tolist(), max_new_tokens=64)
        assert r.token_ids[0] == ref
        chat = s.generate("What is the capital of France?", max_new_tokens=12, chat=True)
        assert "Paris" in chat.text


def test_int4_size_and_agreement(smollm2, fp32_folder, tmp_path):
    """int4 (RTN g32 asym + 8-bit head): <= 0.35x the fp32 file; the export's own
    validation compares a 256-token WikiText-like window against the torch model with
    the exported integer weights substituted (the fake-quantized model)."""
    model, tok = smollm2
    _, fp32 = fp32_folder
    res = exporters.export_onnx(model, tok, tmp_path / "int4", precision="int4",
                                max_length=1024, accuracy_level=0, parity_tokens=256)
    assert res.model_bytes <= 0.35 * fp32.model_bytes
    assert res.metadata["quantization"]["lm_head"] == "int8 block 64"   # 576 = 9 x 64
    assert res.parity["reference"].startswith("torch model with the exported integer")
    assert res.parity["top1_agreement"] >= 0.99          # accuracy_level 0: packing exact
    assert res.parity["max_abs_logit_diff"] < 1e-2
    with runtime.load(tmp_path / "int4", threads=2) as s:
        r = s.generate("What is the capital of France?", max_new_tokens=12, chat=True)
    assert "Paris" in r.text
