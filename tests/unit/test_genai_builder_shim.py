"""bench/_genai_builder.py: the config fields onnxruntime-genai 0.18's Gemma 3 builder reads.

Checked on transformers' own configs in this venv (no peer venv, no weights): a Gemma 3
config gets the global base as ``rope_theta`` and a flat ``rope_parameters``, the sliding
layers' base as ``rope_local_base_freq``; other families pass through unchanged.
"""

from __future__ import annotations

from transformers import Gemma3TextConfig, Qwen2Config

from bench_modules import load_bench


def test_gemma3_config_gets_the_builder_fields():
    shim = load_bench("_genai_builder")
    cfg = Gemma3TextConfig(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    out = shim.builder_fields(cfg)
    assert out is cfg
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1_000_000.0}
    assert cfg.rope_theta == 1_000_000.0
    assert cfg.rope_local_base_freq == 10_000.0


def test_other_families_pass_through():
    shim = load_bench("_genai_builder")
    cfg = Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    before = dict(cfg.rope_parameters)
    shim.builder_fields(cfg)
    assert cfg.rope_parameters == before
    assert not hasattr(cfg, "rope_local_base_freq")
