"""LeanK on the real SmolLM2-135M: export with pruned key caches, runtime bytes, parity
with the torch reference while pruning is active, and decode speed vs unpruned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def leank_exports(smollm2, module_tmp):
    import edgeprune_exporters as exporters
    from edgeprune.calibration import build_calibration
    from edgeprune.leank import learn_mask
    model, tok = smollm2
    calib = build_calibration(tok, nsamples=1, seqlen=128).input_ids
    mask = learn_mask(model, calib, 0.3, method="magnitude", alignment=8)
    root = module_tmp
    out = {"mask": mask}
    for name, m in (("k03", mask),):
        m.sink, m.window = 16, 64
        out[name] = exporters.export_onnx(model, tok, root / name, graph="fused", variants=[m],
                                          max_length=2112, parity_tokens=32)
    return out


def test_k_cache_middle_is_30_percent(leank_exports):
    import edgeprune_runtime as runtime
    mask = leank_exports["mask"]
    assert mask.fraction == pytest.approx(0.3, abs=0.01)
    assert (mask.counts() % 8 == 0).all()
    s = runtime.load(leank_exports["k03"].folder)
    b = s.kv_cache_bytes(2048)
    assert b["k_middle"] / b["k_middle_dense"] == pytest.approx(0.3, abs=0.01)
    assert b["full_tokens"] == 80 and b["k_full"] == 80 * 30 * 3 * 64 * 4
    # within sink + window the export equals the dense model
    assert leank_exports["k03"].parity["max_abs_logit_diff"] < 1e-3


def test_export_matches_reference_with_pruning_active(smollm2, leank_exports):
    import edgeprune_runtime as runtime
    from edgeprune.leank import apply_reference
    model, tok = smollm2
    text = ("The history of the city goes back to Roman times, when a small fort guarded the "
            "river crossing. ") * 30
    ids = np.array([tok(text, add_special_tokens=False)["input_ids"][:300]], np.int64)
    with torch.no_grad(), apply_reference(model, leank_exports["mask"], sink=16, window=64):
        ref = model(torch.from_numpy(ids)).logits.numpy()
    with torch.no_grad():
        dense = model(torch.from_numpy(ids)).logits.numpy()
    got = runtime.load(leank_exports["k03"].folder).logits(ids, chunk=128)
    assert np.abs(got - ref).max() < 2e-3
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.99
    assert np.abs(got - dense)[0, 100:].max() > 1e-2        # pruning is really active


# Decode speed at context 2,048 (pruned vs unpruned) is a benchmark, not a test:
# bench/leank.py --phases runtime measures it side by side and prints the ratio.
