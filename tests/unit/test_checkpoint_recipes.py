"""The shipped preset recipe best-w4: parses, selects layers as intended, fits 4.5 bits/weight."""

from __future__ import annotations

from pathlib import Path

import torch

from edgeprune.quantize import QuantizedWeight

BEST = Path(__file__).resolve().parents[2] / "edgeprune" / "recipes" / "best-w4.yaml"

# SmolLM2-135M decoder linears (out, in), 30 blocks
SHAPES = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576), "self_attn.v_proj": (192, 576),
          "self_attn.o_proj": (576, 576), "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576),
          "mlp.down_proj": (576, 1536)}


def _final_quant_stage(recipe, name):
    """The last quantization stage that selects ``name`` (the one producing the codes)."""
    hit = [s for s in recipe.stages if s.quantizes and s.selects(name)]
    return hit[-1] if hit else None


def test_best_w4_parses_and_partitions_layers():
    from edgeprune.recipe import Recipe
    r = Recipe.from_file(BEST)
    assert r.name == "best-w4" and [s.method for s in r.stages] == ["gptq", "gptq"]
    for i in (0, 17, 29):
        for short in SHAPES:
            name = f"model.layers.{i}.{short}"
            gptq = [s for s in r.stages if s.method == "gptq" and s.selects(name)]
            assert len(gptq) == 1, name  # exactly one stage produces the codes
            eight = short == "self_attn.v_proj" or (i == 0 and short == "mlp.down_proj")
            assert gptq[0].bits == (8 if eight else 4), name
    assert [s.bits for s in r.stages if s.selects("model.layers.10.mlp.down_proj")] == [4]
    assert not any(s.selects("lm_head") for s in r.stages)


def test_best_w4_average_bits_per_weight_within_budget():
    from edgeprune.recipe import Recipe
    r = Recipe.from_file(BEST)
    tot_bits = tot = 0.0
    for i in range(30):
        for short, (o, n) in SHAPES.items():
            s = _final_quant_stage(r, f"model.layers.{i}.{short}")
            g = n // s.group_size
            qw = QuantizedWeight(codes=torch.zeros(o, n, dtype=torch.uint8), scales=torch.ones(o, g),
                                 zeros=torch.zeros(o, g, dtype=torch.uint8), bits=s.bits,
                                 group_size=s.group_size, sym=s.sym)
            tot_bits += qw.bits_per_weight() * o * n
            tot += o * n
    avg = tot_bits / tot
    # 4-bit asym g64 = 4.3125; 8-bit asym g64 = 8.375 on the v_proj weights and one down_proj
    n8 = 30 * 192 * 576 + 576 * 1536
    assert abs(avg - (4.3125 + (8.375 - 4.3125) * n8 / tot)) < 1e-9
    assert abs(avg - 4.4733) < 1e-4 and avg <= 4.5


def test_run_defaults_to_the_best_w4_refit_preset_and_multilingual_self_calibration():
    """`edgeprune run` with no method setting compresses with best-w4-refit (best-w4 with
    clipped 4-bit grids and three scale-refit rounds in both stages) calibrated on text
    sampled from the model, seeded in several languages; any method setting switches to
    DEFAULT_METHOD plus it."""
    from edgeprune.pipeline import DEFAULT_CALIB, RunConfig, build_recipe
    from edgeprune.recipe import Recipe
    r = build_recipe(RunConfig())
    best = Recipe.from_file(BEST).to_dict()
    assert r.to_dict()["name"] == "best-w4-refit"
    got = r.to_dict()["stages"]
    assert got[1].pop("clip_search") is True and got[0].get("clip_search") in (None, False)
    assert [st.pop("refit_scales") for st in got] == [3, 3]
    for st in best["stages"]:
        st.pop("clip_search", None)
        assert st.pop("refit_scales", 0) == 0
    for st in got:
        st.pop("clip_search", None)
    assert got == best["stages"]                    # otherwise exactly best-w4
    assert DEFAULT_CALIB == "self-multilingual" and RunConfig().calib is None and RunConfig().nsamples == 64
    r3 = build_recipe(RunConfig(bits=3))
    assert [(s.method, s.bits, s.group_size, s.sym) for s in r3.stages] == [("gptq", 3, 64, False)]
    rr = build_recipe(RunConfig(method="rtn"))
    assert [(s.method, s.bits) for s in rr.stages] == [("rtn", 4)]
    assert build_recipe(RunConfig(recipe="best-w4-refit")).to_dict() == r.to_dict()


def test_sparsity_settings_without_a_method_are_refused():
    import pytest

    from edgeprune.errors import ConfigError
    from edgeprune.pipeline import RunConfig, build_recipe
    for cfg in (RunConfig(sparsity=0.5), RunConfig(prune_n=2, prune_m=4)):
        with pytest.raises(ConfigError, match="need a pruning method"):
            build_recipe(cfg)
    assert build_recipe(RunConfig(method="wanda", sparsity=0.5)).stages[0].sparsity == 0.5
