"""Measuring an export on this host: the worker (a fresh process importing only the runtime),
its RSS watchdog, and whether a GPU can run here.

:func:`run_worker` starts ``python -m edgeprune_devices.profiler --worker CFG OUT`` (or measures in
this process), so peak RSS is what an app embedding the runtime would see, not the
caller's torch. The worker dies with the profiler (:func:`die_with_parent`), and the
folders of profilers killed before they could clean up are removed by the next run
(:func:`remove_stale_workdirs`). :class:`RSSWatch` samples the RSS against the profile's budget and stops
the worker the moment it goes over (:data:`BUDGET_EXIT`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from edgeprune_runtime.errors import DeviceError, GenerationError, RuntimeLoadError
from edgeprune_runtime.files import pid_alive

MiB = 1024 * 1024
#: decode tokens generated at every context length of a sweep
SWEEP_NEW_TOKENS = 16
#: the isolated worker's exit code when its RSS went over the budget
BUDGET_EXIT = 3
#: the isolated worker's exit code when its parent (the profiler) was gone
PARENT_GONE_EXIT = 4
#: the worker's temporary folder: ``edgeprune-profile-<profiler pid>-*`` in the temp folder
WORKDIR_PREFIX = "edgeprune-profile-"
_PROMPT_TEXT = (
    "Small language models can run on phones, laptops and single-board computers when their "
    "weights are pruned and quantized. The runtime streams the weights from memory once per "
    "generated token, so the memory bandwidth of the device bounds the decoding speed, while "
    "the prompt is processed in one batch whose speed depends on the arithmetic throughput. "
)


def gpu_availability() -> tuple[bool, str]:
    """Whether the CUDA execution provider can run here, and why not.

    Returns:
        ``(True, "CUDAExecutionProvider on <GPU>")`` or ``(False, reason)``; never raises.
    """
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover
        return False, f"onnxruntime is not importable: {e}"
    avail = ort.get_available_providers()
    if "CUDAExecutionProvider" not in avail:
        return False, (f"not available here: onnxruntime {ort.__version__} has no CUDAExecutionProvider "
                       f"(providers: {', '.join(avail)}); install onnxruntime-gpu on a machine with an NVIDIA GPU")
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode != 0 or not out.stdout.strip():
            return False, f"not available here: nvidia-smi found no GPU ({out.stderr.strip()[:200]})"
        return True, f"CUDAExecutionProvider on {out.stdout.strip().splitlines()[0]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"not available here: no NVIDIA driver (nvidia-smi: {e})"


def _pct(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` (NaN when empty)."""
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


class RSSWatch:
    """Samples this process's RSS every ``interval`` s against ``budget`` (bytes).

    In the isolated worker (``status_path`` given) an RSS over the budget writes the
    status file and ends the process at once (exit code ``BUDGET_EXIT``), before the
    machine runs out of memory. In the caller's own process (``isolate=False``) it only
    records the excess: :meth:`check`, called between runs, raises ``DeviceError``
    (a run in progress is not interrupted)."""

    def __init__(self, budget: Optional[int], status_path: Optional[str], profile_name: str = "",
                 interval: float = 0.002):
        import psutil
        self._proc = psutil.Process()
        self.budget = budget
        self.status_path = status_path
        self.profile_name = profile_name
        self.interval = interval
        self.peak = self.rss()
        self.exceeded: Optional[int] = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        """This process's resident set size now, bytes."""
        return int(self._proc.memory_info().rss)

    def _run(self):
        while not self._stop.is_set():
            r = self.rss()
            self.peak = max(self.peak, r)
            if self.budget and r > self.budget:
                if self.status_path is None:
                    self.exceeded = max(self.exceeded or 0, r)
                else:
                    Path(self.status_path).write_text(json.dumps({"error": "memory_budget", "rss_bytes": r,
                                                                  "budget_bytes": self.budget}))
                    os._exit(BUDGET_EXIT)
            self._stop.wait(self.interval)

    def check(self) -> None:
        """Raise ``DeviceError`` if the RSS has gone over the budget (in-process mode)."""
        r = max(self.exceeded or 0, self.rss() if self.budget else 0)
        if self.budget and r > self.budget:
            raise budget_error(r, self.budget, self.profile_name)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def budget_error(rss: int, budget: int, name: str) -> DeviceError:
    """The :class:`DeviceError` of a run whose RSS (``rss`` bytes) went over the
    ``budget`` (bytes) of the profile ``name``."""
    return DeviceError(
        f"peak RSS {rss / MiB:.1f} MiB exceeded the memory budget of profile "
        f"{name!r} ({budget / MiB:.1f} MiB); the run was stopped",
        "use a smaller export (int4), shorter --prompt-len/--gen-len/--sweep, or a profile with a larger budget")


