"""IG-Pruning (issue 26): spec, PyTorch reference, ONNX graph, runtime routing, CLI, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime
from _cli import one_line_error, run_cli
from edgeprune.errors import ConfigError, EdgePruneError
from edgeprune.igprune import (IgPruneSpec, angular_mask, block_influence, calibrate_all,
                               check_skip_ratio, masked)
from edgeprune.variants import load_spec, save_spec
from edgeprune_exporters.igprune import model_fingerprint
from edgeprune_runtime.errors import ExportError, GenerationError
from edgeprune_runtime.igprune import IgPruneSession
from tiny import byte_tokenizer, rand_ids, tiny_model

L = 4


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig
    return tiny_model(LlamaConfig, num_hidden_layers=L)


@pytest.fixture(scope="module")
def calib():
    """Two kinds of windows (low and high byte ids), so the clustering has two groups."""
    lo = np.concatenate([rand_ids(40, vocab=8, seed=s) for s in range(6)])
    hi = np.concatenate([rand_ids(40, vocab=8, seed=s) + 200 for s in range(6, 12)])
    return torch.from_numpy(np.concatenate([lo, hi]))


@pytest.fixture(scope="module")
def specs(model, calib):
    return calibrate_all(model, calib, 0.25, ks=(2,), steps=4, route_tokens=16)


@pytest.fixture(scope="module")
def export(model, specs, tmp_path_factory):
    out = tmp_path_factory.mktemp("ig") / "onnx"
    return exporters.export_onnx(model, byte_tokenizer(), out, variants=[specs["ig"]],
                                 max_length=128).folder


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


def test_calibration_gives_the_three_methods_at_the_skip_ratio(specs):
    assert set(specs) == {"ig", "l0", "angular"}
    for s in specs.values():
        assert s.num_sub_blocks == 2 * L and s.stats["n_skip"] == 2
        assert all(sum(m) == 2 * L - 2 for m in s.masks)
    ig = specs["ig"]
    assert ig.settings["k"] == len(ig.masks) == 2 and ig.settings["k_sweep"][0]["k"] == 2
    assert sorted(ig.stats["cluster_sizes"]) == [6, 6]      # the two kinds of windows


def test_refined_clusters_keep_their_lowest_kl_candidate(model, calib, specs):
    from edgeprune.igprune.train import mask_kl
    ig, l0, ang = specs["ig"], specs["l0"], specs["angular"]
    assert ig.settings["refine"] is True
    for mask, run in zip(ig.masks, ig.stats["train"]):
        kl, chosen = run["candidates"]["kl"], run["candidates"]["chosen"]
        assert set(kl) == {"cluster", "l0", "angular"} and kl[chosen] == min(kl.values())
        if chosen != "cluster":
            assert mask == {"l0": l0.masks[0], "angular": ang.masks[0]}[chosen]
    got = mask_kl(model, calib[:3], [[1] * (2 * L), ang.masks[0]], batch=2)
    assert got[0] == pytest.approx(0.0, abs=1e-6) and got[1] > 1e-4


def test_block_influence_and_the_angular_mask(model, calib):
    bi = block_influence(model, calib[:4])
    assert bi.shape == (2 * L,) and np.all(bi >= 0) and np.all(bi <= 2)
    m = angular_mask(bi, 3)
    assert sum(m) == 2 * L - 3 and all(bi[j] <= min(bi[k] for k in range(2 * L) if m[k])
                                       for j in range(2 * L) if not m[j])


def test_all_ones_mask_is_exactly_the_dense_model(model, specs):
    ids = rand_ids(24, seed=5)
    dense = _logits(model, ids)
    with specs["ig"].reference(model, mask=[1] * (2 * L)):
        assert np.array_equal(_logits(model, ids), dense)
    with masked(model, torch.ones(2, 2 * L)):           # per-row masks of ones, too
        assert np.array_equal(_logits(model, np.repeat(ids, 2, 0))[0], dense[0])


def test_a_skipped_sub_block_passes_the_residual_through(model):
    """Bypassing every sub-block of the last layer equals the model cut one layer short."""
    import copy
    ids = rand_ids(16, seed=6)
    m = [1] * (2 * L - 2) + [0, 0]
    with masked(model, torch.tensor(m)):
        got = _logits(model, ids)
    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:L - 1]
    short.config.num_hidden_layers = L - 1
    assert np.abs(got - _logits(short, ids)).max() < 1e-5


def test_the_runtime_matches_the_reference_for_every_mask(model, specs, export):
    spec = specs["ig"]
    ids = rand_ids(20, seed=7)
    with runtime.load(export) as s:
        assert type(s) is IgPruneSession
        for k in range(len(spec.masks)):
            with s.using_mask(k):
                got = s.logits(ids)
            with spec.reference(model, mask=k):
                assert np.abs(got - _logits(model, ids)).max() < 1e-4
        with s.using_mask([1] * (2 * L)):
            assert np.abs(s.logits(ids) - _logits(model, ids)).max() < 1e-4
        got = s.logits(ids)                              # routed, as the reference routes
        with spec.reference(model):
            assert np.abs(got - _logits(model, ids)).max() < 1e-4
        assert s.last_route["cluster"] == int(spec.route(model, torch.from_numpy(ids))[0])


def test_routing_is_deterministic_and_agrees_with_the_reference(model, specs, export, calib):
    spec = specs["ig"]
    prompts = calib[:, :16].numpy()
    ref = spec.route(model, calib)
    assert np.array_equal(ref, spec.route(model, calib))
    assert sorted(set(ref.tolist())) == [0, 1]
    with runtime.load(export) as s:
        got = [s.route(p) for p in prompts]
        assert got == [s.route(p) for p in prompts] == ref.tolist()


def test_generation_routes_once_and_skipped_attention_holds_no_kv(model, specs, export, calib):
    spec = specs["ig"]
    with runtime.load(export) as s:
        prompt = calib[0, :12].tolist()
        r = s.generate(prompt, max_new_tokens=6)
        k = s.last_route["cluster"]
        assert s.last_route["routed"] and s.last_route["router_ms"] > 0
        assert s.current_mask.tolist() == [bool(v) for v in spec.masks[k]]
        with spec.reference(model, mask=k):             # greedy decode with the same mask
            ids = torch.tensor([prompt])
            for _ in range(len(r.token_ids[0])):
                nxt = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], 1)
        assert ids[0, len(prompt):].tolist() == r.token_ids[0]
        # a mask bypassing layer 1's attention: its cache stays empty through a pass
        mask = [1] * (2 * L)
        mask[2] = 0
        from edgeprune_runtime.kv_cache import ConcatKVCache
        with s.using_mask(mask):
            s._route_rows([prompt])
            cache = ConcatKVCache(s.kv, 1)
            ids = np.array([prompt])
            s._run_plain(ids, np.ones_like(ids), np.arange(12)[None], 1, cache)
        lens = [v[0].shape()[2] for v in cache.values]
        assert lens == [12, 0, 12, 12]
        full = s.kv_cache_bytes(100, mask=[1] * (2 * L))
        assert s.kv_cache_bytes(100, mask=mask)["k"] == full["k"] * 3 // 4


def test_saved_spec_reloads_to_the_same_routing(model, specs, calib, tmp_path):
    spec = specs["ig"]
    path = save_spec(spec, tmp_path / "ig.safetensors")
    back = load_spec(path, kind=IgPruneSpec)
    assert back.masks == spec.masks and back.fingerprint == spec.fingerprint
    assert np.array_equal(back.centroids, spec.centroids)
    assert np.array_equal(back.route(model, calib), spec.route(model, calib))
    with pytest.raises(ConfigError, match="arrays"):
        save_spec(spec, tmp_path / "ig.json")


def test_int4_export_runs_the_masks(model, specs, tmp_path):
    spec = specs["ig"]
    ig = exporters.export_onnx(model, byte_tokenizer(), tmp_path / "ig4", variants=[spec],
                               precision="int4", group_size=32, max_length=128).folder
    dense = exporters.export_onnx(model, byte_tokenizer(), tmp_path / "d4", precision="int4",
                                  group_size=32, max_length=128).folder     # fused: MatMulNBits too
    meta = json.loads((ig / "edgeprune.json").read_text())
    assert meta["precision"] == "int4" and meta["graph"] == "plain"
    assert meta["variants"]["igprune"]["masks"] == spec.masks
    ids = rand_ids(16, seed=8)
    with runtime.load(dense) as d:
        want = d.logits(ids)
    with runtime.load(ig) as s:
        with s.using_mask([1] * (2 * L)):
            assert np.abs(s.logits(ids) - want).max() < 1e-3
        with s.using_mask(0):
            assert np.abs(s.logits(ids) - want).max() > 1e-3


@pytest.mark.parametrize("ratio", [0, 1, -0.1, 1.5, "x"])
def test_a_skip_ratio_outside_0_1_is_one_clear_error(model, calib, ratio):
    with pytest.raises(ConfigError, match="skip_ratio") as e:
        calibrate_all(model, calib, ratio, methods=("angular",))
    assert isinstance(e.value, EdgePruneError) and e.value.hint
    with pytest.raises(ConfigError):
        check_skip_ratio(ratio)


def test_a_spec_of_another_model_is_refused(specs, tmp_path):
    from transformers import LlamaConfig
    other = tiny_model(LlamaConfig, num_hidden_layers=L)
    with torch.no_grad():
        other.model.norm.weight.mul_(1.5)
    assert model_fingerprint(other) != specs["ig"].fingerprint
    with pytest.raises(ConfigError, match="another model") as e:
        with specs["ig"].reference(other):
            pass
    assert "edgeprune igprune" in e.value.hint
    with pytest.raises(ExportError, match="another model"):
        exporters.export_onnx(other, byte_tokenizer(), tmp_path / "x", variants=[specs["ig"]])


def test_a_mask_that_skips_every_block_is_refused(model, specs, tmp_path, export):
    d = specs["ig"].to_dict()
    d["masks"] = [[0] * (2 * L), d["masks"][1]]
    with pytest.raises(ConfigError, match="skips every sub-block") as e:
        IgPruneSpec.from_dict(d, specs["ig"].arrays())
    assert "keep at least one" in e.value.hint
    bad = {**d, "arrays": specs["ig"].arrays()}
    with pytest.raises(ExportError, match="skips every sub-block"):
        exporters.export_onnx(model, byte_tokenizer(), tmp_path / "x", variants=[("igprune", bad)])
    with runtime.load(export) as s, pytest.raises(GenerationError):
        with s.using_mask([0] * (2 * L)):
            pass


def test_cli_calibrates_and_exports(model, tmp_path, capsys):
    src = tmp_path / "tiny"
    model.save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i} other{i * 7}" for i in range(400)))
    spec = tmp_path / "ig.safetensors"
    code, out, err = run_cli(["igprune", src, "--skip-ratio", "0.25", "--ks", "2", "--steps", "2",
                              "--calib", text, "--nsamples", "8", "--seqlen", "32", "--out", spec], capsys)
    assert code == 0, err
    assert load_spec(spec).name == "igprune"
    code, out, err = run_cli(["export", src, tmp_path / "onnx", "--variant", spec], capsys)
    assert code == 0, err
    # the routed masks skip sub-blocks: the logits against the unpruned model are labelled, not "parity"
    said = " ".join((out + err).split())
    assert "not a parity check: the graph bypasses the sub-blocks" in said and "parity on" not in said
    meta = json.loads((tmp_path / "onnx" / "edgeprune.json").read_text())
    assert "igprune" in meta["variants"] and meta["graph"] == "plain"
    code, _, err = run_cli(["igprune", src, "--skip-ratio", "1.2", "--out", tmp_path / "b.safetensors"],
                           capsys)
    one_line_error(code, err, "skip_ratio")


def test_reference_keeps_the_routed_mask_on_cached_continuations(model, specs, calib):
    """A continuation on a KV cache (lm-eval scoring, decode steps) keeps the mask its
    context was routed to, so the split pass equals the whole window's pass."""
    import inspect
    spec = specs["ig"]
    ctx, cont = calib[0:1, :16], calib[7:8, :8]              # a low-id context, a high-id continuation
    assert spec.route(model, ctx)[0] != spec.route(model, cont)[0]
    ids = torch.cat([ctx, cont], 1)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad(), spec.reference(model):
        whole = model(ids).logits
        out = model(ctx, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        rest = model(cont, use_cache=True, **{kw: cache}).logits
    assert torch.allclose(whole[:, 16:], rest, atol=1e-5)


def test_window_metrics_routes_each_window(model, specs, calib):
    from edgeprune.igprune.evaluation import window_metrics
    dense = window_metrics(model, None, calib[:4], keep_logp=True)
    got = window_metrics(model, specs["ig"], calib[:4], dense["logp"])
    assert dense["kl_nats"] == 0.0 and got["kl_nats"] > 0 and got["ppl"] > 0
    assert got["routes"] == specs["ig"].route(model, calib[:4]).tolist()
    again = window_metrics(model, specs["ig"], calib[:4])           # dense recomputed
    assert abs(again["kl_nats"] - got["kl_nats"]) < 1e-9 and again["logp"] is None


def test_profile_reports_each_mask(specs, export):
    """``edgeprune profile`` on an IG-Pruning export: one row per mask and one with every
    sub-block kept, each with its own KV bytes, the routed mask named, every step counted."""
    from edgeprune_devices.profiler import measure, profile
    spec = specs["ig"]
    steps = []
    cfg = {"folder": str(export), "device": "cpu", "threads": 1, "prompt_len": 8, "gen_len": 4, "repeat": 1,
           "sweep": [], "max_length": 64, "budget_bytes": 0, "profile_name": "cpu-host", "masks": len(spec.masks)}
    assert measure.step_labels(cfg)[2:] == [f"mask {k}" for k in range(len(spec.masks))] + ["all sub-blocks kept"]
    got = measure.run_worker(cfg, False, 300, lambda: steps.append(1))
    assert len(steps) == len(measure.step_labels(cfg))
    rows = got["masks"]
    assert [r["mask"] for r in rows] == list(range(len(spec.masks))) + ["all"]
    per_layer = got["kv_bytes"]["k"] + got["kv_bytes"]["v"]          # the routed run's cache
    with runtime.load(export) as s:
        full = s.kv_cache_bytes(11, mask=[1] * (2 * L))
        for r, m in zip(rows, list(spec.masks) + [[1] * (2 * L)]):
            m = np.asarray(m, bool)
            assert (r["kept_attention"], r["kept_mlp"]) == (int(m[0::2].sum()), int(m[1::2].sum()))
            kv = s.kv_cache_bytes(11, mask=m)
            assert r["kv_bytes"] == kv["k"] + kv["v"] and r["decode_tok_s"] > 0
    assert rows[-1]["kv_bytes"] == full["k"] + full["v"] >= max(r["kv_bytes"] for r in rows[:-1])
    assert got["route"]["cluster"] in range(len(spec.masks))
    assert per_layer == rows[got["route"]["cluster"]]["kv_bytes"]
    md = profile(export, prompt_len=8, gen_len=4, repeat=1, isolate=False).to_markdown()
    assert "Per mask (IG-Pruning export" in md and md.count("\n| all | ") == 1
