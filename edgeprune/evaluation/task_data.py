"""Local task data for lm-eval: the files of each task, read into the documents lm-eval's
own task expects, and task YAMLs that point lm-eval at them (``dataset_path: json``).

lm-eval (EleutherAI's harness) downloads each task's data set from the Hugging Face hub.
Offline, ``--task-data DIR`` gives the data instead: each task's files in the layout of
their original releases (the layout below, the one of ``shared/data/tasks``). They are
converted once into ``<cache>/tasks/<digest>/``:

* ``<task>/<split>.jsonl``: one document per line, with the fields of the hub data set
  lm-eval's task reads (``goal/sol1/sol2/label`` for PIQA, ``question/choices/answerKey``
  for ARC, ...);
* ``<task>.yaml``: the task as lm-eval's own YAML defines it (``include:`` of the installed
  harness's file: the same prompt, choices, target and metrics), with ``dataset_path: json``
  and ``dataset_kwargs.data_files`` pointing at the JSONL files.

The folder is named by the content hash of the source files, the harness version and
:data:`CONVERTER_VERSION`, so a changed file gives a new folder. The same folder is what
``lm_eval --include_path FOLDER --tasks piqa`` reads (its ``piqa`` replaces the built-in
one), so our scores and the harness's own command line score the same documents.

HellaSwag's file (llama.cpp's text format) holds the context already joined and cleaned
(``activity_label: ctx``), so its task is self-contained: ``query``, ``choices`` and
``label`` cleaned by the harness's ``preprocess``; unlike the hub version, the second
part of the context keeps its lower-case first letter (the source file lost the split).
"""

from __future__ import annotations

import bz2
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import CalibrationError, ConfigError

#: Bumped when a converter changes what it writes (part of the prepared folder's digest).
CONVERTER_VERSION = 1

#: XCOPA's eleven languages (lm-eval's ``xcopa`` group: ``xcopa_<lang>``).
XCOPA_LANGS = ("et", "ht", "id", "it", "qu", "sw", "ta", "th", "tr", "vi", "zh")


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:   # universal newlines: CRLF files read as LF
        return [json.loads(line) for line in f if line.strip()]


def _read_arrow(folder: Path) -> list[dict]:
    """Rows of a ``datasets.save_to_disk`` folder (Arrow IPC stream), read with pyarrow."""
    import pyarrow as pa

    files = sorted(folder.glob("data-*.arrow"))
    rows: list[dict] = []
    for f in files:
        with pa.memory_map(str(f)) as src:
            rows += pa.ipc.open_stream(src).read_all().to_pylist()
    return rows


def _piqa(root: Path) -> dict[str, list[dict]]:
    docs = _read_jsonl(root / "piqa/valid.jsonl")
    labels = [int(x) for x in (root / "piqa/valid-labels.lst").read_text().split()]
    if len(labels) != len(docs):
        raise CalibrationError(f"piqa: {len(docs)} questions but {len(labels)} labels",
                               "restore valid.jsonl and valid-labels.lst from the PIQA release")
    return {"validation": [dict(d, label=y) for d, y in zip(docs, labels)]}


def _strip_query(query: str) -> str:
    """OLMES documents hold the prompt ``"Question: Q\\nAnswer:"``; the hub data the question Q."""
    q = query[len("Question: "):] if query.startswith("Question: ") else query
    return q[: -len("\nAnswer:")] if q.endswith("\nAnswer:") else q


def _olmes(rel: str, text_field: str) -> Callable[[Path], dict[str, list[dict]]]:
    """ARC / OpenBookQA test documents from OLMES' ``{"query","choices","gold"}`` into the
    hub schema (letters A, B, ... as labels: lm-eval uses only their order)."""

    def read(root: Path) -> dict[str, list[dict]]:
        out = []
        for d in _read_jsonl(root / rel):
            labels = [chr(ord("A") + i) for i in range(len(d["choices"]))]
            out.append({"id": d.get("id"), text_field: _strip_query(d["query"]),
                        "choices": {"text": list(d["choices"]), "label": labels},
                        "answerKey": labels[int(d["gold"])]})
        return {"test": out}

    return read


