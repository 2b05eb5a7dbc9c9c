"""Running a study's grid: in this process (:func:`run_local`) or as Ray tasks
(:func:`run_ray`), with one progress bar over every unit of the grid, a failing cell
recorded while the others run, and the outcome written as tables and plots.

Ray (the ``ray`` extra): ``ray_address="local"`` starts a Ray instance on this machine;
any other value is the address of a running cluster (``ray start --head`` prints it).
Each cell that the cache cannot answer is one task with its resources declared
(``num_cpus`` = the study's threads, ``memory`` from the model's size, one GPU when the
study runs on CUDA); a worker computes the cell with the same code as the local loop and
writes into the same cache folder (a cluster needs that folder on a shared file system;
the results a task returns are also stored by the driver). The driver's bar counts each
unit as it lands in that folder (polled every :data:`RAY_POLL_S` seconds), so it moves
inside a cell as the local loop's does; where the folder is not shared it moves when a
cell returns.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

from ..errors import EdgePruneError
from .cache import Cache
from .cell import CellOutcome, PlannedCell, StudyRunner, check_config
from .grid import StudyConfig, config_from_dict


def _failed(pc: PlannedCell, exc: BaseException, cache: Cache) -> CellOutcome:
    msg = str(exc) if isinstance(exc, EdgePruneError) else f"{type(exc).__name__}: {exc}"
    units = {u: cache.get(k) for u, k in pc.units.items()}
    return CellOutcome(pc.model, pc.spec, pc.cell_key, "failed",
                       {u: v for u, v in units.items() if v is not None}, error=msg.splitlines()[0][:500])


class _Progress:
    """One bar over every unit of the grid (a compression counts as one more)."""

    def __init__(self, total: int, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="study", unit="step", disable=not enabled, dynamic_ncols=True)

    def tick(self, label: str, unit: str) -> None:
        self.bar.set_postfix_str(f"{label}: {unit}", refresh=False)
        self.bar.update(1)

    def status(self, label: str, text: str) -> None:
        """The bar's text inside a long unit (no step)."""
        self.bar.set_postfix_str(f"{label}: {text}", refresh=True)

    def skip(self, n: int) -> None:
        self.bar.update(n)

    def advance(self, label: str, text: str, n: int) -> None:
        """``n`` steps at once with the bar's text (a Ray cell's units seen landing)."""
        self.bar.set_postfix_str(f"{label}: {text}", refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _steps(pc: PlannedCell, runner: StudyRunner) -> int:
    """Units of a cell the cache lacks (+1 for compressing a model the cache lacks)."""
    n = sum(runner.cache.get(k) is None for k in pc.units.values())
    if n and not pc.spec.is_dense and not runner.cache.has_model(pc.cell_key):
        n += 1
    return n


def run_local(config: StudyConfig, cache: Cache, *, progress: bool = True,
              log: Callable[[str], None] = print) -> list[CellOutcome]:
    """Every cell in this process, model by model (the dense model loaded once per model).

    Returns:
        The outcomes, in grid order (failed cells included).
    """
    check_config(config)
    prog = None
    runner = StudyRunner(config, cache, tick=lambda label, unit: prog.tick(label, unit),
                         status=lambda label, text: prog.status(label, text))
    plan = runner.plan()
    steps = [_steps(pc, runner) for pc in plan]
    prog = _Progress(sum(steps), progress)
    outcomes = []
    try:
        for i, pc in enumerate(plan):
            try:
                outcomes.append(runner.run_cell(pc))
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 -- one cell's failure is recorded, the others run
                outcomes.append(_failed(pc, exc, cache))
                log(f"cell {pc.model} {pc.spec.label} failed: {outcomes[-1].error}")
                prog.skip(max(0, steps[i] - len(outcomes[-1].units)))
            if i + 1 == len(plan) or plan[i + 1].model != pc.model:
                runner.release(pc.model)
    finally:
        prog.close()
    return outcomes


def _ray_cell(config: dict, cache_root: str, pc: dict) -> dict:
    """A Ray task: compute one cell with :class:`StudyRunner` (the local loop's code)."""
    from .grid import CellSpec

    cfg = config_from_dict(config)
    cache = Cache(cache_root)
    runner = StudyRunner(cfg, cache)
    spec = CellSpec(**{k: pc["spec"][k] for k in ("method", "bits", "group_size", "sparsity", "prune_n", "prune_m")})
    planned = PlannedCell(pc["model"], spec, pc["cell_key"], pc["units"])
    try:
        return runner.run_cell(planned).to_dict()
    except Exception as exc:  # noqa: BLE001 -- returned as the cell's failure
        return _failed(planned, exc, cache).to_dict()


#: Float copies of the weights a cell holds at its peak (the dense model's mapped cache
#: file, the dense and compressed models, the work of compressing), and the room beside
#: them, in bytes. A Qwen2.5-Coder-0.5B cell (2.35 GiB of float32 weights) peaked at
#: 10.3 GiB resident, 2.5 GiB of it the mapped file (a process computing two cells in
#: turn: 10.9 and 12.2 GiB); it declares 10.4 GiB.
CELL_WEIGHT_COPIES, CELL_OVERHEAD = 4, 1 << 30
#: Ray's object store for ``--ray local``: the cells' arguments and results are small dicts.
LOCAL_OBJECT_STORE = 512 << 20
#: Seconds between the driver's looks at the cache for units the workers have finished.
RAY_POLL_S = 5.0


def _memory_bytes(model: str) -> int:
    """Memory a cell declares to Ray: :data:`CELL_WEIGHT_COPIES` float32 copies of the
    weights plus :data:`CELL_OVERHEAD`. A GGUF's parameter count is read from its tensor
    infos (its file size says little: Q4_K_M blocks, an 8-bit head); a folder's weights are
    its files' size, doubled when its config says 16-bit. 8 GiB for a model not on disk."""
    import json

    from ..models import local_source
    from ..models.gguf_header import GGUFHeaderError, read_gguf_parameter_count

    src = local_source(model)
    if src is None or not Path(src).exists():
        return 8 << 30
    src = Path(src)
    if src.is_file():
        try:
            weights = 4 * read_gguf_parameter_count(src)
        except (GGUFHeaderError, OSError):
            weights = src.stat().st_size
    else:
        weights = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()
                      and p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
        try:
            cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cfg = {}
        if str(cfg.get("torch_dtype") or cfg.get("dtype") or "") in ("bfloat16", "float16"):
            weights *= 2
    return CELL_WEIGHT_COPIES * weights + CELL_OVERHEAD


def run_ray(config: StudyConfig, cache: Cache, address: str, *, progress: bool = True,
            log: Callable[[str], None] = print) -> list[CellOutcome]:
    """The cells the cache cannot answer as Ray tasks (see the module docstring).

    Raises:
        ConfigError: Ray is not installed.
    """
    import importlib.util

    from ..errors import ConfigError

    if importlib.util.find_spec("ray") is None:
        raise ConfigError("--ray needs Ray, which is not installed", "pip install 'edgeprune[ray]'")
    check_config(config)
    runner = StudyRunner(config, cache)
    plan = runner.plan()
    import ray

    from .cell import CellOutcome as _Outcome

    started = not ray.is_initialized()
    if started:
        env = {"env_vars": {k: v for k, v in os.environ.items()
                            if k in ("PYTHONPATH", "EDGEPRUNE_CACHE", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE",
                                     "OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HOME")}}
        kw = dict(include_dashboard=False, log_to_driver=False, runtime_env=env)
        if address == "local":
            # tasks pass small dicts: Ray's default store (30 % of the free memory) would be
            # taken from the `memory` the cells declare
            ray.init(object_store_memory=LOCAL_OBJECT_STORE, **kw)
        else:
            ray.init(address=address, **kw)
    try:
        threads = config.threads or 1
        remote = ray.remote(_ray_cell)
        outcomes: dict[int, CellOutcome] = {}
        pending = {}
        # a step per missing unit and compression, as the local loop's bar; counted as they land
        steps = {}
        for i, pc in enumerate(plan):
            if pc.error:
                outcomes[i] = _failed(pc, EdgePruneError(pc.error), cache)
                log(f"cell {pc.model} {pc.spec.label} failed: {pc.error}")
                continue
            cached = runner.cached(pc)
            if cached is not None:
                rec = Cache._read_json(cache.model_dir(pc.cell_key) / "record.json") or {}
                outcomes[i] = _Outcome(pc.model, pc.spec, pc.cell_key, "cached", cached, record=rec)
                continue
            opts = dict(num_cpus=threads, memory=_memory_bytes(pc.model), max_retries=0)
            if config.device.startswith("cuda"):
                opts["num_gpus"] = 1
            steps[i] = _steps(pc, runner)
            pending[remote.options(**opts).remote(config.to_dict(), str(cache.root), pc.to_dict())] = i
        ticked = dict.fromkeys(pending.values(), 0)
        prog = _Progress(sum(steps.values()), progress)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=RAY_POLL_S)
            for i in pending.values():
                now = steps[i] - _steps(plan[i], runner)
                if now > ticked[i]:
                    prog.advance(plan[i].spec.label, f"{now}/{steps[i]} measured", now - ticked[i])
                    ticked[i] = now
            if not done:
                continue
            i = pending.pop(done[0])
            pc = plan[i]
            try:
                d = ray.get(done[0])
                for u, v in d["units"].items():
                    if v is not None and cache.get(pc.units[u]) is None:
                        cache.put(pc.units[u], v)
                outcomes[i] = _Outcome(pc.model, pc.spec, pc.cell_key, d["status"], units=d["units"],
                                       computed=d["computed"], error=d["error"], record=d["record"])
            except Exception as exc:  # noqa: BLE001 -- a worker that died: the cell fails, others run
                outcomes[i] = _failed(pc, exc, cache)
            if outcomes[i].status == "failed":
                log(f"cell {pc.model} {pc.spec.label} failed: {outcomes[i].error}")
            # the cell's steps not seen landing (a failure, a cache folder the driver cannot see)
            prog.advance(pc.spec.label, outcomes[i].status, max(0, steps[i] - ticked[i]))
        prog.close()
        return [outcomes[i] for i in range(len(plan))]
    finally:
        if started:
            ray.shutdown()


def run_study(config: StudyConfig, out_dir, *, ray_address: Optional[str] = None, progress: bool = True,
              plots: bool = True, log: Callable[[str], None] = print):
    """Run the grid and write ``results.csv``, ``results.md``, ``results.json`` and the
    plots (``plots/*.png``) into ``out_dir``.

    Args:
        config: the study (its ``cache``: default ``<out_dir>/cache``).
        out_dir: output folder.
        ray_address: None (this process), ``"local"`` or a Ray cluster address.
        progress: progress bar over the grid.
        plots: write the PNG plots.
        log: one-line messages.

    Returns:
        :class:`~edgeprune.study.tables.StudyTable`.
    """
    from .tables import StudyTable

    out = Path(out_dir).expanduser().resolve()
    cache = Cache(config.cache or out / "cache")
    t = time.perf_counter()
    outcomes = (run_ray(config, cache, ray_address, progress=progress, log=log) if ray_address
                else run_local(config, cache, progress=progress, log=log))
    table = StudyTable(config, outcomes, seconds=time.perf_counter() - t)
    table.write(out)
    if plots:
        from .plots import write_plots

        table.plots = write_plots(table, out / "plots")
    return table


__all__ = ["run_study", "run_local", "run_ray"]
