"""Issue 2's end-to-end must-shows on the real model: ONNX parity and the main job."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def window(smollm2, wikitext_path):
    from edgeprune.evaluate import eval_windows

    _, tok = smollm2
    w, _ = eval_windows(tok, wikitext_path, seqlen=512, nwindows=1)
    return w  # int64 [1, 512]


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[0].float().numpy()


def test_fp32_export_matches_pytorch_on_a_full_window(smollm2, window, tmp_path):
    import edgeprune_exporters as exporters
    import edgeprune_runtime as runtime

    model, tok = smollm2
    exporters.export_onnx(model, tok, tmp_path / "fp32", precision="fp32", validate=False)
    with runtime.load(tmp_path / "fp32", threads=2) as sess:
        got = sess.logits(window.numpy())[0]
    ref = _torch_logits(model, window)
    assert np.abs(got - ref).max() <= 1e-3
    assert (got.argmax(-1) == ref.argmax(-1)).mean() == 1.0


def test_int4_export_matches_pytorch_rtn(smollm2, window, tmp_path):
    """The quantizer's own codes, packed into MatMulNBits, reproduce the PyTorch RTN model.

    ``accuracy_level=1`` (fp32 compute) isolates the packing; the default level 4 also
    rounds activations to int8, which moves a few near-tied argmaxes (measured ~97%).
    """
    import edgeprune_exporters as exporters
    import edgeprune_runtime as runtime
    from edgeprune.engine import compress
    from edgeprune.recipe import RTNConfig

    model, tok = smollm2
    q = copy.deepcopy(model)
    res = compress(q, RTNConfig(bits=4, group_size=64, sym=False), window[:, :64], progress=False)
    assert len(res.quantized) == 30 * 7
    exporters.export_onnx(q, tok, tmp_path / "int4", precision="int4", quantized=res.quantized,
                          lm_head="fp", accuracy_level=1, validate=False)
    with runtime.load(tmp_path / "int4", threads=2) as sess:
        got = sess.logits(window.numpy())[0]
    ref = _torch_logits(q, window)
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    assert agree >= 0.99, agree
    size = sum(p.stat().st_size for p in (tmp_path / "int4").glob("model.onnx*"))
    assert size < 0.35 * 538e6


def test_main_job_small(tmp_path):
    """`edgeprune run` end to end with small settings: report files, real figures, samples."""
    from edgeprune.pipeline import RunConfig, run_pipeline

    cfg = RunConfig(method="rtn", bits=4, group_size=64, nsamples=4, seqlen=128, eval_nwindows=4,
                    prompt_len=32, gen_len=16, repeat=1)
    rep = run_pipeline(cfg, tmp_path / "run", log=lambda m: None, export_dense=False)
    data = json.loads((tmp_path / "run" / "report.json").read_text())
    assert (tmp_path / "run" / "report.md").read_text().startswith("# edgeprune run")
    ppl = data["rows"]["perplexity (one pass)"]            # the export, through the runtime
    assert 5 < ppl["dense"] < ppl["compressed"] < 2 * ppl["dense"]
    assert 5 < ppl["dense"] < ppl["pytorch"] < 2 * ppl["dense"]   # the fake-quant model, labelled
    assert 0 < data["rows"]["KL(dense||compressed) nats/token (one pass)"]["compressed"] < 1
    assert 0.5 < data["rows"]["top-1 agreement (one pass)"]["compressed"] < 1
    dec = data["rows"]["perplexity (decode path)"]
    assert 5 < dec["dense"] < dec["compressed"] < 2 * dec["dense"]
    assert 0.5 < data["rows"]["one pass vs decode path: argmax agreement"]["compressed"] <= 1
    assert data["rows"]["decode tokens/s"]["compressed"] > 1
    assert data["rows"]["model file (MiB)"]["compressed"] < 120
    assert rep.samples["compressed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
