"""COUNTDOWN (issue 6): calibration, exact reference, ONNX sparse-decode graph, runtime flag."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from tiny import byte_tokenizer
from edgeprune import countdown as cd
from edgeprune.errors import ConfigError, UnsupportedArchitectureError
from edgeprune_runtime.errors import ExportError, RuntimeLoadError


def _calib(n=4, s=32, seed=1):
    return torch.randint(0, 255, (n, s), generator=torch.Generator().manual_seed(seed))


def _ids(n=24, seed=0):
    return np.random.RandomState(seed).randint(0, 255, (1, n)).astype(np.int64)


@pytest.fixture(scope="module")
def tiny():
    from tiny import tiny_model
    from transformers import LlamaConfig
    torch.set_num_threads(1)
    return tiny_model(LlamaConfig), byte_tokenizer()


@pytest.fixture(scope="module")
def specs(tiny):
    model, _ = tiny
    m = cd.calibrate_many(model, _calib(), [0.0, 0.5, 0.7], "m")
    d = cd.calibrate_many(model, _calib(), [0.0, 0.5, 0.7], "d")          # q4 predictor
    dl = cd.calibrate_many(model, _calib(), [0.0, 0.5, 0.7], "d", rank=8,
                           predictor="lowrank", train_epochs=2)
    return {"m": m, "d": d, "dl": dl}


def _export(tmp_path, tiny, spec, name, graph_mode=None, **kw):
    """Export with the COUNTDOWN variant (``graph_mode``: a variant option, else the spec's)."""
    from edgeprune_exporters import export_onnx
    model, tok = tiny
    kw.setdefault("max_length", 128)
    v = spec if graph_mode is None else (spec, {"graph_mode": graph_mode})
    return export_onnx(model, tok, tmp_path / name, variants=[v], **kw)


# --------------------------------------------------------------- calibration/reference
@pytest.mark.parametrize("mode", ["m", "d", "dl"])
def test_sparsity_zero_equals_dense(tiny, specs, mode):
    model, _ = tiny
    spec = specs[mode][0]
    assert spec.thresholds == [-1.0, -1.0]
    ids = torch.from_numpy(_ids())
    with torch.no_grad():
        dense = model(ids).logits
        cnt: list = []
        with cd.apply_reference(model, spec, cnt):
            filt = model(ids).logits
    assert torch.equal(dense, filt)
    assert all(k == n for k, n in cnt)
    # forward restored
    assert "forward" not in model.model.layers[0].mlp.__dict__


@pytest.mark.parametrize("mode", ["m", "d", "dl"])
def test_calibration_hits_target_and_filters(tiny, specs, mode):
    model, _ = tiny
    for spec in specs[mode][1:]:
        real = spec.stats["realised_sparsity_mean"]
        assert abs(real - spec.act_sparsity) < 0.08, (spec.act_sparsity, real)
        assert 0.0 < spec.stats["recall_top_mean"] <= 1.0
        ids = torch.from_numpy(_ids(seed=3))
        cnt: list = []
        with torch.no_grad(), cd.apply_reference(model, spec, cnt):
            out = model(ids).logits
        skipped = 1 - sum(k for k, _ in cnt) / sum(n for _, n in cnt)
        assert abs(skipped - spec.act_sparsity) < 0.15
        assert not torch.allclose(out, model(ids).logits)
    if mode == "d":          # q4: 4-bit codes + zeros (packed), fp32 scales, ||W_down col||
        st = specs["d"][1].stats
        assert specs["d"][1].predictor_kind == "q4" and specs["d"][1].rank is None
        assert st["predictor_bytes_per_layer"] == 2 * (160 * 64 // 2 + 160 // 2 + 160 * 4) + 160 * 4
    if mode == "dl":
        st = specs["dl"][1].stats
        assert st["predictor_bytes_per_layer"] == 2 * (64 * 8 + 8 * 160) * 4
        assert st["predictor_fraction_of_mlp"] == round(st["predictor_bytes_per_layer"] /
                                                        (3 * 64 * 160 * 4), 4)


def test_reference_matches_manual_mask(tiny, specs):
    """M keeps exactly |up(x) * f| > tau (f = E|act(gate)| * ||W_down col|| from the
    calibration data): compare with a hand-written masked MLP; without f, |up(x)| > tau."""
    model, _ = tiny
    spec = specs["m"][1]
    mlp = model.model.layers[1].mlp
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    tau = spec.thresholds[1]
    f = spec.predictors[1]["channel_scale"]
    with torch.no_grad():
        # f recomputed by hand on the calibration inputs of layer 1
        X = cd.collect_mlp_inputs(model, _calib())[1]
        want_f = torch.nn.functional.silu(X @ mlp.gate_proj.weight.T).abs().mean(0) * \
            mlp.down_proj.weight.norm(dim=0)
        torch.testing.assert_close(f, want_f, rtol=1e-4, atol=1e-7)
        u = x @ mlp.up_proj.weight.T
        c = torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * u
        for pred, score in ((spec.predictors[1], (u * f).abs()), (None, u.abs())):
            want = (c * (score > tau)) @ mlp.down_proj.weight.T
            got = cd.filtered_mlp(mlp, x, "m", tau, pred)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # the scale changes which coefficients are kept
        assert not torch.equal((u * f).abs() > tau, u.abs() > tau)


def test_paper_m_and_median_rule_still_available(tiny):
    """channel_scale='none' is the paper's |up(x)| (no stored tensor); the median rule
    puts the median token's k-th smallest score at tau."""
    model, _ = tiny
    plain = cd.calibrate(model, _calib(), 0.5, "m", channel_scale="none", threshold_rule="median")
    assert plain.predictors is None and "paper" in plain.stats["score"]
    assert plain.stats["threshold_rule"].startswith("median")
    X = cd.collect_mlp_inputs(model, _calib())[0]
    u = model.model.layers[0].mlp.up_proj(X).detach()
    assert plain.thresholds[0] == pytest.approx(cd.per_token_threshold(u, 0.5)[0])
    pooled = cd.calibrate(model, _calib(), 0.5, "m", channel_scale="none")
    # pooled rule: half of all calibration |up| values are at or below tau
    assert float((u.abs() <= pooled.thresholds[0]).float().mean()) == pytest.approx(0.5, abs=1e-3)


def test_trained_predictor_regresses_better_than_closed_form(tiny):
    """train_predictor lowers the down-column-weighted error of the predicted direct
    coefficient below the closed-form (reduced-rank regression) start."""
    model, _ = tiny
    mlp = model.model.layers[0].mlp
    X = cd.collect_mlp_inputs(model, _calib(8, 32))[0]
    Wg, Wu = mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()
    Vg, Ug = cd.lowrank_factors(Wg, X, 8)
    Vu, Uu = cd.lowrank_factors(Wu, X, 8)
    p0 = {"v_gate": Vg, "u_gate": Ug, "v_up": Vu, "u_up": Uu}
    w = mlp.down_proj.weight.detach().norm(dim=0)
    p1 = cd.train_predictor(mlp, X, p0, epochs=20, weight=w, lr=5e-3, batch=32)
    with torch.no_grad():
        c = mlp.act_fn(mlp.gate_proj(X)) * mlp.up_proj(X)
        err = [float(((cd.predictor_score(p, X) - c) * w).pow(2).mean()) for p in (p0, p1)]
    assert err[1] < 0.8 * err[0], err
    assert cd.train_predictor(mlp, X, p0, epochs=0) is p0
    for k in p0:
        assert p1[k].shape == p0[k].shape and not p1[k].requires_grad


def test_bad_refinement_options(tiny):
    model, _ = tiny
    with pytest.raises(ConfigError, match="channel_scale"):
        cd.calibrate(model, _calib(), 0.5, "m", channel_scale="gate")
    with pytest.raises(ConfigError, match="threshold_rule"):
        cd.calibrate(model, _calib(), 0.5, "m", threshold_rule="mean")
    with pytest.raises(ConfigError, match="train_epochs"):
        cd.calibrate(model, _calib(), 0.5, "d", rank=8, train_epochs=-1)


def test_spec_save_load_roundtrip(tmp_path, specs):
    q = specs["d"][2]                      # q4 predictor: uint8 codes keep their dtype
    q.save(tmp_path / "q.safetensors")
    qb = cd.CountdownSpec.load(tmp_path / "q.safetensors")
    assert qb.predictor_kind == "q4" and qb.predictors[0]["gate_codes"].dtype == torch.uint8
    for k, v in q.predictors[1].items():
        assert torch.equal(qb.predictors[1][k], v), k
    spec = specs["dl"][2]
    spec.save(tmp_path / "cd.safetensors")
    back = cd.CountdownSpec.load(tmp_path / "cd.safetensors")
    assert back.thresholds == pytest.approx(spec.thresholds)
    assert back.mode == "d" and back.rank == 8
    assert sorted(back.predictors[1]) == ["u_gate", "u_up", "v_gate", "v_up"]
    for k in ("v_gate", "u_gate", "v_up", "u_up"):
        assert torch.equal(back.predictors[1][k], spec.predictors[1][k])
    from safetensors import safe_open
    with safe_open(str(tmp_path / "cd.safetensors"), framework="numpy") as f:
        assert f.metadata()["edgeprune_variant"] == "countdown"
        assert json.loads(f.metadata()["spec"])["act_sparsity"] == 0.7
    m = specs["m"][1]                      # M: the channel scale travels with the spec
    m.save(tmp_path / "m.safetensors")
    mb = cd.CountdownSpec.load(tmp_path / "m.safetensors")
    assert list(mb.predictors[0]) == ["channel_scale"]
    assert torch.equal(mb.predictors[0]["channel_scale"], m.predictors[0]["channel_scale"])


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), "x", None])
def test_bad_act_sparsity(tiny, bad):
    model, _ = tiny
    with pytest.raises(ConfigError, match="act_sparsity"):
        cd.calibrate(model, _calib(), bad, "m")


