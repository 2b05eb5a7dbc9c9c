"""devices.profiler on a tiny exported llama: measured figures, budget, projection, sweep, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tiny import export_tiny_llama

import edgeprune_devices as devices
from edgeprune_runtime.errors import DeviceError, GenerationError, RuntimeLoadError
from edgeprune_devices.profiler import gpu_availability, model_work, profile


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder, _, _ = export_tiny_llama(tmp_path_factory.mktemp("prof") / "tiny")
    return folder


def test_model_work_counts_weights_and_ops(tiny_folder):
    w = model_work(tiny_folder)
    # per layer q 64x64, k 64x32, v 64x32, o 64x64, gate/up 64x160, down 160x64; lm_head 64x320
    macs = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 160 * 3) + 64 * 320
    assert w["weight_ops_per_token"] == 2 * macs
    assert w["embedding_bytes"] == 320 * 64 * 4
    # Linears read in full (fp32), one embedding row, plus norms / rotary tables.
    assert 4 * macs + 64 * 4 <= w["weight_bytes_per_token"] < 4 * macs + 64 * 4 + 300_000
    assert w["attn_ops_per_position"] == 4 * 4 * 16 * 2 and w["compute"] == "fp32"


def test_profile_measures_and_projects(tiny_folder, tmp_path):
    r = profile(tiny_folder, "raspberry-pi-5", prompt_len=24, gen_len=16, repeat=2, sweep=[32, 64],
                out_dir=tmp_path)
    m = r.measured
    assert m["final_length"] == 40 and m["kv_tokens"] == 39
    # K and V: 2 layers x 2 kv heads x 16 dims x fp32 per cached token, each.
    assert m["kv_bytes"] == {"k": 39 * 2 * 2 * 16 * 4, "v": 39 * 2 * 2 * 16 * 4}
    assert m["weights_bytes"] == sum((tiny_folder / n).stat().st_size        # graph + its data
                                     for n in ("model.onnx", "model.onnx.data"))
    assert m["decode_tok_s"]["median"] == pytest.approx(1000.0 / m["decode_step_ms"]["median"])
    assert m["decode_step_ms"]["p90"] >= m["decode_step_ms"]["median"] > 0
    assert m["ttft_ms"]["median"] > 0 and m["prefill_tok_s"]["median"] > 0
    assert len(m["decode_tok_s"]["runs"]) == 2
    # Peak RSS of the runtime-only subprocess: above the weights, far below a torch process.
    assert m["weights_bytes"] < m["peak_rss_bytes"] < 400 * 2**20
    assert r.settings["threads"] == min(4, __import__("os").cpu_count())
    p = r.projected["raspberry-pi-5"]
    assert p["kind"].startswith("projected") and p["decode_tok_s"] > 0 and p["fits_budget"]
    # TTFT is the prefill (as measured: the first token comes from the prefill's logits)
    assert p["ttft_ms"] == pytest.approx(24 * 1000.0 / p["prefill_tok_s"])
    assert p["peak_memory_bytes"] == m["peak_rss_bytes"] and "host" in p["peak_memory_kind"]
    assert [s["context"] for s in r.sweep] == [32, 64]
    assert r.sweep[1]["kv_bytes"] == (64 + 16 - 1) * 2 * 2 * 2 * 16 * 4
    png = tmp_path / "sweep-tiny-raspberry-pi-5.png"
    assert r.plot_path == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = r.to_markdown()
    assert "projected: raspberry-pi-5" in md and "measured (this host" in md and "| 64 |" in md
    # a tiny cache reads as what it is (9,984 bytes = 0.0095 MiB), not "0.0"
    assert "KV cache K / V, 39 cached tokens (MiB) | 0.0095 / 0.0095 |" in md
    data = json.loads(r.to_json(tmp_path / "p.json"))
    assert data == json.loads((tmp_path / "p.json").read_text())
    assert data["measured"]["kv_bytes"]["k"] == 9984


def test_host_profile_projects_to_every_target_asked(tiny_folder):
    r = profile(tiny_folder, "cpu-host", prompt_len=8, gen_len=8, repeat=1, isolate=False)
    assert r.projected == {} and "projected" not in r.to_markdown().lower()   # only when asked
    names = {p.name for p in devices.list_profiles() if not p.is_host}
    r = profile(tiny_folder, "cpu-host", prompt_len=8, gen_len=8, repeat=1, isolate=False,
                targets=sorted(names))
    assert set(r.projected) == names
    assert r.host["bandwidth_gbs"] > 0
    # a GPU target: floored at graph nodes x kernel launch time (a tiny model's decode is
    # launch-bound, not 100,000s of tokens/s); its memory is weights + KV on the device
    h200, nodes = r.projected["nvidia-h200"], r.work["graph_nodes"]
    assert nodes > 10 and h200["bound"] == "launch"
    assert h200["decode_step_ms"] == pytest.approx(nodes * devices.load_profile("nvidia-h200").kernel_launch_us / 1000)
    kv = r.measured["kv_bytes"]
    assert h200["peak_memory_bytes"] == r.measured["weights_bytes"] + kv["k"] + kv["v"]
    # asking for the host as a target says why it has no projected column
    r = profile(tiny_folder, "cpu-host", prompt_len=8, gen_len=8, repeat=1, isolate=False,
                targets=["cpu-host", "raspberry-pi-5"])
    assert set(r.projected) == {"raspberry-pi-5"} and any("cpu-host is this machine" in n for n in r.notes)


def test_memory_budget_is_enforced(tiny_folder, tmp_path):
    src = (devices.PROFILE_DIR / "raspberry-pi-5.toml").read_text()
    tiny = tmp_path / "tiny-board.toml"
    tiny.write_text(src.replace('name = "raspberry-pi-5"', 'name = "tiny-board"')
                    .replace("memory_budget_mb = 6144", "memory_budget_mb = 20"))
    with pytest.raises(DeviceError, match=r"exceeded the memory budget of profile 'tiny-board' \(20.0 MiB\)") as e:
        profile(tiny_folder, str(tiny), prompt_len=8, gen_len=8, repeat=1)
    assert "int4" in e.value.hint
    # in this process (RSS includes pytest's own): the same error, and the caller lives on
    # (the watcher used to end the calling process with os._exit)
    with pytest.raises(DeviceError, match="exceeded the memory budget of profile 'tiny-board'"):
        profile(tiny_folder, str(tiny), prompt_len=8, gen_len=8, repeat=1, isolate=False)


def test_gpu_profile_without_gpu_says_why(tiny_folder):
    ok, reason = gpu_availability()
    if ok:
        pytest.skip("a GPU is present here")
    r = profile(tiny_folder, "jetson-orin-nano", prompt_len=8, gen_len=4, repeat=1)
    assert r.gpu == {"available": False, "reason": reason} and "not available here" in reason
    assert r.projected == {} or "jetson-orin-nano" in r.projected
    assert re.search(r"GPU: NOT available — (onnxruntime|nvidia-smi|no NVIDIA)", r.to_markdown())
    # --threads holds on the host CPU standing in for the GPU (it became all the cores)
    r = profile(tiny_folder, "nvidia-h200", prompt_len=8, gen_len=4, repeat=1, isolate=False, threads=1)
    assert r.settings["threads"] == 1 and r.ran_on.startswith("this host, 1 thread,")


def test_bad_inputs(tiny_folder, tmp_path):
    with pytest.raises(DeviceError, match="unknown device profile 'pixel-99'"):
        profile(tiny_folder, "pixel-99")
    with pytest.raises(RuntimeLoadError, match="no model.onnx"):
        profile(tmp_path, "cpu-host")
    with pytest.raises(GenerationError, match="max_length=512"):
        profile(tiny_folder, "cpu-host", prompt_len=500, gen_len=100)
    with pytest.raises(GenerationError, match="513 cached tokens exceed the export's max_length=512"):
        profile(tiny_folder, "cpu-host", prompt_len=500, gen_len=14)
    # the last new token is never cached: 500 + 13 fits a 512-token context exactly
    r = profile(tiny_folder, "cpu-host", prompt_len=500, gen_len=13, repeat=1, isolate=False)
    assert r.measured["final_length"] == 513 and r.measured["kv_tokens"] == 512
    with pytest.raises(GenerationError, match="repeat"):
        profile(tiny_folder, "cpu-host", repeat=0)


_PEAK_SCRIPT = r"""
import json, sys
import numpy as np
from edgeprune_devices.profiler import profile
from edgeprune_devices.profiler.measure import _reset_hwm, _vm_hwm
big = np.ones(600 * 2**20 // 8)          # 600 MiB, touched, then freed
big[::512] = 2.0
del big
hwm = _vm_hwm()
r = profile(sys.argv[1], "cpu-host", prompt_len=8, gen_len=4, repeat=1, isolate=False)
print(json.dumps({"hwm": hwm, "peak": r.measured["peak_rss_bytes"],
                  "loaded": r.measured["rss_loaded_bytes"], "reset": _reset_hwm()}))
"""


def test_in_process_peak_is_the_runs_own(tiny_folder):
    """An earlier, freed allocation of the caller does not count as the profile's peak (the
    high-water mark is reset first): the test session's real models once pushed a tiny
    export's in-process peak over the host budget. Run in a fresh interpreter, so the
    figures do not depend on what this test session has allocated and freed before."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tiny_folder)], check=True,
                         capture_output=True, text=True, timeout=300).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["peak"] >= r["loaded"] > 0
    if not r["reset"]:
        pytest.skip("this kernel does not let a process reset its RSS high-water mark")
    assert r["hwm"] >= 600 * 2**20 and r["peak"] < r["hwm"] - 400 * 2**20, r


