"""The study grid on a tiny model: tables, the content-hash cache (a changed cell re-runs
alone), a failing cell recorded while the others run (Ray: tests/integration/test_study_ray.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from study_tiny import study_config, study_inputs_in, study_numbers


@pytest.fixture(scope="module")
def study_inputs(tmp_path_factory):
    pytest.importorskip("lm_eval")
    return study_inputs_in(tmp_path_factory.mktemp("study"))


def test_grid_runs_caches_and_reruns_one_changed_cell(study_inputs, tmp_path):
    from edgeprune.study import run_study

    cache = tmp_path / "cache"
    cfg = study_config(study_inputs, "rtn:4,wanda:0.5", cache)
    t1 = run_study(cfg, tmp_path / "out", progress=False, log=lambda m: None)
    assert [o.status for o in t1.outcomes] == ["computed"] * 3
    rows = {r["cell"]: r for r in t1.rows()}
    assert set(rows) == {"dense", "RTN-4 g32", "Wanda-50%"}          # auto group size: 32 divides 64 and 160
    assert rows["dense"]["kl"] == 0.0 and rows["dense"]["top1"] == 1.0
    w = rows["Wanda-50%"]
    assert w["kl"] > 0 and 0 <= w["top1"] <= 1 and math.isfinite(w["snr_db"]) and 0 <= w["cont_change"] <= 1
    assert 0 <= w["acc:piqa"] <= 1 and w["ppl:deu"] > 0 and w["change:deu"] is not None
    for name in ("results.csv", "results.md", "results.json"):
        assert (tmp_path / "out" / name).is_file()
    assert {p.name.split("-")[-1] for p in (tmp_path / "out/plots").iterdir()} == {
        "perplexity.png", "languages.png", "tasks.png", "disagreement.png"}
    assert "| Wanda-50% |" in (tmp_path / "out/results.md").read_text()
    # every unit stored with the wall time that computed it (summed over runs: bench/study.py)
    secs = [v["seconds"] for o in t1.outcomes for v in o.units.values()]
    assert len(secs) == 3 * len(t1.outcomes[0].units) and all(s >= 0 for s in secs) and sum(secs) > 0

    # the same grid again: nothing computed, the same numbers
    t2 = run_study(cfg, tmp_path / "out", progress=False, log=lambda m: None, plots=False)
    assert [o.status for o in t2.outcomes] == ["cached"] * 3 and t2.computed() == []
    assert study_numbers(t2) == study_numbers(t1)

    # one cell changed (wanda 0.5 -> 0.25): only that cell computes
    cfg3 = study_config(study_inputs, "rtn:4,wanda:0.25", cache)
    t3 = run_study(cfg3, tmp_path / "out", progress=False, log=lambda m: None, plots=False)
    assert [o.status for o in t3.outcomes] == ["cached", "cached", "computed"]
    assert [c for _, c, _ in t3.computed()] == ["Wanda-25%"]

    # a new task computes that task only, on every cell
    (Path(study_inputs["task_data"]) / "unused").mkdir(exist_ok=True)
    cfg4 = study_config(study_inputs, "rtn:4,wanda:0.25", cache, limit=5)
    t4 = run_study(cfg4, tmp_path / "out", progress=False, log=lambda m: None, plots=False)
    assert all(units == ["task:piqa"] for _, _, units in t4.computed()) and len(t4.computed()) == 3


def test_grid_bar_names_each_compressed_block(study_inputs, tmp_path, monkeypatch):
    """A compression is one step of the grid's bar; inside it the bar's text counts the
    blocks done (a 24-block Qwen compression takes 20-40 minutes at 1 thread)."""
    from edgeprune.study import run as run_mod

    seen = []
    monkeypatch.setattr(run_mod._Progress, "status", lambda self, label, text: seen.append((label, text)))
    cfg = study_config(study_inputs, "wanda:0.5", tmp_path / "cache")
    run_mod.run_study(cfg, tmp_path / "out", progress=True, log=lambda m: None, plots=False)
    assert seen == [("Wanda-50%", "compress 1/2"), ("Wanda-50%", "compress 2/2")]   # the 2-layer tiny llama


def test_failing_cell_is_recorded_while_the_others_run(study_inputs, tmp_path):
    from edgeprune.study import run_study

    logs = []
    cfg = study_config(study_inputs, "rtn:4,wanda:0.5", tmp_path / "cache", group_size=128, tasks=[], langs=None,
                  task_data=None, limit=None)
    from edgeprune.study import parse_cells

    cfg.cells = parse_cells("rtn:4,wanda:0.5", 128)
    cfg.models = cfg.models + [str(tmp_path / "no-such-model")]
    t = run_study(cfg, tmp_path / "out", progress=False, log=logs.append, plots=False)
    rows = t.rows()
    assert [r["status"].split(":")[0] for r in rows[3:]] == ["failed"] * 3     # a model that does not load
    assert "not found" in rows[3]["status"]
    status = {r["cell"]: r["status"] for r in rows[:3]}
    assert status["dense"] == "ok" and status["Wanda-50%"] == "ok"
    assert status["RTN-4 g128"].startswith("failed: ") and "group_size" in status["RTN-4 g128"]
    assert any("RTN-4 g128 failed" in m for m in logs)
    assert "failed: " in (tmp_path / "out/results.md").read_text()


def test_grid_parsing_and_bad_input():
    from edgeprune.errors import ConfigError
    from edgeprune.study import expand_grid, parse_cells

    cells = parse_cells("gptq:4,awq:4,gptq:8,sparsegpt:0.5,wanda:50%,sparsegpt:2:4")
    assert [c.label for c in cells] == ["dense", "GPTQ-4", "AWQ-4", "GPTQ-8", "SparseGPT-50%", "Wanda-50%",
                                        "SparseGPT-2:4"]
    grid = expand_grid(["gptq", "wanda"], ["4", "8"], ["0.5"], ["2:4"], group_size=64)
    assert [c.label for c in grid] == ["dense", "GPTQ-4 g64", "GPTQ-8 g64", "Wanda-50%", "Wanda-2:4"]
    for bad, words in (("nosuch:4", "nosuch"), ("gptq", "METHOD:SETTING"), ("wanda:1.5", "(0, 1)"),
                       ("wanda:3:2", "0 < N < M"), ("gptq:x", "bit width")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_cells(bad)
    with pytest.raises(ConfigError, match="--bits"):
        expand_grid(["gptq"], [], ["0.5"], [])


def test_auto_group_size():
    from edgeprune.study.grid import auto_group_size

    assert auto_group_size([576, 1536]) == 64          # SmolLM2-135M: 576 = 4.5 x 128
    assert auto_group_size([896, 4864]) == 128         # Qwen2.5-0.5B
    assert auto_group_size([64, 160]) == 32
    assert auto_group_size([100]) == -1


def test_bfloat16_scoring_keys_only_tasks_and_languages(study_inputs, tmp_path):
    """--dtype bfloat16 re-scores tasks and languages (their keys change, the float32 keys
    stay as they were), keeps the fidelity unit and the compressed models, and records the
    dtype in each unit's protocol."""
    from edgeprune.study import run_study
    from edgeprune.study.cell import StudyRunner
    from edgeprune.study.cache import Cache

    cache = tmp_path / "cache"
    cfg = study_config(study_inputs, "rtn:4", cache, limit=5)
    run_study(cfg, tmp_path / "out", progress=False, log=lambda m: None, plots=False)
    f32 = StudyRunner(cfg, Cache(cache)).plan()
    cfg16 = study_config(study_inputs, "rtn:4", cache, limit=5)
    cfg16.dtype = "bfloat16"
    b16 = StudyRunner(cfg16, Cache(cache)).plan()
    for a, b in zip(f32, b16):
        assert a.cell_key == b.cell_key and a.units["text"] == b.units["text"]
        changed = {u for u in a.units if a.units[u] != b.units[u]}
        assert changed == {u for u in a.units if u != "text"} and changed
    t = run_study(cfg16, tmp_path / "out16", progress=False, log=lambda m: None, plots=False)
    assert all(set(units) == {u for u in b16[0].units if u != "text"} for _, _, units in t.computed())
    o = t.outcomes[1]
    assert o.units["task:piqa"]["protocol"]["dtype"] == "bfloat16"
    assert all(v["protocol"]["dtype"] == "bfloat16" for u, v in o.units.items() if u.startswith("lang:"))