def _hellaswag_clean(text: str) -> str:
    """lm-eval's ``hellaswag/utils.preprocess`` (the WikiHow bracket artifacts removed)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(root: Path) -> dict[str, list[dict]]:
    with bz2.open(root / "hellaswag/hellaswag_val_full.txt.bz2", "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    lines = lines[: len(lines) - len(lines) % 6]
    docs = []
    for i in range(0, len(lines), 6):
        ctx, gold, *endings = lines[i: i + 6]
        docs.append({"query": _hellaswag_clean(ctx), "choices": [_hellaswag_clean(e) for e in endings],
                     "label": int(gold)})
    return {"validation": docs}


def _arrow_task(rel: str, split: str, fix: Callable[[dict], dict] = lambda d: d):
    def read(root: Path) -> dict[str, list[dict]]:
        return {split: [fix(d) for d in _read_arrow(root / rel)]}

    return read


def _boolq_fix(d: dict) -> dict:
    return dict(d, label=int(bool(d["answer"])))


def _int_label(d: dict) -> dict:
    return dict(d, label=int(d["label"]))


def _lambada(root: Path) -> dict[str, list[dict]]:
    return {"test": _read_jsonl(root / "lambada_openai/lambada_test.jsonl")}


def _xcopa(lang: str):
    def read(root: Path) -> dict[str, list[dict]]:
        return {"test": _read_jsonl(root / f"xcopa/{lang}/test.{lang}.jsonl"),
                "validation": _read_jsonl(root / f"xcopa/{lang}/val.{lang}.jsonl")}

    return read


@dataclass(frozen=True)
class LocalTask:
    """How one lm-eval task reads local files.

    Attributes:
        name: lm-eval's task name (``piqa``, ``xcopa_zh``...).
        files: paths under the task-data folder (files or folders) it reads.
        read: ``root -> {split: [document, ...]}`` in the hub data set's schema.
        base: lm-eval's own YAML (relative to ``lm_eval/tasks``) the task includes; None
            for a self-contained task (``config`` holds all of it).
        config: fields written over (or, without ``base``, instead of) lm-eval's.
    """

    name: str
    files: tuple[str, ...]
    read: Callable[[Path], dict[str, list[dict]]]
    base: str | None
    config: dict[str, Any] = field(default_factory=dict)


def _splits(validation: bool = True, test: bool = False) -> dict[str, Any]:
    return {"training_split": None, "validation_split": "validation" if validation else None,
            "test_split": "test" if test else None}


_TASKS: list[LocalTask] = [
    LocalTask("piqa", ("piqa/valid.jsonl", "piqa/valid-labels.lst"), _piqa, "piqa/piqa.yaml", _splits()),
    LocalTask("arc_easy", ("arc/ARC-Easy-test.olmes_docs.jsonl",),
              _olmes("arc/ARC-Easy-test.olmes_docs.jsonl", "question"), "arc/arc_easy.yaml",
              _splits(False, True)),
    LocalTask("arc_challenge", ("arc/ARC-Challenge-test.olmes_docs.jsonl",),
              _olmes("arc/ARC-Challenge-test.olmes_docs.jsonl", "question"), "arc/arc_challenge.yaml",
              _splits(False, True)),
    LocalTask("hellaswag", ("hellaswag/hellaswag_val_full.txt.bz2",), _hellaswag, None, dict(
        _splits(), output_type="multiple_choice", doc_to_text="{{query}}", doc_to_target="{{label}}",
        doc_to_choice="choices",
        metric_list=[dict(metric=m, aggregation="mean", higher_is_better=True) for m in ("acc", "acc_norm")],
        metadata=dict(version=1.0))),
    LocalTask("winogrande", ("winogrande/hf_arrow/winogrande_xl/validation",),
              _arrow_task("winogrande/hf_arrow/winogrande_xl/validation", "validation"),
              "winogrande/default.yaml", _splits()),
    LocalTask("boolq", ("boolq/hf_arrow/validation",),
              _arrow_task("boolq/hf_arrow/validation", "validation", _boolq_fix),
              "super_glue/boolq/default.yaml", _splits()),
    LocalTask("openbookqa", ("openbookqa/openbookqa-main-test.olmes_docs.jsonl",),
              _olmes("openbookqa/openbookqa-main-test.olmes_docs.jsonl", "question_stem"),
              "openbookqa/openbookqa.yaml", _splits(False, True)),
    LocalTask("lambada_openai", ("lambada_openai/lambada_test.jsonl",), _lambada,
              "lambada/lambada_openai.yaml", _splits(False, True)),
    LocalTask("copa", ("copa/hf_arrow/super_glue_copa/validation",),
              _arrow_task("copa/hf_arrow/super_glue_copa/validation", "validation", _int_label),
              "super_glue/copa/default.yaml", _splits()),
    LocalTask("rte", ("rte/hf_arrow/glue_rte/validation",),
              _arrow_task("rte/hf_arrow/glue_rte/validation", "validation", _int_label),
              "glue/rte/default.yaml", _splits()),
] + [LocalTask(f"xcopa_{lang}", (f"xcopa/{lang}",), _xcopa(lang), f"xcopa/default_{lang}.yaml",
               _splits(True, True)) for lang in XCOPA_LANGS]

#: lm-eval task name -> :class:`LocalTask`.
LOCAL_TASKS: dict[str, LocalTask] = {t.name: t for t in _TASKS}
#: Groups: a name that stands for several tasks (lm-eval's ``xcopa`` group).
GROUPS: dict[str, tuple[str, ...]] = {"xcopa": tuple(f"xcopa_{lang}" for lang in XCOPA_LANGS)}
#: The tasks ``--tasks`` accepts with ``--task-data`` (groups included).
TASK_NAMES: tuple[str, ...] = tuple(t.name for t in _TASKS if not t.name.startswith("xcopa_")) + ("xcopa",)


def parse_tasks(tasks) -> list[str]:
    """``"piqa,arc_easy"`` (or a list) -> the task names, in order, each once.

    Raises:
        ConfigError: an empty list.
    """
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks or ())
    out: list[str] = []
    for n in (str(x).strip() for x in names):
        if n and n not in out:
            out.append(n)
    if not out:
        raise ConfigError("no task given", f"pass e.g. --tasks piqa,arc_easy (known: {', '.join(TASK_NAMES)})")
    return out


def check_local_tasks(tasks: list[str]) -> None:
    """Refuse a task name with no local converter.

    Raises:
        ConfigError: naming the unknown tasks and the known ones.
    """
    unknown = [t for t in tasks if t not in LOCAL_TASKS and t not in GROUPS]
    if unknown:
        import difflib

        near = [m for t in unknown for m in difflib.get_close_matches(t, TASK_NAMES, 1)]
        raise ConfigError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
                          + (f" (did you mean {', '.join(near)}?)" if near else ""),
                          f"use tasks from: {', '.join(TASK_NAMES)}")


def expand(tasks: list[str]) -> list[str]:
    """Task names with groups replaced by their tasks."""
    out: list[str] = []
    for t in tasks:
        out += list(GROUPS.get(t, (t,)))
    return out


def _source_digest(root: Path, names: list[str]) -> str:
    """SHA-256 over the converter version, the harness version and every source file's bytes."""
    from importlib.metadata import version

    h = hashlib.sha256(f"v{CONVERTER_VERSION} lm-eval {version('lm_eval')}\n".encode())
    for name in names:
        for rel in LOCAL_TASKS[name].files:
            p = root / rel
            if not p.exists():
                raise CalibrationError(f"task {name}: {p} does not exist",
                                       f"put the {name} files under --task-data in the layout docs/study.md gives, "
                                       "or drop --task-data to read lm-eval's hub data (online)")
            for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
                if f.is_file():
                    h.update(f"{name}/{f.relative_to(root)}\n".encode())
                    h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def _harness_tasks_dir() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).resolve().parent / "tasks"