def test_bad_mode_and_rank(tiny):
    model, _ = tiny
    with pytest.raises(ConfigError, match="mode"):
        cd.calibrate(model, _calib(), 0.5, "q")
    with pytest.raises(ConfigError, match="rank"):
        cd.calibrate(model, _calib(), 0.5, "d", rank=0)


def test_non_gated_mlp_is_rejected():
    from transformers import GPT2Config, GPT2LMHeadModel
    m = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).eval()
    with pytest.raises(UnsupportedArchitectureError, match="model.layers"):
        cd.calibrate(m, _calib(1, 8), 0.5, "m")

    class Plain(torch.nn.Module):          # llama-like container, non-gated MLP
        def __init__(self):
            super().__init__()
            layer = torch.nn.Module()
            layer.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                            torch.nn.Linear(16, 8))
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([layer])

    with pytest.raises(UnsupportedArchitectureError, match="not gated"):
        cd.gated_mlps(Plain())


def test_spec_layer_mismatch(tiny, specs):
    model, _ = tiny
    spec = cd.CountdownSpec("m", 0.5, [0.1])
    with pytest.raises(ConfigError, match="layers"):
        with cd.apply_reference(model, spec):
            pass


# ------------------------------------------------------------------------------ ONNX
@pytest.mark.parametrize("mode", ["m", "d", "dl"])
def test_onnx_sparse_graph_equals_reference(tmp_path, tiny, specs, mode):
    """Always-sparse graph == PyTorch reference at every position (fp32)."""
    import edgeprune_runtime as runtime
    model, tok = tiny
    spec = specs[mode][2]
    res = _export(tmp_path, tiny, spec, "sp", graph_mode="sparse")
    meta = res.metadata["variants"]["countdown"]
    assert meta["graph_mode"] == "sparse" and meta["mode"] == spec.mode
    assert meta["channel_scale"] is (mode == "m")
    ids = _ids(30, seed=5)
    lo = runtime.load(res.folder, threads=1).logits(ids)
    with torch.no_grad(), cd.apply_reference(model, spec):
        ref = model(torch.from_numpy(ids)).logits.numpy()
    dense = model(torch.from_numpy(ids)).logits.detach().numpy()
    assert np.abs(lo - ref).max() < 1e-4
    assert np.abs(lo - dense).max() > 1e-2          # the filter really acts