def test_threads_override(tiny_folder):
    # the default isolated worker (in-process, the RSS would still count what the test
    # session holds now, several GB after the real-model tests: over this 6 GiB budget)
    r = profile(tiny_folder, "raspberry-pi-5", prompt_len=8, gen_len=4, repeat=1, threads=1)
    assert r.settings["threads"] == 1 and any("threads set to 1" in n for n in r.notes)
    # asking for more threads than cores: one note, not "set to" plus "the profile runs"
    many = (__import__("os").cpu_count() or 1) + 6
    r = profile(tiny_folder, "raspberry-pi-5", prompt_len=8, gen_len=4, repeat=1, threads=many)
    assert [n for n in r.notes if "thread" in n] == [
        f"--threads {many} asks for {many} threads; this host has {many - 6} cores, so {many - 6} were used."]
    assert "1 run, batch 1" in r.to_markdown()
    with pytest.raises(GenerationError, match="threads"):
        profile(tiny_folder, "raspberry-pi-5", threads=0)


def test_projections_are_a_table_of_their_own(tiny_folder):
    r = profile(tiny_folder, "raspberry-pi-5", prompt_len=8, gen_len=4, repeat=1)
    md = r.to_markdown()
    measured, _, projected = md.partition("#### Projected, not measured")
    assert projected and "| projected: raspberry-pi-5 |" in projected
    assert "projected" not in measured.split("\n\n", 2)[2].lower()       # the measured table
    assert "| bound (roofline) |" in projected and "| bound (roofline) |" not in measured


