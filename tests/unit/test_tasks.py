"""Task scoring: local task data for lm-eval, our lm-eval LM against lm-eval's own HF model,
the ONNX-backed LM against the PyTorch one, and the errors of bad task input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from edgeprune.errors import CalibrationError, ConfigError

pytest.importorskip("lm_eval")

SHARED = Path(os.environ.get("EDGEPRUNE_SHARED", Path(__file__).resolve().parents[3] / "shared"))
TASKS = SHARED / "data" / "tasks"


def _piqa(root: Path, n: int = 6) -> Path:
    (root / "piqa").mkdir(parents=True)
    words = ("run", "sleep", "cook", "read", "write", "swim", "walk", "sing")[:n]
    (root / "piqa/valid.jsonl").write_text("".join(
        json.dumps(dict(goal=f"How do I {w}?", sol1=f"You {w} with care.", sol2=f"You never {w}.")) + "\n"
        for w in words))
    (root / "piqa/valid-labels.lst").write_text("".join(f"{i % 2}\n" for i in range(n)))
    return root


def test_unknown_task_and_missing_files(tmp_path):
    from edgeprune.evaluation.tasks import check_tasks
    from edgeprune.evaluation.task_data import prepare_task_dir

    with pytest.raises(ConfigError, match=r"unknown task pika \(did you mean piqa\?\).*use tasks from: piqa"):
        check_tasks("pika,arc_easy", tmp_path)
    with pytest.raises(ConfigError, match="no task given"):
        check_tasks(" , ", tmp_path)
    with pytest.raises(CalibrationError, match=r"task piqa: .*valid\.jsonl does not exist"):
        prepare_task_dir(tmp_path, ["piqa"], cache=tmp_path / "cache")
    with pytest.raises(ConfigError, match="is not a folder"):
        prepare_task_dir(tmp_path / "nope", ["piqa"], cache=tmp_path / "cache")


def test_cli_refuses_an_unknown_task_before_loading(tmp_path, capsys):
    from edgeprune.cli import main

    assert main(["eval", str(tmp_path / "no-model"), "--tasks", "piqa,hellaswagg",
                 "--task-data", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown task hellaswagg (did you mean hellaswag?)" in err and "no-model" not in err


def test_prepared_folder_is_content_addressed(tmp_path):
    from edgeprune.evaluation.task_data import prepare_task_dir

    root = _piqa(tmp_path / "data")
    a = prepare_task_dir(root, ["piqa"], cache=tmp_path / "cache")
    assert prepare_task_dir(root, ["piqa"], cache=tmp_path / "cache") == a
    docs = [json.loads(x) for x in (a / "piqa/validation.jsonl").read_text().splitlines()]
    assert [d["label"] for d in docs] == [0, 1, 0, 1, 0, 1] and docs[0]["goal"] == "How do I run?"
    import yaml

    cfg = yaml.safe_load((a / "piqa.yaml").read_text())
    assert cfg["dataset_path"] == "json" and cfg["include"].endswith("lm_eval/tasks/piqa/piqa.yaml")
    (root / "piqa/valid-labels.lst").write_text("1\n" * 6)
    assert prepare_task_dir(root, ["piqa"], cache=tmp_path / "cache") != a     # changed data: new folder


@pytest.mark.skipif(not TASKS.is_dir(), reason="shared task data not found")
def test_every_local_task_converts_and_loads_in_lm_eval(tmp_path):
    from lm_eval.tasks import TaskManager

    from edgeprune.evaluation.task_data import TASK_NAMES, prepare_task_dir

    p = prepare_task_dir(TASKS, list(TASK_NAMES), cache=tmp_path)
    counts = {t: sum(1 for _ in open(p / t / s)) for t, s in [
        ("piqa", "validation.jsonl"), ("arc_easy", "test.jsonl"), ("arc_challenge", "test.jsonl"),
        ("hellaswag", "validation.jsonl"), ("winogrande", "validation.jsonl"), ("boolq", "validation.jsonl"),
        ("openbookqa", "test.jsonl"), ("lambada_openai", "test.jsonl"), ("copa", "validation.jsonl"),
        ("rte", "validation.jsonl"), ("xcopa_zh", "test.jsonl")]}
    assert counts == dict(piqa=1838, arc_easy=2376, arc_challenge=1172, hellaswag=10042, winogrande=1267,
                          boolq=3270, openbookqa=500, lambada_openai=5153, copa=100, rte=277, xcopa_zh=500)
    arc = json.loads(open(p / "arc_easy/test.jsonl").readline())
    assert not arc["question"].startswith("Question:") and arc["answerKey"] in arc["choices"]["label"]
    tm = TaskManager(include_path=str(p), include_defaults=False)
    assert {"piqa", "hellaswag", "xcopa", "xcopa_th", "boolq"} <= set(tm.all_tasks)
    from lm_eval.tasks import get_task_dict

    os.environ["HF_DATASETS_OFFLINE"] = "1"
    task = get_task_dict(["hellaswag"], tm)["hellaswag"]
    doc = next(iter(task.test_docs() if task.has_test_docs() else task.validation_docs()))
    assert task.doc_to_text(doc).startswith("Roof shingle removal: A man is sitting on a roof.")
    assert task.doc_to_target(doc) == 3 and len(task.doc_to_choice(doc)) == 4


def _hf_tiny(tmp_path):
    from study_tiny import tiny_model_folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_model_folder(tmp_path / "model")
    return AutoModelForCausalLM.from_pretrained(str(folder)).eval(), AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("batch_groups", [None, 1, 8])
def test_our_lm_scores_like_lm_evals_hf_model(tmp_path, batch_groups):
    """Same requests, same token ids: the log-likelihoods of EdgepruneLM (context shared by
    the choices: packed rows by default, a KV cache with ``batch_groups``) equal those of lm-eval's HFLM on the same in-memory model."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from edgeprune.evaluation.lm import EdgepruneLM
    from edgeprune.evaluation.task_data import prepare_task_dir

    model, tok = _hf_tiny(tmp_path)
    tm = TaskManager(include_path=str(prepare_task_dir(_piqa(tmp_path / "data"), ["piqa"], cache=tmp_path / "c")),
                     include_defaults=False)
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    out = {}
    for name, lm in (("ours", EdgepruneLM(model, tok, progress=False, batch_groups=batch_groups)),
                     ("hf", HFLM(pretrained=model, tokenizer=tok, batch_size=4))):
        r = simple_evaluate(model=lm, tasks=["piqa"], task_manager=tm, log_samples=True, verbosity="ERROR",
                            bootstrap_iters=0)
        out[name] = r
    assert out["ours"]["results"]["piqa"]["acc,none"] == out["hf"]["results"]["piqa"]["acc,none"]
    for a, b in zip(out["ours"]["samples"]["piqa"], out["hf"]["samples"]["piqa"]):
        for ra, rb in zip(a["resps"], b["resps"]):
            assert ra[0][0] == pytest.approx(rb[0][0], abs=1e-4) and ra[0][1] == rb[0][1]