def _task_yaml(task: LocalTask, files: dict[str, Path]) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    if task.base is not None:
        cfg["include"] = str(_harness_tasks_dir() / task.base)
    cfg.update(task=task.name, dataset_path="json", dataset_name=None,
               dataset_kwargs={"data_files": {s: str(p) for s, p in files.items()}})
    cfg.update(task.config)
    return cfg


def prepare_task_dir(task_data, tasks: list[str], cache: Path | None = None) -> Path:
    """Convert the local files of ``tasks`` (groups expanded) into a folder of lm-eval
    task YAMLs and JSONL documents; an existing folder of the same content is reused.

    Args:
        task_data: the folder holding each task's files (layout: docs/study.md).
        tasks: task or group names (:data:`TASK_NAMES`).
        cache: where prepared folders go (default ``<edgeprune cache>/tasks``).

    Returns:
        The prepared folder (``lm_eval --include_path`` reads it as it is).

    Raises:
        ConfigError: an unknown task; ``task_data`` is not a folder.
        CalibrationError: a task's file is missing or inconsistent.
    """
    import yaml

    from edgeprune_runtime.files import atomic_folder

    root = Path(task_data).expanduser()
    if not root.is_dir():
        raise ConfigError(f"--task-data {root} is not a folder",
                          "pass the folder holding the task files (e.g. shared/data/tasks)")
    check_local_tasks(tasks)
    names = expand(tasks)
    if cache is None:
        from ..models import cache_dir

        cache = cache_dir() / "tasks"
    out = (Path(cache) / _source_digest(root, names)).resolve()
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(out, overwrite=True, error=CalibrationError) as tmp:
        for name in names:
            task = LOCAL_TASKS[name]
            files = {}
            for split, docs in task.read(root).items():
                (tmp / name).mkdir(exist_ok=True)
                (tmp / name / f"{split}.jsonl").write_text(
                    "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
                files[split] = out / name / f"{split}.jsonl"
            (tmp / f"{name}.yaml").write_text(yaml.safe_dump(_task_yaml(task, files), sort_keys=False,
                                                            allow_unicode=True), encoding="utf-8")
        for group, members in GROUPS.items():
            if set(members) <= set(names):
                (tmp / f"{group}.yaml").write_text(yaml.safe_dump(dict(
                    group=group, task=list(members),
                    aggregate_metric_list=[dict(metric="acc", aggregation="mean", weight_by_size=True)],
                    metadata=dict(version=1.0)), sort_keys=False), encoding="utf-8")
    return out


__all__ = ["LocalTask", "LOCAL_TASKS", "GROUPS", "TASK_NAMES", "XCOPA_LANGS", "parse_tasks",
           "check_local_tasks", "expand", "prepare_task_dir"]