@pytest.mark.parametrize("mode", ["m", "d", "dl"])
def test_onnx_selects_same_coefficients(tmp_path, tiny, specs, mode):
    """The row indices the graph gathers == the reference's kept coefficients."""
    model, tok = tiny
    spec = specs[mode][1]
    res = _export(tmp_path, tiny, spec, "plain", graph_mode="sparse", graph="plain",
                  validate=False)
    m = onnx.load(str(res.folder / "model.onnx"))
    nz = {n.output[0]: n.name for n in m.graph.node if n.op_type == "NonZero"}
    idx_names = {}
    for n in m.graph.node:
        if n.op_type == "Reshape" and n.input[0] in nz:
            layer = int(nz[n.input[0]].split(".")[1].split("/")[0])
            idx_names[layer] = n.output[0]
            m.graph.output.append(onnx.helper.make_tensor_value_info(n.output[0],
                                                                     onnx.TensorProto.INT64, None))
    assert sorted(idx_names) == [0, 1]
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for seed, S in ((0, 1), (1, 1), (2, 5)):
        ids = _ids(S, seed=seed)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids),
                "position_ids": np.arange(S)[None], "num_logits_to_keep": np.array(1)}
        for i in range(2):
            for kv in ("key", "value"):
                feed[f"past_key_values.{i}.{kv}"] = np.zeros((1, 2, 0, 16), np.float32)
        outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
        # reference masks from the MLP inputs of the filtered model
        xs = {}
        hooks = [model.model.layers[i].mlp.register_forward_pre_hook(
            lambda mod, a, _i=i: xs.__setitem__(_i, a[0].detach())) for i in range(2)]
        with torch.no_grad(), cd.apply_reference(model, spec):
            model(torch.from_numpy(ids))
        for h in hooks:
            h.remove()
        for i in range(2):
            pred = spec.predictors[i] if spec.predictors else None
            keep = cd.keep_mask(model.model.layers[i].mlp, xs[i][0], spec.mode,
                                spec.thresholds[i], pred)
            want = torch.nonzero(keep.any(0)).flatten().numpy()
            got = outs[idx_names[i]]
            assert outs["countdown_kept"][i] == len(got)
            if spec.predictor_kind == "q4":
                # DequantizeLinear+MatMul sums in another order than torch: only a score
                # within float rounding of tau may flip
                mlp = model.model.layers[i].mlp
                with torch.no_grad():
                    sc = cd.predictor_score(pred, xs[i][0], mlp.act_fn).abs()
                tau = spec.thresholds[i]
                diff = np.setxor1d(got, want)
                near = (sc - tau).abs().min(0).values          # closest token per unit
                assert len(diff) <= 2 and all(float(near[j]) < 1e-5 * tau for j in diff), \
                    (diff, near[diff], tau)
            else:
                np.testing.assert_array_equal(got, want)