def test_onnx_backend_scores_like_the_torch_model(tmp_path):
    """An export and the model it came from give the same log-likelihoods and greedy tokens."""
    from tiny import export_tiny_llama

    from edgeprune.evaluation.backends import RuntimeBackend, TorchBackend, load_evaluated

    folder, model, tok = export_tiny_llama(tmp_path / "onnx")
    m, tok2 = load_evaluated(folder, threads=1)
    rt, pt = RuntimeBackend(m.session), TorchBackend(model)
    ctx = tok.encode("Small language models run")
    conts = [tok.encode(" on phones"), tok.encode(" fast"), tok.encode(" and laptops.")]
    for (a, ga), (b, gb) in zip(rt.score(ctx, conts), pt.score(ctx, conts)):
        assert a == pytest.approx(b, abs=1e-3) and ga == gb
    assert rt.greedy(ctx, 6) == pt.greedy(ctx, 6)
    assert tok2.encode("Hello world") == tok.encode("Hello world")


def test_quiet_lm_shows_no_harness_bar(tmp_path, capsys):
    """With ``progress=False`` lm-eval's own "Tokenizing inputs" bar is hidden too (tqdm
    reads TQDM_DISABLE at import, so only ``disable_tqdm`` can hide it); scores unchanged."""
    from lm_eval.api.instance import Instance

    from edgeprune.evaluation.lm import EdgepruneLM

    model, tok = _hf_tiny(tmp_path)
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=("The sky is", c), idx=i)
            for i, c in enumerate([" blue", " green"])]
    quiet = EdgepruneLM(model, tok, progress=False).loglikelihood(reqs)
    assert "Tokenizing inputs" not in capsys.readouterr().err
    loud = EdgepruneLM(model, tok, progress=True).loglikelihood(reqs)
    assert "Tokenizing inputs" in capsys.readouterr().err
    assert quiet == loud and len(quiet) == 2
