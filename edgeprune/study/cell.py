"""Planning the grid's keys and computing one cell: the same code runs every cell in the
local loop and in a Ray worker, so both give the same numbers.

A planned cell (:class:`PlannedCell`) knows its cache key and its units (``text``: the
perplexity of the dense model, or the fidelity of a compressed one, on the study's
text; ``task:<name>``; ``lang:<code>``). :meth:`StudyRunner.run_cell` computes only the
units the cache lacks, loading the dense model (once per process and model), reusing a
cached compressed model or compressing (calibration built once per model), and stores
every unit as soon as it is measured.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..calibration import with_forward_dtype
from ..errors import ConfigError, EdgePruneError
from .cache import STUDY_VERSION, Cache, key
from .grid import CellSpec, StudyConfig, auto_group_size, linear_in_features


@dataclass
class PlannedCell:
    """One cell with its keys: ``cell_key`` (the compressed model) and ``units``
    (``{unit name: unit key}``); ``error`` when its model could not even be planned
    (a model that does not load: the cell fails, the other models' cells run)."""

    model: str
    spec: CellSpec
    cell_key: str
    units: dict
    error: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return dict(model=self.model, spec=self.spec.to_dict(), cell_key=self.cell_key, units=self.units)


@dataclass
class CellOutcome:
    """What a run knows of a cell: ``status`` (``"computed"``, ``"cached"`` or ``"failed"``),
    the ``error`` of a failed one, every unit's result, the units this run ``computed``,
    and the compression ``record`` (method settings, seconds, bits per weight)."""

    model: str
    spec: CellSpec
    cell_key: str
    status: str
    units: dict = field(default_factory=dict)
    error: Optional[str] = None
    computed: list = field(default_factory=list)
    record: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["spec"] = self.spec.to_dict()
        return d


class _ModelState:
    """A model's dense weights, tokenizer and calibration windows, loaded once per process."""

    def __init__(self, dense, tokenizer):
        self.dense = dense
        self.tokenizer = tokenizer
        self.state = {k: v.clone() for k, v in dense.state_dict().items()}
        self.calib = None
        self.calib_info: dict = {}


class StudyRunner:
    """Plans a study's keys and computes its cells (one per process).

    Args:
        config: the study.
        cache: its cache.
        tick: called with ``(cell label, unit name)`` after each unit (progress bars).
        status: called with ``(cell label, text)`` inside a long unit, e.g. ``"compress
            7/24"`` after each block of a compression (the bar's text, no step).
    """

    def __init__(self, config: StudyConfig, cache: Cache, tick: Optional[Callable[[str, str], None]] = None,
                 status: Optional[Callable[[str, str], None]] = None):
        self.config = config
        self.cache = cache
        self.tick = tick or (lambda label, unit: None)
        self.status = status or (lambda label, text: None)
        self._models: dict[str, _ModelState] = {}
        self._languages = None
        self._task_digest: Optional[str] = None

    # ------------------------------------------------------------------ keys
    def _calib_digest(self, source: Optional[str]) -> str:
        """Digest of a calibration source: a file's bytes; a name (``self``, ``hf:...``) as itself."""
        if source is None or source in ("default", "self") or str(source).startswith("hf:"):
            return f"calib:{source or 'default'}"
        return self.cache.digest(Path(source).expanduser())

    @staticmethod
    def _text_digest(text: Optional[str]) -> str:
        """SHA-256 of the fidelity text as scored (a file's text, a literal, the embedded default)."""
        import hashlib

        from ..evaluation import resolve_text

        return hashlib.sha256(resolve_text(text)[0].encode()).hexdigest()

    def model_digest(self, model: str) -> str:
        from ..models import local_source

        src = local_source(model)
        return self.cache.digest(src) if src is not None else f"name:{model}"

    def _facts(self, model: str, digest: str) -> dict:
        """Layer facts of a model (linear input sizes), cached; loads the model once if unknown."""
        fk = key(["facts", digest])
        facts = self.cache.get(fk)
        if facts is None:
            st = self._state(model)
            facts = dict(in_features=linear_in_features(st.dense))
            self.cache.put(fk, facts)
        return facts

    def _task_data_digest(self) -> str:
        if self._task_digest is None:
            from importlib.metadata import version

            if self.config.task_data is None:
                self._task_digest = f"lm-eval {version('lm_eval')} hub"
            else:
                from ..evaluation.task_data import prepare_task_dir

                self._task_digest = prepare_task_dir(self.config.task_data, self.config.tasks).name
        return self._task_digest

    def languages(self):
        if self._languages is None and self.config.langs:
            from ..evaluation.languages import load_languages

            self._languages = load_languages(self.config.langs)
        return self._languages or []

    def plan(self) -> list[PlannedCell]:
        """Every cell's keys (model digests hashed, ``group_size="auto"`` resolved per model).

        Raises:
            ConfigError, CalibrationError: unknown task, unparallel language files, missing files.
        """
        c = self.config
        cells = []
        text = self._text_digest(c.text)
        calib = with_forward_dtype(dict(source=self._calib_digest(c.calib), nsamples=c.nsamples,
                                        seqlen=c.seqlen, seed=c.seed), c.calib_dtype)
        scored = {} if c.dtype == "float32" else dict(dtype=c.dtype)     # float32 keys as before
        tasks = {t: dict(task=t, limit=c.limit, num_fewshot=c.num_fewshot, data=self._task_data_digest(), **scored)
                 for t in c.tasks} if c.tasks else {}
        langs = {lt.code: dict(file=self.cache.digest(lt.path), lines=c.lang_lines, seqlen=c.eval_seqlen, **scored)
                 for lt in self.languages()}
        for model in c.models:
            try:
                digest = self.model_digest(model)
                gs = None
                if c.group_size == "auto" and any(s.bits is not None and s.group_size is None for s in c.cells):
                    gs = auto_group_size(self._facts(model, digest)["in_features"])
            except EdgePruneError as exc:
                cells += [PlannedCell(model, spec, "", {}, error=str(exc)) for spec in c.cells]
                continue
            for spec in c.cells:
                spec = spec.with_group_size(gs)
                ck = key(dict(v=STUDY_VERSION, model=digest, spec=spec.settings(), method=spec.method,
                              calib=None if spec.is_dense else calib))
                units = {"text": key(dict(cell=ck, unit="text", text=text, seqlen=c.eval_seqlen,
                                          nwindows=c.nwindows, continuations=c.continuations,
                                          prompt_len=c.prompt_len, new_tokens=c.new_tokens))}
                units.update({f"task:{t}": key(dict(cell=ck, unit="task", **s)) for t, s in tasks.items()})
                units.update({f"lang:{lc}": key(dict(cell=ck, unit="lang", code=lc, **s)) for lc, s in langs.items()})
                cells.append(PlannedCell(model, spec, ck, units))
        return cells

    # ------------------------------------------------------------------ work
    def _state(self, model: str) -> _ModelState:
        if model not in self._models:
            from ..models import load_model

            m, tok = load_model(model, device=self.config.device)
            self._models[model] = _ModelState(m, tok)
        return self._models[model]

    def release(self, model: str) -> None:
        """Drop a model's dense weights (the local loop moves on to the next model)."""
        self._models.pop(model, None)

    def cached(self, pc: PlannedCell) -> Optional[dict]:
        """Every unit's result when all are cached, else None."""
        out = {u: self.cache.get(k) for u, k in pc.units.items()}
        return out if all(v is not None for v in out.values()) else None

    def run_cell(self, pc: PlannedCell) -> CellOutcome:
        """Compute the units of ``pc`` the cache lacks (see the module docstring).

        Raises:
            EdgePruneError: a setting the model cannot take (group size that does not divide
                a layer), missing data; anything a method or evaluation raises.
        """
        import torch

        if pc.error:
            raise _PlanError(pc.error)
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        results = {u: self.cache.get(k) for u, k in pc.units.items()}
        missing = [u for u, v in results.items() if v is None]
        out = CellOutcome(pc.model, pc.spec, pc.cell_key, "cached", units=results)
        rec_path = self.cache.model_dir(pc.cell_key) / "record.json"
        out.record = Cache._read_json(rec_path) or {}
        if not missing:
            return out
        st = self._state(pc.model)
        model = st.dense if pc.spec.is_dense else self._compressed(pc, st, out)
        self._measure(pc, st, model, missing, out)
        out.status = "computed"
        return out

    def _compressed(self, pc: PlannedCell, st: _ModelState, out: CellOutcome):
        import torch

        from ..engine import check_recipe, compress
        from ..recipe import Recipe, method_config_from_name

        model = copy.deepcopy(st.dense)
        if self.cache.has_model(pc.cell_key):
            out.record = self.cache.load_model(pc.cell_key, model)
            return model
        recipe = Recipe(stages=[method_config_from_name(pc.spec.method, **pc.spec.settings())],
                        name=pc.spec.method)
        recipe.validate()
        check_recipe(model, recipe)             # e.g. a group size that does not divide a layer
        if st.calib is None:
            from ..calibration import build_calibration

            c = self.config
            cal = build_calibration(st.tokenizer, c.calib, nsamples=c.nsamples, seqlen=c.seqlen, seed=c.seed,
                                    model_max_length=getattr(st.dense.config, "max_position_embeddings", None),
                                    model=st.dense)
            st.calib, st.calib_info = cal.input_ids, cal.info
        torch.manual_seed(self.config.seed)
        label = pc.spec.label
        res = compress(model, recipe, st.calib, device=self.config.device, progress=False,
                       on_block=lambda done, n: self.status(label, f"compress {done}/{n}"),
                       forward_dtype=self.config.calib_dtype)
        summ = res.summary()
        calib_info = with_forward_dtype(st.calib_info, self.config.calib_dtype)
        out.record = dict(spec=pc.spec.to_dict(), seconds=summ.get("seconds"), calibration=calib_info,
                          avg_bits_per_weight=summ.get("avg_bits_per_weight"), fallbacks=list(res.fallbacks),
                          mean_layer_error=summ.get("mean_layer_error"))
        self.cache.save_model(pc.cell_key, model, st.state, out.record)
        self.tick(pc.spec.label, "compress")
        return model

    def _put(self, pc: PlannedCell, out: CellOutcome, unit: str, value: dict, seconds: float) -> None:
        """Store a unit's result with ``seconds``, the wall time that computed it (tasks
        scored in one harness call share its time equally), so a grid computed over
        several runs still sums to its compute time."""
        value = dict(value, seconds=round(float(seconds), 3))
        self.cache.put(pc.units[unit], value)
        out.units[unit] = value
        out.computed.append(unit)
        self.tick(pc.spec.label, unit)

    def _measure(self, pc: PlannedCell, st: _ModelState, model, missing: list[str], out: CellOutcome) -> None:
        c = self.config
        tok = st.tokenizer
        nw = c.nwindows or None
        t0 = time.perf_counter()
        if "text" in missing:
            if pc.spec.is_dense:
                from ..evaluation import perplexity

                value = perplexity(model, tok, c.text, seqlen=c.eval_seqlen, nwindows=nw, progress=False).to_dict()
            else:
                from ..evaluation import fidelity

                value = fidelity(st.dense, model, tok, c.text, seqlen=c.eval_seqlen, nwindows=nw, progress=False,
                                 continuations=c.continuations, prompt_len=c.prompt_len,
                                 new_tokens=c.new_tokens).to_dict()
            self._put(pc, out, "text", value, time.perf_counter() - t0)
        tasks = [u.split(":", 1)[1] for u in missing if u.startswith("task:")]
        codes = [u.split(":", 1)[1] for u in missing if u.startswith("lang:")]
        if tasks or codes:
            from ..evaluation.backends import scoring_model

            model = scoring_model(model, c.dtype)
        if tasks:
            from ..evaluation.tasks import run_tasks

            t0 = time.perf_counter()
            r = run_tasks(model, tok, tasks, limit=c.limit, task_data=c.task_data, num_fewshot=c.num_fewshot,
                          progress=False)
            share = (time.perf_counter() - t0) / len(tasks)
            for t in tasks:
                sub = {k: v.to_dict() for k, v in r.tasks.items() if k == t or k.startswith(f"{t}_")}
                self._put(pc, out, f"task:{t}", dict(r.tasks[t].to_dict(), subtasks=sub,
                                                     protocol=dict(r.protocol, dtype=c.dtype)), share)
        if codes:
            from ..evaluation.languages import language_perplexity

            langs = [lt for lt in self.languages() if lt.code in codes]
            for lt in langs:
                t0 = time.perf_counter()
                r = language_perplexity(model, tok, [lt], lines=c.lang_lines, seqlen=c.eval_seqlen, progress=False)
                v = r[lt.code].to_dict()
                v["protocol"] = dict(v.get("protocol") or {}, dtype=c.dtype)
                self._put(pc, out, f"lang:{lt.code}", v, time.perf_counter() - t0)


class _PlanError(EdgePruneError):
    """A cell whose model could not be planned (its message is the loader's)."""


def check_config(config: StudyConfig) -> None:
    """Refuse bad settings before any model loads.

    Raises:
        ConfigError: no model or cell; bad counts.
    """
    if not config.models:
        raise ConfigError("no model given", "pass --models smollm2-135m (comma-separated for several)")
    for name in ("nsamples", "seqlen", "eval_seqlen"):
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer", f"pass e.g. --{name.replace('_', '-')} 512")
    if config.limit is not None and config.limit < 1:
        raise ConfigError(f"--limit {config.limit} must be positive", "pass e.g. --limit 500")
    from ..evaluation.backends import check_scoring_dtype

    check_scoring_dtype(config.dtype)
    check_scoring_dtype(config.calib_dtype, "--calib-dtype")
    if config.continuations < 0:
        raise ConfigError(f"--continuations {config.continuations} must be >= 0", "pass e.g. --continuations 32")


__all__ = ["PlannedCell", "CellOutcome", "StudyRunner", "check_config"]