def test_default_sweep_is_bounded_and_plots_to_a_named_temporary_folder(tiny_folder, tmp_path, monkeypatch):
    from edgeprune_devices.profiler.run import PLOT_DIR_PREFIX

    monkeypatch.chdir(tmp_path)
    r = profile(tiny_folder, "cpu-host", prompt_len=8, gen_len=4, repeat=1, sweep=True)
    # the export's 512 tokens hold 128 and 256 (+16 decode tokens); no sweep to max_length
    assert [s["context"] for s in r.sweep] == [128, 256]
    assert not list(tmp_path.iterdir())                    # nothing in the current folder
    plot = __import__("pathlib").Path(r.plot_path)
    try:
        assert plot.parent.name.startswith(PLOT_DIR_PREFIX) and plot.is_file()
        assert any(str(plot.parent) in n for n in r.notes) and f"Plot: `{plot}`" in r.to_markdown()
    finally:
        __import__("shutil").rmtree(plot.parent)


def test_sweep_plot_log_axis_and_model_title(tiny_folder, tmp_path):
    import matplotlib.pyplot as plt

    r = profile(tiny_folder, "cpu-host", prompt_len=8, gen_len=4, repeat=1, sweep=[32, 64, 256],
                out_dir=tmp_path, isolate=False)
    r.model = "tiny-llama (fp32)"
    fig = r.figure()
    try:
        assert all(ax.get_xscale() == "log" for ax in fig.axes)
        assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["32", "64", "256"]
        assert fig._suptitle.get_text().startswith("tiny-llama (fp32): measured on this host")
    finally:
        plt.close(fig)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"sweep-{tiny_folder.name}-cpu-host.png"]


