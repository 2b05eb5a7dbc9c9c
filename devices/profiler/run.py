"""The profiler's entry point: :func:`profile` checks its arguments, measures, projects, reports."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from edgeprune_runtime.errors import DeviceError, GenerationError, RuntimeLoadError
from edgeprune_runtime.variants import variant_records

from ..catalog import load_profile
from . import measure
from .measure import SWEEP_NEW_TOKENS, gpu_availability, step_labels
from .project import host_profile, project_target
from .report import MiB, ProfileReport, model_name
from .work import model_work

#: context lengths of ``sweep=True`` (those that fit the export's max length; never longer)
DEFAULT_SWEEP = (128, 256, 512, 1024, 2048)
#: prefix of the temporary folder a sweep plot goes to without ``out_dir``
PLOT_DIR_PREFIX = "edgeprune-sweep-"


def check_profile_args(prompt_len, gen_len, repeat, threads=None) -> None:
    """The counts :func:`profile` takes: ``prompt_len >= 1``, ``gen_len >= 2`` (a decode
    speed needs two new tokens), ``repeat >= 1``, ``threads >= 1`` (or ``None``), all
    integers. Cheap: callers run it before minutes of other work.

    Raises:
        GenerationError: naming the count and a value to pass.
    """
    counts = [("prompt_len", prompt_len, 1), ("gen_len", gen_len, 2), ("repeat", repeat, 1)]
    for name, v, lo in counts + ([("threads", threads, 1)] if threads is not None else []):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise GenerationError(f"{name} must be an integer >= {lo}, got {v!r}"
                                  + (" (decode speed needs at least two new tokens)" if lo == 2 else ""),
                                  f"pass e.g. --{name.replace('_', '-')} {({'repeat': 5, 'threads': 2}).get(name, 128)}")


def profile(folder: Union[str, Path], profile_name_or_obj: Any = "cpu-host", prompt_len: int = 128,
            gen_len: int = 128, repeat: int = 5, sweep: Union[None, bool, Sequence[int]] = None,
            targets: Optional[Sequence[str]] = None, out_dir: Union[str, Path, None] = None,
            isolate: bool = True, timeout: float = 1800.0, threads: Optional[int] = None,
            progress: bool = False, ops: bool = False) -> ProfileReport:
    """Measure ``folder`` on this host under a device profile and project to targets.

    Args:
        folder: an export folder (``model.onnx``, ``edgeprune.json``, tokenizer files).
        profile_name_or_obj: a profile name (``"raspberry-pi-5"``), a ``.toml`` path or a
            ``devices.DeviceProfile``. Its thread count (capped at this machine's cores)
            and memory budget apply to the measured run; GPU profiles run on
            ``CUDAExecutionProvider`` when available, else on the host CPU with
            ``report.gpu["reason"]`` saying why.
        prompt_len: prompt tokens (batch 1).
        gen_len: new tokens per run (end-of-sequence is ignored so every run makes ``gen_len``).
        repeat: timed runs (after one warm-up).
        sweep: context lengths for the latency/memory sweep (``True``:
            :data:`DEFAULT_SWEEP`, 128..2048, those that fit the export's max length);
            ``None``/``False``: no sweep.
        targets: profile names to project to (default: the chosen profile when it is not
            the host, else none: projections are made only for profiles asked for).
        out_dir: where the sweep PNG goes (default: a new temporary folder
            ``edgeprune-sweep-*``, named in the report's notes); nothing else is written.
        isolate: measure in a fresh subprocess importing only the runtime (True; False
            runs in this process: RSS then includes the caller's memory, and the memory
            budget is checked between runs, raising ``DeviceError``, where the isolated
            worker is stopped the moment it goes over).
        timeout: seconds before the worker is abandoned.
        threads: run with this many threads instead of the profile's (noted in the report).
        progress: show a progress bar (tqdm, on stderr) over load + warm-up, the timed
            runs and the sweep's contexts.
        ops: also break a decode step down by operator type (onnxruntime's profiler over
            one more generation, in a session loaded after the timed runs and memory
            readings; ``measured["ops"]``, :func:`devices.profiler.ops.op_breakdown`).

    Returns:
        :class:`ProfileReport`.

    Raises:
        DeviceError: unknown profile, the run exceeding the profile's memory budget,
            a failed/timed-out worker.
        RuntimeLoadError: the folder is missing or incomplete.
        GenerationError: ``prompt_len + gen_len`` does not fit the export's context.
    """
    t0 = time.perf_counter()
    folder = Path(folder)
    if not (folder / "model.onnx").is_file():
        raise RuntimeLoadError(f"{folder} has no model.onnx", "pass the folder written by `edgeprune export`")
    check_profile_args(prompt_len, gen_len, repeat, threads)
    if sweep not in (None, True, False) and (
            not isinstance(sweep, (list, tuple)) or not all(
                isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in sweep)):
        raise GenerationError(f"sweep must be True or a list of context lengths, got {sweep!r}",
                              "pass e.g. sweep=[128, 512, 1024] (CLI: --sweep 128,512,1024, or --sweep alone for the default list)")
    prof = load_profile(profile_name_or_obj, measure=False)
    # target profiles loaded now: a typo fails before the measurement, not after it
    if targets is None:     # projections only for the profile named, never by default for the host
        tgts = [prof] if not prof.is_host else []
    else:
        tgts = [load_profile(n, measure=False) for n in targets]
    try:
        meta = json.loads((folder / "edgeprune.json").read_text())
    except (OSError, ValueError):
        meta = {}
    export_max = int(meta.get("max_length") or 2048)
    notes: list[str] = ["Timings measured on a shared machine are noisy; compare runs made side by side."]
    cores = os.cpu_count() or 1
    gpu = None
    device = "cpu"
    asked = None if threads is None else int(threads)
    threads = int(prof.threads if asked is None else asked)
    if prof.execution_provider == "CUDAExecutionProvider":
        ok, reason = gpu_availability()
        gpu = {"available": ok, "reason": reason}
        if ok:
            device = "cuda"
        else:
            threads = cores if asked is None else asked   # the host CPU stands in for the GPU
            notes.append(f"{prof.name}: {reason}. Measured figures are from the host CPU; the GPU column is projected only.")
    if device == "cpu" and threads > cores:
        who = f"--threads {asked} asks for" if asked is not None else f"{prof.name} runs"
        notes.append(f"{who} {threads} threads; this host has {cores} cores, so {cores} were used.")
        threads = cores
    elif asked is not None and asked != int(prof.threads) and \
            prof.execution_provider != "CUDAExecutionProvider":      # (GPU profiles: no CPU threads)
        notes.append(f"threads set to {asked} (the profile {prof.name} says {prof.threads}).")
    if sweep is True:
        sweep_list = [c for c in DEFAULT_SWEEP if c + SWEEP_NEW_TOKENS <= export_max] or \
            ([export_max - SWEEP_NEW_TOKENS] if export_max > SWEEP_NEW_TOKENS else [])
    elif sweep:
        sweep_list = sorted({int(c) for c in sweep})
        bad = [c for c in sweep_list if c < 1 or c + SWEEP_NEW_TOKENS > export_max]
        if bad:
            raise GenerationError(f"sweep contexts {bad} do not fit the export's max_length={export_max} "
                                  f"(+{SWEEP_NEW_TOKENS} decode tokens)", f"use contexts <= {export_max - SWEEP_NEW_TOKENS}")
    else:
        sweep_list = []
    # the last new token is sampled, never fed back: prompt + new - 1 tokens are cached
    need = max([prompt_len + gen_len - 1] + [c + SWEEP_NEW_TOKENS - 1 for c in sweep_list])
    if need > export_max:
        raise GenerationError(f"prompt_len + gen_len - 1 = {prompt_len + gen_len - 1} cached tokens exceed the "
                              f"export's max_length={export_max}",
                              f"lower --prompt-len/--gen-len to fit {export_max} tokens, or re-export with "
                              "`edgeprune export --max-length`")
    cfg = {"folder": str(folder), "device": device, "threads": threads, "prompt_len": int(prompt_len),
           "gen_len": int(gen_len), "repeat": int(repeat), "sweep": sweep_list, "max_length": need,
           "budget_bytes": int(prof.memory_budget_bytes), "profile_name": prof.name, "ops": bool(ops),
           "masks": len((variant_records(meta).get("igprune") or {}).get("masks") or [])}
    measured = _measure(cfg, isolate, timeout, progress)
    if measured["peak_rss_bytes"] > prof.memory_budget_bytes:
        raise DeviceError(f"peak RSS {measured['peak_rss_bytes'] / MiB:.1f} MiB exceeded the memory budget of profile "
                          f"{prof.name!r} ({prof.memory_budget_bytes / MiB:.1f} MiB)",
                          "use a smaller export (int4), shorter --prompt-len/--gen-len, or a profile with a larger budget")
    sweep_rows = measured.pop("sweep")
    ran_on = (f"{prof.name} GPU, CUDAExecutionProvider" if device == "cuda"
              else f"this host, {threads} thread{'s' if threads > 1 else ''}, CPUExecutionProvider")
    # ---- projection (roofline), labelled as such
    work = model_work(folder)
    host, host_fig = host_profile(threads)
    projected = {}
    if device == "cpu":
        for tgt in tgts:
            if tgt.is_host:
                if targets is not None:
                    notes.append(f"{tgt.name} is this machine: its figures are the measured column, not a projection.")
                continue
            projected[tgt.name] = project_target(measured, sweep_rows, work, host, tgt, prompt_len, gen_len)
    elif targets is not None:
        notes.append("Ran on the GPU: no projected columns (the roofline scaling is calibrated on the host CPU); "
                     "profile on cpu-host to project to " + ", ".join(t.name for t in tgts) + ".")
    report = ProfileReport(folder=str(folder), profile=prof.to_dict(), ran_on=ran_on,
                           settings={"prompt_len": int(prompt_len), "gen_len": int(gen_len), "repeat": int(repeat),
                                     "threads": threads, "device": device, "isolated": bool(isolate),
                                     "seconds": round(time.perf_counter() - t0, 2)},
                           measured=measured, projected=projected, work=work,
                           host={k: host_fig[k] for k in ("bandwidth_gbs", "peak_fp32_gflops", "peak_int8_gops")},
                           sweep=sweep_rows, gpu=gpu, notes=notes, model=model_name(meta, folder))
    if sweep_rows:
        if out_dir is None:
            out = Path(tempfile.mkdtemp(prefix=PLOT_DIR_PREFIX))
            notes.append(f"The sweep plot went to the temporary folder {out} (pass --out to choose the folder).")
        else:
            out = Path(out_dir)
        report.plot(out / f"sweep-{folder.name}-{prof.name}.png")
    return report


def _measure(cfg: dict, isolate: bool, timeout: float, progress: bool) -> dict:
    """:func:`~devices.profiler.measure.run_worker`, with a tqdm bar over its steps when
    ``progress`` (its description names the step running)."""
    if not progress:
        return measure.run_worker(cfg, isolate, timeout)
    from tqdm.auto import tqdm

    labels = step_labels(cfg)
    with tqdm(total=len(labels), desc=f"profile: {labels[0]}", unit="step", leave=False) as bar:
        def step():
            bar.update(1)
            if bar.n < len(labels):
                bar.set_description(f"profile: {labels[bar.n]}")

        return measure.run_worker(cfg, isolate, timeout, step)


__all__ = ["profile", "check_profile_args", "DEFAULT_SWEEP", "PLOT_DIR_PREFIX"]