def test_if_graph_dense_prefill_sparse_decode_and_flag(tmp_path, tiny, specs):
    import edgeprune_runtime as runtime
    from edgeprune_runtime.countdown import CountdownSession
    model, tok = tiny
    spec = specs["dl"][2]
    res = _export(tmp_path, tiny, spec, "if")
    assert res.parity["max_abs_logit_diff"] < 1e-4          # prefill (S>1) is dense
    ids = _ids(12, seed=7)
    s = CountdownSession(res.folder, threads=1)
    s.eos_token_ids = []
    r = s.generate(list(ids[0]), max_new_tokens=6)
    rep = s.mlp_read_report()
    assert rep["decode_steps"] == 5
    assert 0.02 < rep["kept_fraction_mean"] < 0.6
    k = np.stack(s.kept_log).astype(float)                      # [steps, layers]
    pred = 2 * (64 * 8 + 8 * 160)
    want = (3 * k * 64 + pred).sum(1).mean() / (3 * 160 * 64 * 2)
    assert rep["mlp_bytes_fraction"] == pytest.approx(want)
    # greedy tokens == reference decoding with the filter at every decode position
    seq = list(ids[0])
    with torch.no_grad():
        lo = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(lo.argmax()))
        for _ in range(5):     # prompt positions dense (prefill), later ones filtered
            seq.append(int(_decode_reference(model, spec, seq, len(ids[0])).argmax()))
    assert r.token_ids[0] == seq[len(ids[0]):]
    # the decode branch is specialised to one token: no union / per-token mask nodes
    g = onnx.load(os.path.join(res.folder, "model.onnx"), load_external_data=False).graph
    ifs = [n for n in g.node if n.op_type == "If"]
    then = [a.g for a in ifs[0].attribute if a.name == "then_branch"][0]
    assert "NonZero" in {n.op_type for n in then.node}
    assert not {"ReduceMax", "Cast"} & {n.op_type for n in then.node}
    # flag off: dense decode from the same file == the plain export
    off = runtime.countdown.load(res.folder, threads=1, countdown=False)
    off.eos_token_ids = []
    r_off = off.generate(list(ids[0]), max_new_tokens=6)
    dense_seq = model.generate(torch.from_numpy(ids), max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert r_off.token_ids[0] == dense_seq
    # batched decode (batch * seq > 1) takes the dense branch: every layer reads all rows,
    # and the longer row decodes exactly like the dense model
    rb = s.generate([list(ids[0]), list(ids[0][:7])], max_new_tokens=3)
    assert len(s.kept_log) == 2 and all((k == 160).all() for k in s.kept_log)
    assert s.mlp_read_report()["mlp_bytes_fraction"] == 1.0
    assert rb.token_ids[0] == dense_seq[:3]
    assert off.mlp_read_report()["mlp_bytes_fraction"] == 1.0
    with pytest.raises(RuntimeLoadError, match="COUNTDOWN"):
        from edgeprune_exporters import export_onnx
        export_onnx(model, tok, tmp_path / "plain_dense", max_length=128, validate=False)
        CountdownSession(tmp_path / "plain_dense")


def _decode_reference(model, spec, seq, n_prompt):
    """Logits of the last token when prompt positions are dense and later ones filtered."""
    n = len(seq)
    ids = torch.tensor([seq])
    mlps = cd.gated_mlps(model)
    saved = []
    for i, mlp in enumerate(mlps):
        pred = spec.predictors[i] if spec.predictors else None

        def fwd(x, _m=mlp, _t=spec.thresholds[i], _p=pred):
            y = _m.down_proj(_m.act_fn(_m.gate_proj(x)) * _m.up_proj(x))
            yf = cd.filtered_mlp(_m, x, spec.mode, _t, _p)
            y = y.clone()
            y[:, n_prompt:] = yf[:, n_prompt:]
            return y
        mlp.forward = fwd
        saved.append(mlp)
    try:
        return model(ids).logits[0, n - 1]
    finally:
        for mlp in saved:
            mlp.__dict__.pop("forward", None)


def test_int4_export_runs_and_records_granularity(tmp_path, tiny, specs):
    import edgeprune_runtime as runtime
    model, tok = tiny
    spec = specs["m"][1]
    res = _export(tmp_path, tiny, spec, "q4", precision="int4", group_size=16)
    meta = json.loads((res.folder / "edgeprune.json").read_text())["variants"]["countdown"]
    assert meta["int4"]["rows"].startswith("GatherBlockQuantized")
    assert "g16" in meta["int4"]["down_t"]
    s = runtime.load(res.folder, threads=1)
    r = s.generate(list(_ids(8)[0]), max_new_tokens=4)
    assert len(r.token_ids[0]) == 4
    ops = {n.op_type for n in onnx.load(str(res.folder / "model.onnx")).graph.node}
    assert "If" in ops
    # the read report prices int4 rows by the export's own block (it assumed 32): a row
    # of H = 64 codes in blocks of 16 is 32 B of codes + 4 scales (4 B) + 4 half-byte zeros
    assert meta["int4"]["block_size"] == 16
    c = runtime.countdown.load(res.folder, threads=1)
    c.eos_token_ids = []
    c.generate(list(_ids(8)[0]), max_new_tokens=4)
    rep = c.mlp_read_report()
    assert rep["mlp_bytes_dense_per_token"] == 3 * 160 * (32 + 4 * 4.5) * 2


def test_profiler_counts_the_weights_inside_if_branches(tmp_path, tiny, specs):
    """A COUNTDOWN graph's MLP lives in If branches: the profiler's bytes per token
    include it (an upper bound: the dense branch), and its node count takes the longer
    (filtered decode) branch; they were left out (half the bytes on this model)."""
    from edgeprune_exporters import export_onnx
    from edgeprune_devices.profiler import model_work
    model, tok = tiny
    dense = model_work(export_onnx(model, tok, tmp_path / "dense", max_length=128, validate=False).folder)
    res = _export(tmp_path, tiny, specs["d"][1], "if")
    work = model_work(res.folder)
    assert dense["weight_bytes_per_token"] <= work["weight_bytes_per_token"] <= \
        dense["weight_bytes_per_token"] + 64
    assert work["weight_ops_per_token"] == dense["weight_ops_per_token"]
    g = onnx.load(str(res.folder / "model.onnx"), load_external_data=False).graph
    then = sum(len(a.g.node) for n in g.node if n.op_type == "If" for a in n.attribute
               if a.name == "then_branch")
    assert work["graph_nodes"] == len(g.node) + then > dense["graph_nodes"]


def test_countdown_off_on_a_never_filtering_export(tmp_path, tiny, specs):
    """act_sparsity 0 exports a dense graph with no switch: countdown=False loads it (it
    raised, with a fix that re-exported the same folder)."""
    import edgeprune_runtime as runtime
    model, tok = tiny
    res = _export(tmp_path, tiny, specs["m"][0], "s0")
    assert json.loads((res.folder / "edgeprune.json").read_text())["variants"]["countdown"]["graph_mode"] == "dense"
    ids = list(_ids(8)[0])
    with runtime.countdown.load(res.folder, threads=1, countdown=False) as off, \
            runtime.load(res.folder, threads=1) as on:
        off.eos_token_ids = on.eos_token_ids = []
        assert off.generate(ids, max_new_tokens=4).token_ids == on.generate(ids, max_new_tokens=4).token_ids


def test_export_bad_inputs(tmp_path, tiny, specs):
    with pytest.raises(ExportError, match="graph_mode"):
        _export(tmp_path, tiny, specs["m"][1], "a", graph_mode="both")
    with pytest.raises(ExportError, match="layers"):
        _export(tmp_path, tiny, cd.CountdownSpec("m", 0.5, [0.1]), "b")
    with pytest.raises(ConfigError, match="graph_mode"):
        cd.CountdownSpec.calibrate(tiny[0], _calib(), act_sparsity=0.5, graph_mode="both")


def test_greedy_allocation_keeps_mean(tiny):
    """Greedy per-layer sparsities: mean == target, every layer on the 0.05 grid."""
    model, _ = tiny
    uni, gre = (cd.calibrate(model, _calib(), 0.6, "m", allocation=a) for a in ("uniform", "greedy"))
    per = gre.stats["layer_act_sparsity"]
    assert sum(per) / len(per) == pytest.approx(0.6)
    assert all(round(p / 0.05, 6).is_integer() for p in per)
    assert gre.stats["allocation"] == "greedy" and uni.stats["layer_act_sparsity"] == [0.6, 0.6]
    with pytest.raises(ConfigError, match="allocation"):
        cd.calibrate(model, _calib(), 0.5, "m", allocation="owl")


def test_reference_reports_recall_of_large_coefficients(tiny, specs):
    """recall = kept share of each token's true top-(1-s) |c|, checked by hand on layer 0."""
    model, _ = tiny
    spec = specs["d"][2]
    ids = torch.from_numpy(_ids(16, seed=4))
    xs = {}
    h = model.model.layers[0].mlp.register_forward_pre_hook(
        lambda mod, a: xs.__setitem__(0, a[0].detach()))
    rec: list = []
    try:
        with torch.no_grad(), cd.apply_reference(model, spec, recall=rec):
            model(ids)
    finally:
        h.remove()
    mlp, x = model.model.layers[0].mlp, xs[0][0]
    with torch.no_grad():
        c = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        keep = cd.keep_mask(mlp, x, "d", spec.thresholds[0], spec.predictors[0])
    nk = 160 - round(0.7 * 160)
    top = c.abs().topk(nk, dim=-1).indices
    assert rec[0] == [int(keep.gather(-1, top).sum()), 16 * nk]
    assert 0 < rec[0][0] < rec[0][1]