def test_model_name_from_the_export_record():
    from edgeprune_devices.profiler.report import model_name

    ckpt_export = {"precision": "int4", "provenance": {"source": "/x/ckpt", "compression": {
        "provenance": {"source": {"kind": "alias", "spec": "smollm2-135m", "path": "/p/a.gguf"}}}}}
    assert model_name(ckpt_export, "/out/onnx") == "smollm2-135m (int4)"
    assert model_name({"provenance": {"source": "/models/Qwen2.5-0.5B/"}}, "/o") == "Qwen2.5-0.5B"
    assert model_name({}, "/out/my-export") == "my-export"


def test_progress_counts_every_step(tiny_folder):
    from edgeprune_devices.profiler import measure

    cfg = {"folder": str(tiny_folder), "device": "cpu", "threads": 1, "prompt_len": 8, "gen_len": 4,
           "repeat": 2, "sweep": [32], "max_length": 64, "budget_bytes": 0, "profile_name": "cpu-host"}
    assert measure.step_labels(cfg) == ["load + warm-up", "run 1/2", "run 2/2", "context 32"]
    for isolate in (True, False):
        steps = []
        measure.run_worker(cfg, isolate, 300, lambda: steps.append(1))
        assert len(steps) == 4, isolate


def test_cli_profile_sweep_list_progress_and_outputs(tiny_folder, tmp_path, monkeypatch, capsys):
    from _cli import one_line_error, run_cli

    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["profile", tiny_folder, "--prompt-len", "8", "--gen-len", "4", "--repeat", "1",
                              "--sweep", "32,64", "--out", tmp_path / "o"], capsys)
    assert code == 0, err
    assert "profile: " in err                                   # the progress bar
    assert "| 32 |" in out and "| 64 |" in out and "Projected" not in out
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["profile.md", f"sweep-{tiny_folder.name}-cpu-host.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    for bad in ("32,x", "0"):
        code, _, err = run_cli(["profile", tiny_folder, "--sweep", bad], capsys)
        one_line_error(code, err, f"--sweep {bad!r} is not a list of context lengths", "--sweep 128,512,2048")


# ------------------------------------------------------------------ operator breakdown
def _trace():
    """A hand-made onnxruntime trace: a warm-up run, a prefill, two decode steps."""
    def run(ts, dur):
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}

    def node(ts, dur, op, name="n"):
        return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}

    return [run(0, 100), node(10, 50, "MatMul"),                                   # warm-up: ignored
            run(200, 400), node(210, 300, "MatMul"), node(520, 40, "Softmax"),     # prefill
            {"cat": "Node", "name": "fence_before", "ts": 215, "dur": 1},          # not a kernel: ignored
            run(700, 100), node(705, 60, "MatMul"), node(770, 20, "Softmax"),      # decode 1
            run(900, 140), node(905, 80, "MatMul"), node(990, 20, "Softmax"), node(1011, 10, "Add")]


