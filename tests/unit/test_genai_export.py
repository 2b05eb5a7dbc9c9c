"""Exports other runtimes load (issue 24 item 1): ``genai_model.onnx`` + ``genai_config.json``
for onnxruntime-genai, ``config.json`` for Optimum, ``model.onnx`` untouched.

The onnxruntime-genai tests run that package in its side virtualenv
(``bench/benchlib.py peers ortgenai``, built here on first use, ~2 minutes) through
``tests/_genai_worker.py``; they skip only when it cannot be installed or imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime
from edgeprune_exporters.genai import GENAI_GRAPH

from bench_modules import peer_python
from tiny import byte_tokenizer, rand_ids

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "_genai_worker.py"
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def genai_python():
    """The side venv's python with onnxruntime-genai importable; skip when it cannot be built."""
    return peer_python("ortgenai", "onnxruntime-genai")


def _export(model, tok, path, **kw):
    kw.setdefault("max_length", 256)
    return exporters.export_onnx(model, tok, path, overwrite=True, **kw)


def _genai_generate(py: Path, folder: Path, prompt: list[int], n: int = NEW_TOKENS) -> dict:
    req = json.dumps({"prompt": [int(t) for t in prompt], "max_new_tokens": n})
    p = subprocess.run([str(py), str(WORKER), str(folder), req], capture_output=True, text=True,
                       timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _ours(folder: Path, prompt: list[int], n: int = NEW_TOKENS):
    with runtime.load(folder) as s:
        res = s.generate([int(t) for t in prompt], max_new_tokens=n)
        first = s.logits(np.asarray([prompt], np.int64))[0, -1]
    return res.token_ids[0], first


def _prune_24(model):
    with torch.no_grad():
        for n, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and n != "lm_head":
                g = m.weight.view(m.weight.shape[0], -1, 4)
                g.scatter_(-1, g.abs().argsort(-1)[..., :2], 0.0)
    return model


# ------------------------------------------------------------------ the folder (no genai)
def test_folder_carries_genai_graph_and_configs(tiny_llama, tok, tmp_path):
    res = _export(tiny_llama, tok, tmp_path / "m", precision="int4")
    f = res.folder
    assert {GENAI_GRAPH, "genai_config.json", "config.json", "model.onnx.data"} <= set(res.files)
    cfg = json.loads((f / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    assert dec["filename"] == GENAI_GRAPH
    assert dec["inputs"]["attention_mask"] == "attention_mask" and "position_ids" not in dec["inputs"]
    assert cfg["search"]["past_present_share_buffer"] is True
    hf = json.loads((f / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["num_hidden_layers"] == 2 and hf["use_cache"] is True
    assert "quantization_config" not in hf
    g = onnx.load(str(f / GENAI_GRAPH), load_external_data=False).graph
    assert [i.name for i in g.input][:2] == ["input_ids", "attention_mask"]
    assert not {"seqlens_k", "total_sequence_length", "num_logits_to_keep"} & {i.name for i in g.input}
    # every weight is read from our data file: the second graph holds nodes only
    ext = {e.value for t in g.initializer for e in t.external_data if e.key == "location"}
    assert ext == {"model.onnx.data"}
    assert res.files[GENAI_GRAPH] < 2 * res.files["model.onnx"]
    meta = json.loads((f / "edgeprune.json").read_text())
    assert meta["genai"]["graph"] == GENAI_GRAPH and "attention_mask" in meta["genai"]["inputs"]
    assert f"onnxruntime-genai and Optimum load {GENAI_GRAPH}" in res.summary()


def test_model_onnx_is_the_same_with_or_without_the_genai_graph(tiny_llama, tok, tmp_path):
    a = _export(tiny_llama, tok, tmp_path / "a", precision="int4").folder
    b = _export(tiny_llama, tok, tmp_path / "b", precision="int4", genai=False).folder
    for name in ("model.onnx", "model.onnx.data"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert not (b / GENAI_GRAPH).exists() and not (b / "genai_config.json").exists()
    assert (b / "config.json").exists()
    assert json.loads((b / "edgeprune.json").read_text())["genai"]["why"].startswith("not asked")


def test_no_second_graph_when_weights_stay_inline(tiny_llama, tok, tmp_path):
    res = _export(tiny_llama, tok, tmp_path / "m", external_data=False)
    assert "model.onnx.data" not in res.files and GENAI_GRAPH not in res.files
    assert "external_data=False" in res.metadata["genai"]["why"]


def test_no_genai_files_for_a_cache_it_cannot_feed(tok, tmp_path):
    """A plain Gemma 3 graph keeps only the window of its local layers (``local_kv="ring"``):
    onnxruntime-genai's caches span the context, so no genai graph or config is written."""
    from test_export_families import gemma3
    res = _export(gemma3(), tok, tmp_path / "ring", graph="plain")
    assert GENAI_GRAPH not in res.files and "genai_config.json" not in res.files
    assert "config.json" in res.files and "cannot feed" in res.metadata["genai"]["why"]


@pytest.mark.parametrize("graph", ["fused", "plain"])
def test_genai_graph_gives_our_logits_from_an_attention_mask(tiny_llama, tok, tmp_path, graph):
    """onnxruntime-genai's feed (attention_mask, no num_logits_to_keep) on genai_model.onnx
    gives, at every position, the logits our runtime gets from model.onnx."""
    f = _export(tiny_llama, tok, tmp_path / graph, graph=graph).folder
    ids = rand_ids(12, batch=1)
    ours = runtime.load(f).logits(ids)                              # [1, S, V]
    sess = ort.InferenceSession(str(f / GENAI_GRAPH))
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if graph == "plain":
        feed["position_ids"] = np.arange(ids.shape[1], dtype=np.int64)[None]
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            shape = [1 if d == "batch_size" else 0 if isinstance(d, str) else d for d in i.shape]
            if graph == "fused":       # onnxruntime-genai's shared buffer: max_length rows
                shape[2] = 256
            feed[i.name] = np.zeros(shape, np.float32)
    logits = sess.run(["logits"], feed)[0]
    assert logits.shape == ours.shape
    np.testing.assert_allclose(logits, ours, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------- onnxruntime-genai itself
def _case(case: str, tiny_llama, tiny_qwen2):
    """``(model, export options)`` of a float test case."""
    if case == "compact24":
        return _prune_24(tiny_llama), {"variants": ["compact24"]}
    if case == "countdown":
        from edgeprune import countdown as cd
        calib = torch.randint(0, 255, (4, 32), generator=torch.Generator().manual_seed(1))
        return tiny_llama, {"variants": [cd.calibrate(tiny_llama, calib, 0.5, "m")]}
    if case.startswith("gemma3"):     # sliding-window layers (window 8 < prompt + new tokens)
        from test_export_families import gemma3
        return gemma3(), {"graph": "plain", "local_kv": "full"} if case.endswith("plain") else {}
    return (tiny_qwen2 if case == "qwen2" else tiny_llama), \
        {"fp32-plain": {"graph": "plain"}, "fp16": {"precision": "fp16"}}.get(case, {})


@pytest.mark.parametrize("case", ["fp32", "fp32-plain", "fp16", "compact24", "countdown", "qwen2",
                                  "gemma3", "gemma3-plain"])
def test_onnxruntime_genai_greedy_equals_ours(genai_python, tiny_llama, tiny_qwen2, tok, tmp_path,
                                              case):
    """Float exports (llama, qwen2, gemma3; compact 2:4, COUNTDOWN): onnxruntime-genai's
    greedy tokens are ours, token for token."""
    model, kw = _case(case, tiny_llama, tiny_qwen2)
    f = _export(model, tok, tmp_path / case, **kw).folder
    lengths = []
    for seed in (3, 5):        # seed 5: both stop at the tokenizer's end-of-sequence token
        prompt = rand_ids(10, seed=seed)[0].tolist()
        theirs = _genai_generate(genai_python, f, prompt)
        ours, first = _ours(f, prompt)
        assert theirs["tokens"] == ours
        np.testing.assert_allclose(theirs["first_logits"], first,
                                   atol=2e-3 if case == "fp16" else 1e-4)
        lengths.append(len(ours))
    assert NEW_TOKENS in lengths


def test_onnxruntime_genai_int4_agrees_with_ours(genai_python, tiny_llama, tok, tmp_path):
    """int4 (int8 activations in MatMulNBits): the prompt's logits agree to the int8-activation
    rounding and the greedy tokens agree over at least the first 32 of 64 (measured here:
    identical logits, 64 of 64 tokens; both graphs run the same kernels)."""
    f = _export(tiny_llama, tok, tmp_path / "int4", precision="int4").folder
    prompt = rand_ids(10, seed=3)[0].tolist()
    theirs = _genai_generate(genai_python, f, prompt)
    ours, first = _ours(f, prompt)
    diff = float(np.max(np.abs(np.asarray(theirs["first_logits"]) - first)))
    assert diff < 0.05, diff
    agree = next((i for i, (a, b) in enumerate(zip(theirs["tokens"], ours)) if a != b), len(ours))
    # both may stop at the same end-of-sequence token before 32 (then they agree throughout)
    assert agree >= min(32, len(ours)) and (agree >= 32 or len(theirs["tokens"]) == len(ours)), \
        (agree, theirs["tokens"], ours)


def test_genai_perplexity_worker_matches_the_runtime(benchlib, tiny_llama, tok, tmp_path, monkeypatch):
    """``compare_runtimes.worker_genai_ppl`` (the peer's model.onnx in a plain onnxruntime
    session, empty KV cache, one pass per window) on our own GQA graph gives the
    perplexity our runtime gives on the same windows: the scorer of the peer's int4
    perplexity is the runtime's, to float rounding."""
    from bench_modules import load_bench

    cl = load_bench("compare_llamacpp")
    monkeypatch.setitem(sys.modules, "compare_llamacpp", cl)     # the worker imports it by name
    cr = load_bench("compare_runtimes")
    f = _export(tiny_llama, tok, tmp_path / "m").folder
    wfile = tmp_path / "windows.json"
    wfile.write_text(json.dumps([rand_ids(48, seed=s)[0].tolist() for s in range(3)]))
    theirs = cr.worker_genai_ppl(str(f), str(wfile), 1)
    ours = cl.worker_ppl_ours(str(f), str(wfile), 1)
    assert theirs["tokens"] == ours["tokens"] == 3 * 47
    assert theirs["ppl"] == pytest.approx(ours["ppl"], rel=1e-5)
    assert 50 < ours["ppl"] < 1000                       # a random 256-token model