def test_scoring_model_casts_a_copy_and_refuses_bad_input():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgeprune.errors import ConfigError
    from edgeprune.evaluation.backends import RuntimeModel, scoring_model
    from edgeprune.study import StudyConfig
    from edgeprune.study.cell import check_config

    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
    assert scoring_model(m, "float32") is m
    b = scoring_model(m, "bfloat16")
    assert b is not m and next(b.parameters()).dtype == torch.bfloat16
    assert next(m.parameters()).dtype == torch.float32
    with pytest.raises(ConfigError, match="float16"):
        scoring_model(m, "float16")
    with pytest.raises(ConfigError, match="export"):
        scoring_model(RuntimeModel.__new__(RuntimeModel), "bfloat16")
    with pytest.raises(ConfigError, match="--dtype"):
        check_config(StudyConfig(dtype="int8"))
    with pytest.raises(ConfigError, match="--calib-dtype float16 is not one of float32, bfloat16"):
        check_config(StudyConfig(calib_dtype="float16"))


def test_ray_cell_memory_counts_parameters_not_file_bytes(tiny_gguf, tmp_path):
    """A GGUF cell declares four float32 copies of its parameters (read from the tensor
    infos) plus 1 GiB; a 16-bit folder's weights count twice their bytes; no model, 8 GiB."""
    from edgeprune.models.gguf_header import read_gguf_parameter_count
    from edgeprune.study.run import _memory_bytes

    path = tiny_gguf(layers=2)
    assert _memory_bytes(str(path)) == 4 * 4 * read_gguf_parameter_count(path) + (1 << 30)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    (folder / "tokenizer.json").write_bytes(b"\0" * 5000)      # not weights
    (folder / "config.json").write_text('{"torch_dtype": "float32"}')
    assert _memory_bytes(str(folder)) == 4 * 1000 + (1 << 30)
    (folder / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert _memory_bytes(str(folder)) == 4 * 2000 + (1 << 30)
    assert _memory_bytes(str(tmp_path / "missing")) == 8 << 30