def _vm_hwm() -> int:
    """The kernel's RSS high-water mark of this process (``VmHWM``, Linux), 0 elsewhere.

    Not ``getrusage().ru_maxrss``: Linux carries that over ``exec`` from the parent, so a
    worker spawned by a large process would report the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_hwm() -> bool:
    """Reset this process's RSS high-water mark to its current RSS (Linux 4.0+: ``5`` written
    to ``/proc/self/clear_refs``), so an in-process measurement's peak is its own, not that
    of whatever the caller held before (a test session's earlier multi-GB models).
    ``False`` where the kernel does not allow it (the peak then includes the earlier one)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _prompt_ids(tokenizer, n: int, vocab: int) -> list[int]:
    """``n`` prompt ids: a fixed English text, encoded and repeated (ids below ``vocab``)."""
    ids = tokenizer.encode(_PROMPT_TEXT) if tokenizer is not None else []
    ids = [i for i in ids if 0 <= i < vocab]
    if not ids:
        ids = list(range(3, min(vocab, 200)))
    reps = n // len(ids) + 1
    return (ids * reps)[:n]


def step_labels(cfg: dict) -> list[str]:
    """What :func:`measure_export` does, one label per step it reports (load and warm-up,
    each timed run, each mask of an IG-Pruning export and all kept, each sweep context):
    the progress bar's steps."""
    n = int(cfg["repeat"])
    return (["load + warm-up"] + [f"run {i + 1}/{n}" for i in range(n)]
            + [f"mask {k}" for k in range(int(cfg.get("masks") or 0))]
            + (["all sub-blocks kept"] if cfg.get("masks") else [])
            + [f"context {int(c)}" for c in cfg.get("sweep") or []]
            + (["operator profile"] if cfg.get("ops") else []))


def _step_rate(step_ms: list) -> tuple[float, float]:
    """``(median ms, tokens/s at that median)`` of decode-step latencies ``step_ms`` (ms);
    ``(nan, 0.0)`` when there are none."""
    med = float(np.median(step_ms)) if step_ms else float("nan")
    return med, (1000.0 / med if med > 0 else 0.0)


def _kv_total(sess, tokens: int, **kw) -> int:
    """K + V bytes of ``sess``'s cache holding ``tokens`` positions."""
    kv = sess.kv_cache_bytes(tokens, **kw)
    return int(kv["k"] + kv["v"])


def _per_mask(sess, ids: list, gen_len: int, repeat: int, watch: "RSSWatch", step: Callable[[], None]) -> list:
    """Each mask of an IG-Pruning export forced in turn, then every sub-block kept (the
    same graph, nothing bypassed): ``repeat`` generations each, no routing.

    Returns:
        ``[{"mask", "kept_attention", "kept_mlp", "sub_blocks", "decode_step_ms",
        "decode_tok_s", "ttft_ms", "kv_bytes"}]``; ``mask`` is the index into the
        export's masks, or ``"all"``; ``kv_bytes`` (K + V) holds ``len(ids) + gen_len - 1``
        tokens under that mask (a bypassed attention sub-block holds none).
    """
    n = sess.masks.shape[1]
    rows = []
    for label, m in [(k, sess.masks[k]) for k in range(len(sess.masks))] + [("all", np.ones(n, bool))]:
        ttft, steps = [], []
        with sess.using_mask(m):
            for _ in range(repeat):
                r = sess.generate(ids, max_new_tokens=gen_len)
                watch.check()
                ttft.append(r.ttft_ms)
                steps.extend(r.step_ms)
        med, rate = _step_rate(steps)
        rows.append({"mask": label, "kept_attention": int(m[0::2].sum()), "kept_mlp": int(m[1::2].sum()),
                     "sub_blocks": int(n), "decode_step_ms": med, "decode_tok_s": rate,
                     "ttft_ms": float(np.median(ttft)),
                     "kv_bytes": _kv_total(sess, len(ids) + gen_len - 1, mask=m)})
        step()
    return rows


def measure_export(cfg: dict, on_step: Optional[Callable[[], None]] = None) -> dict:
    """Run the measurements of one profile (called in the worker process).

    Args:
        cfg: ``folder``, ``device``, ``threads``, ``prompt_len``, ``gen_len``, ``repeat``,
            ``sweep`` (context lengths), ``max_length``, ``budget_bytes``,
            ``profile_name``, ``status_path`` (isolated worker only), ``ops`` (also trace one
            more generation with onnxruntime's profiler, in a session of its own loaded
            after the timed runs and the memory readings, which it does not affect),
            ``masks`` (an IG-Pruning export's mask count, for the progress steps).
        on_step: called after each step of :func:`step_labels` (progress).

    Returns:
        The measured figures (``ProfileReport.measured``, plus ``sweep`` rows; with
        ``ops``, ``ops``: :func:`~devices.profiler.ops.op_breakdown` of that generation;
        for an IG-Pruning export, ``route`` (the timed runs' routing: ``cluster``,
        ``router_ms``) and ``masks``, :func:`_per_mask`'s rows, measured after the timed
        runs and the headline peak RSS).

    Raises:
        DeviceError: the RSS went over ``budget_bytes`` (in-process mode).
        RuntimeLoadError, GenerationError: as ``runtime.load`` / ``Session.generate``.
    """
    import edgeprune_runtime as runtime

    _reset_hwm()
    with RSSWatch(cfg.get("budget_bytes"), cfg.get("status_path"), cfg.get("profile_name", "")) as watch:
        rss_start = watch.rss()
        sess = runtime.load(cfg["folder"], device=cfg["device"], threads=cfg["threads"],
                            max_length=cfg.get("max_length"))
        rss_loaded = watch.rss()
        watch.check()
        # Every run must produce exactly gen_len tokens: disable the end-of-sequence stop.
        if hasattr(sess, "eos_token_ids"):
            sess.eos_token_ids = []
        P, G = int(cfg["prompt_len"]), int(cfg["gen_len"])
        ids = _prompt_ids(sess.tokenizer, P, int(sess.vocab_size))
        sess.generate(ids[: max(1, min(P, 16))], max_new_tokens=min(4, G))  # warm-up
        step = on_step or (lambda: None)
        step()
        ttft, prefill, steps, decode_runs = [], [], [], []
        for _ in range(int(cfg["repeat"])):
            r = sess.generate(ids, max_new_tokens=G)
            watch.check()
            ttft.append(r.ttft_ms)
            prefill.append(r.prefill_tok_s)
            steps.extend(r.step_ms)
            decode_runs.append(r.decode_tok_s)
            step()
        # the headline peak is this setting's own (the sweep's longer contexts come after)
        peak = max(watch.peak, _vm_hwm())
        route = dict(sess.last_route or {}) if hasattr(sess, "using_mask") else None
        if route:
            route.pop("mask", None)
        masks = _per_mask(sess, ids, G, int(cfg["repeat"]), watch, step) if route is not None else None
        sweep = []
        for c in cfg.get("sweep") or []:
            r = sess.generate(_prompt_ids(sess.tokenizer, int(c), int(sess.vocab_size)), max_new_tokens=SWEEP_NEW_TOKENS)
            watch.check()
            st, rate = _step_rate(r.step_ms)
            sweep.append({"context": int(c), "decode_step_ms": st, "decode_tok_s": rate,
                          "rss_bytes": watch.rss(), "ttft_ms": r.ttft_ms,
                          "kv_bytes": _kv_total(sess, int(c) + SWEEP_NEW_TOKENS - 1)})
            step()
        kv = sess.kv_cache_bytes(P + G - 1)      # the last new token is never fed back
        weights = int(sess.weights_bytes)
        sess.close()
    sweep_peak = max(watch.peak, _vm_hwm()) if sweep else None
    ops = _op_profile(cfg, ids, G) if cfg.get("ops") else None
    if ops is not None:
        step()
    (med, rate), p90 = _step_rate(steps), _pct(steps, 90)
    return {
        "ttft_ms": {"median": float(np.median(ttft)), "p90": _pct(ttft, 90), "runs": ttft},
        "prefill_tok_s": {"median": float(np.median(prefill)), "p90": _pct(prefill, 10), "runs": prefill},
        "decode_step_ms": {"median": med, "p90": p90},
        "decode_tok_s": {"median": rate, "p90": 1000.0 / p90, "runs": decode_runs,
                         "basis": "median / p90: at the median / p90 latency of all decode steps "
                                  "of all runs; runs: each run's mean rate (new tokens - 1 over "
                                  "its decode time)"},
        "peak_rss_bytes": peak, "rss_start_bytes": rss_start, "rss_loaded_bytes": rss_loaded,
        "weights_bytes": weights, "kv_bytes": {"k": int(kv["k"]), "v": int(kv["v"])},
        "final_length": P + G, "kv_tokens": P + G - 1, "sweep": sweep, "budget_bytes": cfg.get("budget_bytes"),
        "sweep_peak_rss_bytes": sweep_peak, **({"ops": ops} if ops is not None else {}),
        **({"route": route, "masks": masks} if masks is not None else {}),
    }


def _op_profile(cfg: dict, ids: list, new_tokens: int) -> dict:
    """One warm-up and one generation of ``new_tokens`` in a session traced by onnxruntime's
    profiler; the breakdown of its steps by operator type (:mod:`devices.profiler.ops`).
    The trace goes to a temporary folder, removed afterwards."""
    import edgeprune_runtime as runtime

    from .ops import op_breakdown

    tmp = Path(tempfile.mkdtemp(prefix="edgeprune-ops-"))
    try:
        sess = runtime.load(cfg["folder"], device=cfg["device"], threads=cfg["threads"],
                            max_length=cfg.get("max_length"), profile_prefix=tmp / "ort")
        try:
            if hasattr(sess, "eos_token_ids"):
                sess.eos_token_ids = []
            sess.generate(ids[: max(1, min(len(ids), 16))], max_new_tokens=2)
            sess.generate(ids, max_new_tokens=new_tokens)
            trace = sess.end_profiling()
        finally:
            sess.close()
        return op_breakdown(trace, decode_steps=new_tokens - 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_worker(cfg: dict, isolate: bool, timeout: float,
               on_step: Optional[Callable[[], None]] = None) -> dict:
    """:func:`measure_export` of ``cfg`` in a fresh ``python -m edgeprune_devices.profiler --worker``
    process (``isolate``; abandoned after ``timeout`` seconds), or in this one.
    ``on_step`` is called here after each step the measurement reports (:func:`step_labels`).

    Raises:
        DeviceError: the worker went over the memory budget, timed out or failed.
        RuntimeLoadError, GenerationError: raised in the worker, raised again here.
    """
    if not isolate:
        return measure_export(cfg, on_step)
    remove_stale_workdirs()
    with tempfile.TemporaryDirectory(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-") as td:
        cfg = dict(cfg, status_path=str(Path(td) / "status.json"), parent_pid=os.getpid(),
                   progress_path=str(Path(td) / "progress"))
        cfg_path, out_path = Path(td) / "cfg.json", Path(td) / "out.json"
        cfg_path.write_text(json.dumps(cfg))
        env = dict(os.environ)
        log = Path(td) / "worker.log"
        with open(log, "w") as log_f:
            proc = subprocess.Popen([sys.executable, "-m", "edgeprune_devices.profiler", "--worker", str(cfg_path),
                                     str(out_path)], stdout=log_f, stderr=subprocess.STDOUT, text=True, env=env)
            _wait_worker(proc, timeout, Path(cfg["progress_path"]), on_step)
        if proc.returncode == BUDGET_EXIT and Path(cfg["status_path"]).exists():
            st = json.loads(Path(cfg["status_path"]).read_text())
            raise budget_error(st["rss_bytes"], st["budget_bytes"], cfg["profile_name"])
        if proc.returncode != 0 or not out_path.exists():
            tail = log.read_text(errors="replace").strip().splitlines()[-12:]
            err = json.loads(out_path.read_text()) if out_path.exists() else {}
            if err.get("error_class") in ("GenerationError", "RuntimeLoadError", "DeviceError"):
                cls = {"GenerationError": GenerationError, "RuntimeLoadError": RuntimeLoadError,
                       "DeviceError": DeviceError}[err["error_class"]]
                raise cls(err["message"], err.get("hint"))
            raise DeviceError("the profiling worker failed: " + " | ".join(tail)[-800:],
                              "run `python -m edgeprune_devices.profiler --worker` by hand to see the full error")
        return json.loads(out_path.read_text())


def _wait_worker(proc: subprocess.Popen, timeout: float, progress_path: Path,
                 on_step: Optional[Callable[[], None]]) -> None:
    """Wait for the worker, calling ``on_step`` for each line it adds to
    ``progress_path``; the worker is killed on a timeout or an interrupt.

    Raises:
        DeviceError: the worker ran past ``timeout`` seconds.
    """
    deadline, seen = time.monotonic() + timeout, 0
    try:
        while True:
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if on_step is not None and progress_path.exists():
                done = progress_path.read_text().count("\n")
                for _ in range(done - seen):
                    on_step()
                seen = max(seen, done)
            if proc.returncode is not None:
                return
            if time.monotonic() > deadline:
                raise DeviceError(f"the profiling run did not finish within {timeout:.0f} s",
                                  "lower --repeat / --gen-len / the sweep, or raise the timeout")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def remove_stale_workdirs(root: Optional[Path] = None) -> list[Path]:
    """Remove the worker folders (``edgeprune-profile-PID-*`` in the temp folder, or
    ``root``) of profiler processes that are gone (killed before they could clean up);
    only this user's. Returns what was removed."""
    root = Path(root or tempfile.gettempdir())
    gone = []
    for p in root.glob(f"{WORKDIR_PREFIX}*"):
        pid = p.name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        try:
            mine = p.is_dir() and not p.is_symlink() and p.stat().st_uid == os.getuid()
        except (OSError, AttributeError):
            continue
        if mine and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def die_with_parent(parent_pid: int, workdir: Path, interval: float = 0.1) -> threading.Thread:
    """Start a daemon thread that ends this (worker) process, after removing ``workdir``,
    as soon as its parent ``parent_pid`` is gone (killed, even with SIGKILL): a killed
    ``edgeprune profile`` leaves no worker measuring on and no folder behind.
    Exit code :data:`PARENT_GONE_EXIT`."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(interval)
        shutil.rmtree(workdir, ignore_errors=True)
        os._exit(PARENT_GONE_EXIT)

    t = threading.Thread(target=watch, name="die-with-parent", daemon=True)
    t.start()
    return t


def worker_main(argv: list[str]) -> int:
    """The worker process: ``argv = [CFG.json, OUT.json]``; writes the figures (or the
    error's class, message and hint) to ``OUT.json``; returns the exit code. It ends with
    its parent (:func:`die_with_parent`)."""
    cfg_path, out_path = argv
    cfg = json.loads(Path(cfg_path).read_text())
    if cfg.get("parent_pid"):
        die_with_parent(int(cfg["parent_pid"]), Path(cfg_path).parent)
    progress = cfg.get("progress_path")

    def step():
        if progress:
            with open(progress, "a") as f:
                f.write("step\n")

    try:
        res = measure_export(cfg, step)
    except (GenerationError, RuntimeLoadError, DeviceError) as e:
        Path(out_path).write_text(json.dumps({"error_class": type(e).__name__, "message": e.message, "hint": e.hint}))
        return 1
    Path(out_path).write_text(json.dumps(res))
    return 0


__all__ = ["RSSWatch", "run_worker", "measure_export", "step_labels", "worker_main", "gpu_availability", "budget_error",
           "remove_stale_workdirs", "die_with_parent", "SWEEP_NEW_TOKENS", "BUDGET_EXIT",
           "PARENT_GONE_EXIT", "WORKDIR_PREFIX"]
