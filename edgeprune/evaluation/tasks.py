"""Zero-shot task accuracy scored by lm-eval (EleutherAI's harness; the ``eval`` extra).

:func:`run_tasks` scores a torch model or an ONNX export (:class:`~edgeprune.evaluation.lm.
EdgepruneLM`) on lm-eval tasks: with ``task_data`` from local files
(:mod:`~edgeprune.evaluation.task_data`, ``HF_DATASETS_OFFLINE=1``), otherwise from the
harness's own hub data sets (online). ``limit`` keeps the first N documents of each task,
as ``lm_eval --limit N`` does. The figures are lm-eval's own (``acc``, ``acc_norm``,
their standard errors), with the number of documents scored.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import ConfigError
from .task_data import GROUPS, check_local_tasks, parse_tasks, prepare_task_dir
from .perplexity import Record


def require_lm_eval() -> None:
    """Raises ConfigError when lm-eval (the ``eval`` extra) is not installed."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("task scoring needs lm-eval, which is not installed",
                          "pip install 'edgeprune[eval]'")


@dataclass
class TaskResult(Record):
    """One task's scores.

    Attributes:
        task: lm-eval's task (or group) name.
        acc: accuracy in [0, 1] (None when the task has none).
        acc_norm: length-normalized accuracy (multiple-choice tasks that report it).
        acc_stderr: standard error of ``acc``.
        n: documents scored.
        metrics: every figure lm-eval reported (``"acc,none"`` keys stripped to ``acc``).
    """

    task: str
    acc: Optional[float]
    acc_norm: Optional[float]
    acc_stderr: Optional[float]
    n: Optional[int]
    metrics: dict = field(default_factory=dict)


@dataclass
class TaskResults(Record):
    """Scores per task and how they were computed (``protocol``: data, limit, harness)."""

    tasks: dict
    protocol: dict


def check_tasks(tasks, task_data=None) -> list[str]:
    """Parse and check task names before any model is loaded.

    Args:
        tasks: ``"piqa,arc_easy"`` or a list.
        task_data: the local task folder (names checked against the local converters),
            or None (checked against lm-eval's task index).

    Returns:
        The task names.

    Raises:
        ConfigError: an unknown task; lm-eval is not installed.
    """
    names = parse_tasks(tasks)
    require_lm_eval()
    if task_data is not None:
        check_local_tasks(names)
    else:
        known = set(_task_manager(None).all_tasks)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ConfigError(f"lm-eval knows no task {', '.join(unknown)}",
                              "check the name with `lm_eval --tasks list`")
    return names


def _task_manager(prepared):
    from lm_eval.tasks import TaskManager

    if prepared is None:
        return TaskManager()
    return TaskManager(include_path=str(prepared), include_defaults=False)


def _quiet_harness() -> None:
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _metrics(raw: dict) -> dict[str, Any]:
    return {k.split(",")[0]: v for k, v in raw.items() if k != "alias" and isinstance(v, (int, float))}


def run_tasks(model, tokenizer, tasks, *, limit: Optional[int] = None, task_data=None,
              num_fewshot: Optional[int] = None, progress: bool = True) -> TaskResults:
    """Score ``model`` on lm-eval tasks.

    Args:
        model: torch causal LM, :class:`~edgeprune.evaluation.backends.RuntimeModel` or a
            ``runtime`` session.
        tokenizer: its Hugging Face tokenizer.
        tasks: task names (``"piqa,arc_easy"`` or a list); groups (``xcopa``) give their
            tasks and the group's mean.
        limit: first N documents of each task (None: all).
        task_data: local task folder (:func:`~edgeprune.evaluation.task_data.prepare_task_dir`);
            None reads lm-eval's hub data (online).
        num_fewshot: examples in each prompt (None: the task's default, 0 for these tasks).
        progress: progress bar over requests.

    Returns:
        :class:`TaskResults`.

    Raises:
        ConfigError: unknown task, bad ``limit``, lm-eval missing.
        CalibrationError: a local task file is missing.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit={limit!r} must be a positive integer or None", "pass e.g. --limit 500")
    names = check_tasks(tasks, task_data)
    prepared = None
    if task_data is not None:
        prepared = prepare_task_dir(task_data, names)
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        try:
            import datasets.config as dc

            dc.HF_DATASETS_OFFLINE = True
        except (ImportError, AttributeError):
            pass
    _quiet_harness()
    from importlib.metadata import version

    from lm_eval.evaluator import simple_evaluate

    from .lm import EdgepruneLM

    lm = EdgepruneLM(model, tokenizer, progress=progress)
    quiet = not progress and "TQDM_DISABLE" not in os.environ
    if quiet:                      # the harness's own bars (building contexts, tokenizing)
        os.environ["TQDM_DISABLE"] = "1"
    try:
        raw = simple_evaluate(model=lm, tasks=names, task_manager=_task_manager(prepared), limit=limit,
                              num_fewshot=num_fewshot, log_samples=False, verbosity="WARNING")
    finally:
        if quiet:
            del os.environ["TQDM_DISABLE"]
    results, nsamp = raw.get("results", {}), raw.get("n-samples", {})
    out: dict[str, TaskResult] = {}
    for task in list(names) + [t for g in names for t in GROUPS.get(g, ())]:
        m = _metrics(results.get(task, {}))
        n = nsamp.get(task, {}).get("effective")
        if n is None and task in GROUPS:
            n = sum(nsamp.get(t, {}).get("effective", 0) for t in GROUPS[task]) or None
        out[task] = TaskResult(task=task, acc=m.get("acc"), acc_norm=m.get("acc_norm"),
                               acc_stderr=m.get("acc_stderr"), n=n, metrics=m)
    protocol = dict(harness=f"lm-eval {version('lm_eval')}", limit=limit, num_fewshot=num_fewshot or 0,
                    data=str(task_data) if task_data is not None else "lm-eval hub data sets",
                    prepared=str(prepared) if prepared else None)
    return TaskResults(tasks=out, protocol=protocol)


__all__ = ["TaskResult", "TaskResults", "run_tasks", "check_tasks", "require_lm_eval"]
