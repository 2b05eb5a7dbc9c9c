"""Exports of the two real models of the new families (Gemma 3 270M, Qwen2.5-Coder-0.5B), one
short test each: a WikiText-2 window through PyTorch and our fp32 export (logits and
perplexity), then an int4 export that generates 16 greedy tokens. Skipped, saying why,
when `make models` has not installed the model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime
from edgeprune.evaluate import eval_windows

pytestmark = pytest.mark.integration

#: alias -> (fixture, max |Δlogit| allowed in fp32, prompt, words one of which 16 tokens hold)
CASES = {
    "gemma3-270m": ("gemma3_270m", 2e-3, "The capital of France is", ("Paris", "France", "city")),
    "qwen2.5-coder-0.5b": ("qwen25_coder", 1e-3, "def fibonacci(n):", ("return", "if", "fib")),
}


def _ppl(logits: np.ndarray, ids: np.ndarray) -> float:
    lg = torch.from_numpy(np.ascontiguousarray(logits[0, :-1])).double()
    return math.exp(float(torch.nn.functional.cross_entropy(lg, torch.from_numpy(ids[0, 1:]))))


@pytest.mark.parametrize("alias", list(CASES))
def test_fp32_window_and_int4_greedy(alias, request, wikitext_path, tmp_path):
    fixture, tol, prompt, words = CASES[alias]
    model, tok = request.getfixturevalue(fixture)
    ids = eval_windows(tok, wikitext_path, seqlen=512, nwindows=1)[0].numpy()
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).logits.float().numpy()
    exporters.export_onnx(model, tok, tmp_path / "fp32", precision="fp32", max_length=1024,
                          validate=False)
    with runtime.load(tmp_path / "fp32") as s:
        got = s.logits(ids)
    assert np.abs(got - ref).max() <= tol
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert _ppl(got, ids) == pytest.approx(_ppl(ref, ids), rel=1e-5)
    del got, ref
    res = exporters.export_onnx(model, tok, tmp_path / "int4", precision="int4", max_length=1024,
                                validate=False)
    assert res.metadata["quantization"]["bits"] == 4
    with runtime.load(tmp_path / "int4") as s:
        out = s.generate([tok(prompt, add_special_tokens=alias.startswith("gemma"))["input_ids"]],
                         max_new_tokens=16)
    new, text = out.token_ids[0], out.texts[0]
    assert len(new) == 16 and len(set(new)) >= 6, f"degenerate continuation {text!r} ({new})"
    assert any(w in text for w in words), f"{prompt!r} -> {text!r}"
