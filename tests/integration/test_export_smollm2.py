"""Exporter + runtime on the real SmolLM2-135M-Instruct (integration)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wiki_ids(smollm2, wikitext_path):
    _, tok = smollm2
    text = wikitext_path.read_text()[:40000]
    return np.array([tok(text, add_special_tokens=False)["input_ids"][:512]], dtype=np.int64)


@pytest.fixture(scope="module")
def fp32_folder(smollm2, module_tmp):
    model, tok = smollm2
    out = module_tmp / "fp32"
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
    """int4 (RTN g64 asym, the export default, + 8-bit head): <= 0.35x the fp32 file; the export's own
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


def test_24_export_perplexity_and_compact_size(smollm2, wikitext_path, tmp_path):
    """Issue 4's 2:4 must-shows on the real model. (1) The 2:4 export (fp32) scores the
    PyTorch 2:4 model's perplexity within 0.1%. (2) The compact 2:4 folder (fp16 non-zero
    values + 2-bit positions, 8-bit tied head) is <= 0.6x the fp16 dense export's files
    (measured 150.8 vs 269.2 MB = 0.56x). (3) Its documented quality cost stays small:
    measured +0.36% perplexity, which comes from the 8-bit head's int8 activations
    (``accuracy_level=4``) and fp16 values; bounded here at 0.5%. Wanda 2:4 on a little of
    the embedded calibration text (seconds) is the subject: magnitude 2:4 (ppl ~2,300) is
    too degenerate a model to measure export error on."""
    import copy

    from edgeprune.calibration import build_calibration
    from edgeprune.engine import compress
    from edgeprune.evaluate import perplexity
    from edgeprune.recipe import WandaConfig

    dense, tok = smollm2
    model = copy.deepcopy(dense)
    cal = build_calibration(tok, None, nsamples=8, seqlen=256, seed=0)
    compress(model, WandaConfig(prune_n=2, prune_m=4), cal.input_ids, progress=False, measure_errors=False)

    def size(folder):
        return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("model.onnx"))

    def onnx_ppl(folder):
        with runtime.load(folder, threads=2, max_length=1024) as s:
            return perplexity(lambda ids: torch.from_numpy(s.logits(ids.numpy())), tok, wikitext_path,
                              seqlen=512, nwindows=nw, progress=False).ppl

    nw = 4
    ref = perplexity(model, tok, wikitext_path, seqlen=512, nwindows=nw, progress=False).ppl
    exp = {}
    for name, kw in (("fp32", dict(precision="fp32")), ("fp16", dict(precision="fp16")),
                     ("compact", dict(precision="fp32", variants=["compact24"]))):
        exp[name] = exporters.export_onnx(model, tok, tmp_path / name, sparse_24=True, max_length=1024,
                                          validate=False, **kw)
        assert exp[name].metadata["sparsity"]["pattern"] == "2:4"
    assert abs(onnx_ppl(tmp_path / "fp32") / ref - 1) <= 1e-3
    ratio = size(tmp_path / "compact") / size(tmp_path / "fp16")
    assert ratio <= 0.6, ratio
    assert abs(onnx_ppl(tmp_path / "compact") / ref - 1) <= 5e-3