def test_op_breakdown_sums_nodes_by_type_per_step(tmp_path):
    from edgeprune_devices.profiler.ops import op_breakdown
    from edgeprune_devices.profiler.report import format_ops

    p = tmp_path / "trace.json"
    p.write_text(json.dumps(_trace()))
    for trace in (p, _trace(), {"traceEvents": _trace()}):
        b = op_breakdown(trace, decode_steps=2)
        d = b["decode"]
        assert d["runs"] == 2 and d["run_us_mean"] == 120 and d["run_us_median"] == 120
        assert [(o["op"], o["us_per_run"], o["nodes_per_run"]) for o in d["ops"]] == \
            [("MatMul", 70, 1), ("Softmax", 20, 1), ("Add", 5, 0.5)]
        assert d["ops"][0]["share"] == pytest.approx(70 / 120)
        assert d["nodes_us_per_run"] == 95 and d["outside_nodes_us_per_run"] == 25
        pre = b["prefill"]
        assert pre["runs"] == 1 and [(o["op"], o["us_per_run"]) for o in pre["ops"]] == [("MatMul", 300), ("Softmax", 40)]
    md = format_ops(b, top=2)
    assert md[2] == "| MatMul | 70 | 58.3% | 1 |" and md[4] == "| 1 other types | 5 | 4.2% | 0 |"
    assert md[-1] == "| (outside nodes: session) | 25 | 20.8% |  |"
    # every run taken as a decode step: no prefill
    assert op_breakdown(_trace(), decode_steps=4)["prefill"] is None


def test_op_breakdown_bad_input(tmp_path):
    from edgeprune_devices.profiler.ops import op_breakdown

    for steps in (0, -1, 1.5, True):
        with pytest.raises(DeviceError, match="decode_steps must be an integer >= 1"):
            op_breakdown(_trace(), decode_steps=steps)
    with pytest.raises(DeviceError, match="holds 4 runs, fewer than the 5 decode steps"):
        op_breakdown(_trace(), decode_steps=5)
    with pytest.raises(DeviceError, match="cannot read the onnxruntime profile"):
        op_breakdown(tmp_path / "missing.json", decode_steps=1)
    (tmp_path / "bad.json").write_text('"x"')
    with pytest.raises(DeviceError, match="holds str, not a list of events"):
        op_breakdown(tmp_path / "bad.json", decode_steps=1)


def test_profile_ops_breaks_down_the_export_and_leaves_no_trace(tiny_folder, tmp_path, monkeypatch):
    import onnx

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    r = profile(tiny_folder, "cpu-host", prompt_len=12, gen_len=6, repeat=1, ops=True, isolate=False)
    ops = r.measured["ops"]
    d, pre = ops["decode"], ops["prefill"]
    assert d["runs"] == 5 and pre["runs"] == 1
    # the same graph runs at prefill and decode: the same operator types, node for node
    assert {o["op"]: o["nodes_per_run"] for o in d["ops"]} == {o["op"]: o["nodes_per_run"] for o in pre["ops"]}
    assert sum(o["us_per_run"] for o in d["ops"]) == pytest.approx(d["nodes_us_per_run"])
    assert d["nodes_us_per_run"] + d["outside_nodes_us_per_run"] == pytest.approx(d["run_us_mean"])
    # one GroupQueryAttention per layer of the fused graph (2 layers)
    kinds = {n.op_type for n in onnx.load(str(tiny_folder / "model.onnx"), load_external_data=False).graph.node}
    assert "GroupQueryAttention" in kinds
    assert {o["op"]: o["nodes_per_run"] for o in d["ops"]}["GroupQueryAttention"] == 2
    assert "Decode step by operator type" in r.to_markdown() and "| GroupQueryAttention |" in r.to_markdown()
    assert not list(tmp_path.glob("edgeprune-ops-*"))           # the trace folder is removed


def test_end_profiling_needs_a_profiling_session(tiny_folder):
    import edgeprune_runtime as runtime

    with runtime.load(tiny_folder, threads=1) as s:
        with pytest.raises(GenerationError, match="this session is not profiling"):
            s.end_profiling()
