"""Task scoring on the real SmolLM2-135M (local task data): our lm-eval LM against lm-eval's
own HF model, the ONNX export against the PyTorch model, and the int4 export against its
PyTorch fake-quant model. The must-show figures use --limit 500 (docs/study.md); this
test scores the first 20 documents of each task."""

from __future__ import annotations

import copy
import os

import pytest

pytestmark = pytest.mark.integration

TASKS = ["piqa", "arc_easy", "hellaswag"]
LIMIT = 20


@pytest.fixture(scope="module")
def task_manager():
    pytest.importorskip("lm_eval")
    from conftest import SHARED
    from lm_eval.tasks import TaskManager

    from edgeprune.evaluation.task_data import prepare_task_dir

    data = SHARED / "data" / "tasks"
    if not data.is_dir():
        pytest.skip(f"task data not found at {data}")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    return TaskManager(include_path=str(prepare_task_dir(data, TASKS)), include_defaults=False)


def _score(lm, tm) -> dict:
    from lm_eval.evaluator import simple_evaluate

    r = simple_evaluate(model=lm, tasks=TASKS, task_manager=tm, limit=LIMIT, log_samples=True,
                        verbosity="ERROR", bootstrap_iters=0)
    return dict(acc={t: r["results"][t]["acc,none"] for t in TASKS},
                ll=[x[0][0] for t in TASKS for s in r["samples"][t] for x in s["resps"]])


def _close(a: dict, b: dict, points: float, ll: float) -> None:
    for t in TASKS:
        assert abs(a["acc"][t] - b["acc"][t]) * 100 <= points, (t, a["acc"][t], b["acc"][t])
    assert max(abs(x - y) for x, y in zip(a["ll"], b["ll"])) <= ll


def test_ours_equals_lm_eval_hf_and_onnx_equals_torch(smollm2, task_manager, tmp_path):
    from lm_eval.models.huggingface import HFLM

    import edgeprune_exporters as exporters
    from edgeprune.evaluation.backends import load_evaluated
    from edgeprune.evaluation.lm import EdgepruneLM

    model, tok = smollm2
    ours = _score(EdgepruneLM(model, tok, progress=False), task_manager)
    _close(ours, _score(HFLM(pretrained=model, tokenizer=tok, batch_size=8), task_manager), 0.0, 1e-3)
    exporters.export_onnx(model, tok, tmp_path / "fp32", precision="fp32")
    m, t2 = load_evaluated(tmp_path / "fp32", threads=2)
    _close(_score(EdgepruneLM(m, t2, progress=False), task_manager), ours, 0.0, 2e-3)


def test_int4_export_scores_like_its_fake_quant_model(smollm2, task_manager, tmp_path):
    import edgeprune_exporters as exporters
    from edgeprune.calibration import build_calibration
    from edgeprune.engine import compress
    from edgeprune.evaluation.backends import load_evaluated
    from edgeprune.evaluation.lm import EdgepruneLM
    from edgeprune.recipe import method_config_from_name

    model, tok = smollm2
    q = copy.deepcopy(model)
    cal = build_calibration(tok, None, nsamples=16, seqlen=256)
    res = compress(q, method_config_from_name("gptq", bits=4, group_size=64), cal.input_ids, progress=False)
    torch_q = _score(EdgepruneLM(q, tok, progress=False), task_manager)
    # fp32 compute and an fp lm_head: the graph computes what the fake-quant model computes
    exporters.export_onnx(q, tok, tmp_path / "int4", precision="int4", quantized=res.quantized,
                          lm_head="fp", accuracy_level=0)
    m, t2 = load_evaluated(tmp_path / "int4", threads=2)
    _close(_score(EdgepruneLM(m, t2, progress=False), task_manager), torch_q, 5.0, 0.05)
