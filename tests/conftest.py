"""Shared fixtures: tiny random models (unit tests) and the real SmolLM2-135M (integration)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny import tiny_model

SHARED = Path(os.environ.get("EDGEPRUNE_SHARED", Path(__file__).resolve().parents[2] / "shared"))




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


@pytest.fixture(scope="session")
def smollm2_int4(smollm2, tmp_path_factory) -> Path:
    """SmolLM2-135M exported int4 (RTN g32, q8 head, fused graph), KV cache 1,280 tokens;
    shared read-only by the runtime/profiler integration tests."""
    import exporters

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
