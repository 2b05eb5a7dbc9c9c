"""What every bench script shares: paths, peer virtualenvs, our cached exports, one JSON writer.

A bench imports it as ``import benchlib``: ``python bench/X.py`` puts ``bench/`` first on
the module search path, and edgeprune / exporters / runtime / devices come from the project
venv's editable install, so no script edits the search path. A worker a bench starts in a fresh
process (perhaps in a peer's virtualenv) gets the repository root through ``PYTHONPATH``
(:func:`worker_env`). This module imports only the standard library at load time, because
bench scripts also run as workers inside peer virtualenvs that have none of our packages.

Records. Every bench writes, with ``--json PATH``, a JSON list of records with exactly the
fields ``{"case", "metric", "ours", "peer", "theirs"}``: ``metric`` names carry their unit
(``decode_tok_s``, ``peak_rss_mib``, ``ppl``, ``kl_nats``); ``ours`` / ``theirs`` are numbers
or null; ``peer`` names the peer tool or is null. A failure or a remark is a record of its
own with metric ``error`` or ``note`` and the text as its value, so nothing is hidden and
every record keeps the same shape. :func:`write_records` checks all of it, then writes
atomically; ``bench/report.py`` turns ``bench/results/*.json`` into ``docs/benchmarks.md``.

Command line (set-up ahead of a bench run)::

    python bench/benchlib.py peers [llamacpp ortgenai llmcompressor]   # build peer venvs
    python bench/benchlib.py export rtn-g32 bench/.cache/smollm2-int4  # one of our exports
    python bench/benchlib.py export rtn-g64 bench/.cache/gemma3-270m-int4-rtn-g64 --model gemma3-270m
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import numbers
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
CACHE = BENCH / ".cache"                # git-ignored: exports, peer results, logs
RESULTS = BENCH / "results"             # committed: the JSON that docs/benchmarks.md is made from
# evaluation data the benches read (never the product): ../shared/data, see its SOURCES.md
SHARED = Path(os.environ.get("EDGEPRUNE_SHARED", ROOT.parent / "shared"))
C4 = SHARED / "data" / "c4" / "c4_validation_2k.parquet"
WIKI = SHARED / "data" / "wikitext2" / "wiki.test.raw"

# ---------------------------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------------------------

RECORD_FIELDS = ("case", "metric", "ours", "peer", "theirs")
TEXT_METRICS = ("error", "note")        # the only metrics whose values may be text
# the peer tools (the README's results table lists these; other peers are A/B baselines)
PEER_TOOLS = ("llama.cpp", "onnxruntime-genai", "llm-compressor")


class RecordError(ValueError):
    """A bench record does not have the shape ``{case, metric, ours, peer, theirs}``."""


def record(case: str, metric: str, ours=None, *, peer: Optional[str] = None, theirs=None) -> dict:
    """One record ``{"case", "metric", "ours", "peer", "theirs"}`` (checked when written)."""
    return {"case": case, "metric": metric, "ours": ours, "peer": peer, "theirs": theirs}


def error_record(case: str, message: str, *, peer: Optional[str] = None,
                 side: str = "theirs") -> dict:
    """A failure kept as a record: metric ``error``, ``message`` on the failing ``side``
    (``"ours"`` or ``"theirs"``)."""
    if side not in ("ours", "theirs"):
        raise RecordError(f"side={side!r} is not 'ours' or 'theirs'")
    rec = record(case, "error", peer=peer)
    rec[side] = str(message)
    return rec


def note_record(case: str, text: str, *, peer: Optional[str] = None) -> dict:
    """A remark on a case (e.g. ``peer result reused from the cache``): metric ``note``."""
    return record(case, "note", str(text), peer=peer)


def _value(v, where: str, field: str, text_ok: bool):
    if v is None:
        return None
    if isinstance(v, str):
        if text_ok:
            return v
        raise RecordError(f"{where}: {field} is text ({v[:60]!r}) but the metric is numeric "
                          f"(fix: put a failure in its own error_record(), or use metric "
                          f"{' / '.join(TEXT_METRICS)})")
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise RecordError(f"{where}: {field} is a {type(v).__name__}, not a number or null "
                          "(fix: convert it with float() or int())")
    v = int(v) if isinstance(v, numbers.Integral) else float(v)
    if isinstance(v, float) and not math.isfinite(v):
        raise RecordError(f"{where}: {field} is {v}, which JSON cannot hold "
                          "(fix: record null and an error_record() saying why)")
    return v


def validate_record(rec, index: Optional[int] = None) -> dict:
    """Check one record and return it with plain Python numbers (numpy scalars converted).

    Raises:
        RecordError: not a dict; a field missing or extra; ``case`` / ``metric`` not a
            non-empty string (no whitespace in ``metric``); ``peer`` neither null nor a
            string; ``ours`` / ``theirs`` not a finite number or null (text only for the
            metrics ``error`` and ``note``). The message names the record and the fix.
    """
    where = f"record {index}" if index is not None else "record"
    if not isinstance(rec, dict):
        raise RecordError(f"{where} is a {type(rec).__name__}, not a dict "
                          f"(fix: build it with benchlib.record())")
    where += f" (case {rec.get('case')!r}, metric {rec.get('metric')!r})"
    missing = [f for f in RECORD_FIELDS if f not in rec]
    extra = sorted(set(rec) - set(RECORD_FIELDS))
    if missing or extra:
        raise RecordError(f"{where}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) +
            ([f"extra {', '.join(extra)}"] if extra else [])) +
            f" (fix: exactly {', '.join(RECORD_FIELDS)}; a failure or remark is its own "
            "error_record() / note_record(), a second figure its own metric)")
    for f in ("case", "metric"):
        if not isinstance(rec[f], str) or not rec[f].strip():
            raise RecordError(f"{where}: {f} must be a non-empty string")
    if any(c.isspace() for c in rec["metric"]):
        raise RecordError(f"{where}: metric {rec['metric']!r} has whitespace "
                          "(fix: snake_case with its unit, e.g. decode_tok_s)")
    if rec["peer"] is not None and (not isinstance(rec["peer"], str) or not rec["peer"]):
        raise RecordError(f"{where}: peer must be a tool name or null")
    text_ok = rec["metric"] in TEXT_METRICS
    return {"case": rec["case"], "metric": rec["metric"],
            "ours": _value(rec["ours"], where, "ours", text_ok), "peer": rec["peer"],
            "theirs": _value(rec["theirs"], where, "theirs", text_ok)}


def write_records(path, records: Iterable[dict]) -> Path:
    """Check every record (:func:`validate_record`) and write them as a JSON list,
    atomically (``runtime.files.atomic_write``); prints where it wrote.

    Returns:
        The path written.

    Raises:
        RecordError: a record has the wrong shape. Nothing is written to ``path``; the
            records as given are saved beside it as ``<path>.invalid`` (so a long run's
            figures survive a bug in its last lines) and the message names that file.
    """
    from edgeprune_runtime.files import atomic_write

    records = list(records)
    try:
        checked = [validate_record(r, i) for i, r in enumerate(records)]
    except RecordError as e:
        keep = Path(f"{path}.invalid")
        try:
            atomic_write(keep, json.dumps(records, indent=1, default=str))
            raise RecordError(f"{e}; nothing written to {path}, the records are in {keep}") from None
        except OSError:
            raise e from None
    out = atomic_write(path, json.dumps(checked, indent=1) + "\n")
    print(f"wrote {len(checked)} records to {out}", flush=True)
    return out


def read_records(path) -> list[dict]:
    """The records of a results file, each checked by :func:`validate_record`.

    Raises:
        RecordError: the file is not a JSON list of valid records (the message names it).
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:
        raise RecordError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise RecordError(f"{path} holds a {type(data).__name__}, not a list of records")
    try:
        return [validate_record(r, i) for i, r in enumerate(data)]
    except RecordError as e:
        raise RecordError(f"{path}: {e}") from None


def add_common_args(parser: argparse.ArgumentParser, quick_help: str) -> argparse.ArgumentParser:
    """Add the options every bench has: ``--json PATH`` (the records, see
    :func:`write_records`) and ``--quick`` (``quick_help`` says what it runs; every
    ``--quick`` finishes in under 10 minutes on 2 cores once the peer venvs exist)."""
    parser.add_argument("--json", type=Path, metavar="PATH", default=None,
                        help="write the records here ({case, metric, ours, peer, theirs}), "
                             "e.g. bench/results/<script>.json")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


# ---------------------------------------------------------------------------------------------
# subprocesses and peer virtualenvs
# ---------------------------------------------------------------------------------------------

#: import name -> folder of this checkout (the folders keep their short names; the import
#: names are namespaced, see pyproject.toml's package-dir)
IMPORT_NAMES = {"edgeprune": "edgeprune", "edgeprune_exporters": "exporters",
                "edgeprune_runtime": "runtime", "edgeprune_devices": "devices"}


def import_root() -> Path:
    """``bench/.cache/import-root``: one symbolic link per import name of ours to its folder,
    so a worker in a virtualenv without our install (a peer's) imports this checkout."""
    root = CACHE / "import-root"
    root.mkdir(parents=True, exist_ok=True)
    for name, folder in IMPORT_NAMES.items():
        link = root / name
        if not link.is_symlink():
            link.symlink_to(ROOT / folder, target_is_directory=True)
    return root


def worker_env(**extra: str) -> dict:
    """The environment of a worker process: this one's, with :func:`import_root` and the
    repository root first on ``PYTHONPATH`` (how a worker in any virtualenv imports the
    repo's packages and the bench modules) and ``extra`` variables set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(import_root()), str(ROOT),
                                                    env.get("PYTHONPATH", "")) if p)
    env.update({k: str(v) for k, v in extra.items()})
    return env


TORCH_PIN = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# peer venvs: name -> (packages installed after torch, module whose import proves it ready,
# extra environment for pip). llama-cpp-python is built from source: ~13 min on 2 cores.
PEER_VENVS = {
    "llamacpp": (["llama-cpp-python", "numpy", "psutil"], "llama_cpp",
                 {"CMAKE_BUILD_PARALLEL_LEVEL": "2"}),
    # onnx-ir: onnxruntime-genai's model builder (`python -m onnxruntime_genai.models.builder`)
    "ortgenai": (["onnxruntime-genai", "transformers", "onnx", "onnx-ir", "onnxruntime", "numpy",
                  "psutil", "safetensors"], "onnxruntime_genai, onnx_ir", {}),
    # Optimum's ORTModelForCausalLM (optimum-onnx 0.1.0 pins transformers < 4.58 and
    # optimum ~= 2.1: kept out of the project's venv)
    "optimum": (["optimum-onnx[onnxruntime]==0.1.0", "numpy"], "optimum.onnxruntime", {}),
    "llmcompressor": (["llmcompressor==0.14.0.1"], "llmcompressor", {}),
    # Intel's AutoRound (SignRound), compare_methods.py's signround case (issue 28)
    "autoround": (["auto-round==0.16.1"], "auto_round", {}),
}


def edgeprune_cli(*args: str) -> None:
    """Run ``edgeprune ARGS...`` (this venv's console script) in a child process.

    Raises:
        subprocess.CalledProcessError: the command exited non-zero."""
    subprocess.run([str(Path(sys.executable).with_name("edgeprune")), *args], check=True)


def venv_python(name: str) -> Path:
    """Path of the python interpreter of the peer venv ``ROOT/.venv-<name>``."""
    return ROOT / f".venv-{name}" / "bin" / "python"


def ensure_venv(name: str, packages: Sequence[str], *, check_import: Optional[str] = None,
                log: Optional[Path] = None, env: Optional[dict] = None) -> Path:
    """Create ``.venv-<name>`` (if missing) and install ``torch==2.13.0`` then ``packages``.

    torch goes first, from the local / CPU wheel, so that an unpinned dependency never pulls
    a multi-GB CUDA build (``../shared/PEERS.md``).

    Args:
        name: peer short name; the venv is ``ROOT/.venv-<name>`` (git-ignored).
        packages: pip requirement strings installed after torch.
        check_import: module whose import proves the venv ready (then pip is skipped).
        log: file receiving pip's output (appended).
        env: extra environment for pip (e.g. ``CMAKE_BUILD_PARALLEL_LEVEL``).

    Returns:
        The venv's python path.

    Raises:
        RuntimeError: venv creation or a pip install failed (see ``log``).
    """
    py = venv_python(name)
    if check_import and py.exists():
        if subprocess.run([str(py), "-c", f"import {check_import}"],
                          capture_output=True).returncode == 0:
            return py
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "a") if log else subprocess.DEVNULL
    e = {**os.environ, **(env or {})}
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(py.parent.parent)],
                           check=True, stdout=out, stderr=out)
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check"]
        r = subprocess.run(pip + [TORCH_PIN], stdout=out, stderr=out, env=e)
        if r.returncode:
            r = subprocess.run(pip + ["--index-url", CPU_INDEX, TORCH_PIN], stdout=out, stderr=out, env=e)
        if r.returncode:
            raise RuntimeError(f"installing {TORCH_PIN} into .venv-{name} failed (see {log})")
        r = subprocess.run(pip + [TORCH_PIN, *packages], stdout=out, stderr=out, env=e)
        if r.returncode:
            raise RuntimeError(f"installing {list(packages)} into .venv-{name} failed (see {log})")
    finally:
        if log:
            out.close()
    return py


#: llama.cpp's CPU instruction-set options (``GGML_*``) and the ``/proc/cpuinfo`` flag each needs
GGML_ISA = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c",
            "GGML_BMI2": "bmi2", "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f",
            "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni",
            "GGML_AVX512_BF16": "avx512_bf16"}


def llamacpp_cmake_args(flags: Optional[set] = None) -> str:
    """``CMAKE_ARGS`` for building llama-cpp-python on this CPU: not ``GGML_NATIVE``, but
    every x86 extension of :data:`GGML_ISA` the CPU reports, and no AMX. A native build on
    a host whose CPU reports AMX crashed at the first decode (SIGILL / SIGSEGV: the guest
    kernel does not grant the AMX tile state), and an AVX2-only build would handicap the
    peer on an AVX-512 host. ``flags``: the CPU's flags (default: ``/proc/cpuinfo``'s);
    non-x86 hosts (no flags) keep the native build (``""``)."""
    if flags is None:
        try:
            line = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
        except OSError:
            line = ""
        flags = set(line.partition(":")[2].split())
    if "avx" not in flags:
        return ""
    on = [f"-D{opt}=ON" for opt, flag in GGML_ISA.items() if flag in flags]
    off = [f"-D{opt}=OFF" for opt, flag in GGML_ISA.items() if flag not in flags]
    return " ".join(["-DGGML_NATIVE=OFF", *on, *off,
                     "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


def ensure_peer(name: str, log: Optional[Path] = None) -> Path:
    """The python of the peer venv ``name`` (a key of :data:`PEER_VENVS`), built on first
    use; ``log`` defaults to ``bench/.cache/venv-<name>.log``. llama.cpp is built with
    :func:`llamacpp_cmake_args` (recorded in ``.venv-llamacpp/cmake-args``: a venv built
    with other arguments, e.g. natively, is rebuilt).

    Raises:
        KeyError: unknown peer name. RuntimeError: the venv could not be built.
    """
    packages, check, env = PEER_VENVS[name]
    log = log or CACHE / f"venv-{name}.log"
    if name != "llamacpp":
        return ensure_venv(name, packages, check_import=check, env=env, log=log)
    args = llamacpp_cmake_args()
    stamp = venv_python(name).parent.parent / "cmake-args"
    env = {**env, "CMAKE_ARGS": args}
    if stamp.is_file() and stamp.read_text() == args:
        return ensure_venv(name, packages, check_import=check, env=env, log=log)
    py = ensure_venv(name, [p for p in packages if p != "llama-cpp-python"], env=env, log=log)
    with open(log, "a") as out:
        r = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "--no-cache-dir",
                            "--force-reinstall", "--no-deps", "llama-cpp-python"], stdout=out, stderr=out,
                           env={**os.environ, **env})
    if r.returncode:
        raise RuntimeError(f"building llama-cpp-python with CMAKE_ARGS={args!r} failed (see {log})")
    stamp.write_text(args)
    return py


def run_peer(py: Path, args: Sequence[str], *, timeout: float, env: Optional[dict] = None,
             log: Optional[Path] = None) -> dict:
    """Run ``py args...`` and return ``{"rc", "seconds", "tail"}``; never raises on the
    child's failure. ``env``: the child's whole environment (default: this process's; pass
    :func:`worker_env` when the child imports the repo's packages).

    ``tail`` is the last 3000 characters of stdout+stderr (a peer's crash is recorded, not
    hidden); ``rc`` 124 means it timed out.
    """
    t0 = time.perf_counter()
    try:
        p = subprocess.run([str(py), *map(str, args)], capture_output=True, text=True,
                           timeout=timeout, env=env)
        rc, text = p.returncode, (p.stdout or "") + (p.stderr or "")
    except subprocess.TimeoutExpired as ex:
        rc = 124
        so = ex.stdout or ""
        text = (so.decode(errors="replace") if isinstance(so, bytes) else so) + \
            f"\n[timed out after {timeout:.0f} s]"
    if log:
        with open(log, "a") as f:
            f.write(f"\n$ {py} {' '.join(map(str, args))}\n{text}\n")
    return {"rc": rc, "seconds": time.perf_counter() - t0, "tail": text[-3000:]}


# ---------------------------------------------------------------------------------------------
# our int4 exports of SmolLM2-135M, cached under bench/.cache
# ---------------------------------------------------------------------------------------------

OURS_VARIANTS = {
    # what `edgeprune run` ships (edgeprune.pipeline.RunConfig()): the best-w4 preset (GPTQ
    # int4 g64 asym, 8-bit v_proj and layers.0 down_proj) calibrated on 32 x 512 tokens sampled
    # from the model itself, 8-bit lm_head shared with the embedding. 30+ min on a busy
    # 2-core machine (the sampling and GPTQ), so no --quick builds it.
    "default": "best-w4-refit (GPTQ int4 g64 asym, clipped grids, scale refit), self-calibrated 64x512 in twelve "
               "languages (what `edgeprune run` ships)",
    # data-free: RTN int4 g32 asym, block for block like llama.cpp's Q4_0, 8-bit lm_head.
    # Load + export + parity check: 1-3 min on 2 cores. What --quick builds.
    "rtn-g32": "data-free RTN int4 g32 asym, no calibration (block for block like Q4_0)",
    # data-free RTN int4 g64 asym: 4.3125 bits per weight with 16-bit scales (g32 asym is
    # 4.625, over the 4.5 budget of the other families' comparisons); the head as the
    # family's export policy says (exporters: edgeprune.json 'head')
    "rtn-g64": "data-free RTN int4 g64 asym, no calibration (4.3125 bits/weight, 16-bit scales)",
    # GPTQ int4 g64 asym (static act-order, best-w4's 4-bit stage, every decoder linear),
    # calibrated on 32 x 512 C4 validation windows (seed 0): 4.3125 bits/weight
    "gptq-g64": "GPTQ int4 g64 asym (act-order, static groups), C4 32x512 calibration",
    # group 128: 4.15625 bits/weight (16-bit scales: exports store the quantizers' float16
    # scales as float16 since 2026-12-04; 4.28 with the float32 scales stored before)
    "rtn-g128": "data-free RTN int4 g128 asym, no calibration (4.16 bits/weight)",
    "gptq-g128": "GPTQ int4 g128 asym (act-order, static groups), C4 32x512 calibration",
    # gptq-g128 with an int4 head (block 32 asym) instead of the 8-bit one: Gemma 3's tied
    # 262k-row table is 62 % of its weights, so the head's bytes set its decode speed and
    # resident memory; GPTQ on the body buys back what the int4 head costs
    "gptq-g128-h4": "GPTQ int4 g128 asym (act-order, static groups), C4 32x512, int4 head (block 32 asym)",
    # symmetric RTN g64: no zero points, 4.25 bits/weight (16-bit scales; 4.5 with the
    # float32 scales exports stored before 2026-12-04)
    "rtn-g64-sym": "data-free RTN int4 g64 sym, no calibration (4.25 bits/weight)",
    # rtn-g64 with an int4 head (block 32 asym) instead of the 8-bit one: for a tied
    # 262k-row table (Gemma 3) the head is most of the resident memory
    "rtn-g64-h4": "data-free RTN int4 g64 asym, int4 head (block 32 asym)",
    # the best-w4 preset (8-bit v_proj and layers.0 down_proj) calibrated on C4 32 x 512
    "best-w4-c4": "best-w4 (GPTQ int4 g64 asym, 8-bit v_proj + layers.0 down_proj), C4 32x512 calibration",
    # long contexts (issue 25): "-8k" exports have max_length 8,192 (room for 4,096-token
    # prompts; the others keep 2,048, so the benches sizing buffers from it are unchanged)
    "rtn-g32-8k": "rtn-g32 exported with max_length 8192 (the long-context base)",
    # ... with another KV cache (exporters.kvcache): float16; int8 with static per-channel
    # scales calibrated on C4 4 x 2,048 (seed 0)
    "rtn-g32-8k-kv16": "rtn-g32-8k with a float16 KV cache (GroupQueryAttention, exporters.kvcache)",
    "rtn-g32-8k-kv8": "rtn-g32-8k with an int8 KV cache, per-channel scales from C4 4x2048 (exporters.kvcache)",
    # ... with LeanK keep 0.3: the default recipe's learned mask on C4 4 x 2,048 (sink 64,
    # window 448; ~15 min on one thread, cached under bench/.cache/leank/)
    "rtn-g32-8k-leank0.3": "rtn-g32-8k with LeanK keep 0.3 (learned mask, C4 4x2048, sink 64 / window 448)",
}
#: max_length of the "-8k" exports (the others: 2,048)
LONG_MAX_LENGTH = 8192
QUICK_VARIANT = "rtn-g32"
#: the model every bench measured first; its cached exports keep their old folder names
SMOLLM2 = "smollm2-135m"


def ours_folder(variant: str, model: str = SMOLLM2) -> Path:
    """The cached export folder of an :data:`OURS_VARIANTS` entry of ``model`` (an
    ``edgeprune.load_model`` alias; SmolLM2's folders keep their names)."""
    if model != SMOLLM2:
        return CACHE / f"{model}-int4-{variant}"
    return CACHE / ("smollm2-int4" if variant == "rtn-g32" else f"smollm2-int4-{variant}")


#: the file in a cached export folder holding :func:`sources_digest` of the code that built it
SOURCES_FILE = ".sources-sha256"


def _export_sources(root: Path) -> list[Path]:
    """Every ``exporters/`` and ``edgeprune/`` Python source under ``root``: what an export
    depends on."""
    return [*(root / "exporters").rglob("*.py"), *(root / "edgeprune").rglob("*.py")]


def sources_digest(root: Path = ROOT) -> str:
    """SHA-256 over the paths and bytes of every ``exporters/`` and ``edgeprune/`` Python
    source under ``root``, in path order: what an export depends on, by content (a file
    rewritten with the same bytes, a fresh clone or a copied cache leave it unchanged)."""
    h = hashlib.sha256()
    for p in sorted(_export_sources(root)):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def ours_is_current(folder: Path) -> bool:
    """Whether ``folder`` holds an export built by the code of now (so a stale export is
    never measured): its :data:`SOURCES_FILE` equals :func:`sources_digest`; a folder
    without one (built before the digest existed) counts when its ``edgeprune.json`` is
    newer than every ``exporters/`` and ``edgeprune/`` source file."""
    meta = folder / "edgeprune.json"
    if not ((folder / "model.onnx").is_file() and meta.is_file()):
        return False
    stamp = folder / SOURCES_FILE
    if stamp.is_file():
        return stamp.read_text().strip() == sources_digest()
    return meta.stat().st_mtime > max(p.stat().st_mtime for p in _export_sources(ROOT))


def ensure_ours(folder: Path, log: Callable[[str], None], variant: str = "default",
                model: str = SMOLLM2) -> Optional[str]:
    """Build our int4 export ``variant`` of ``model`` into ``folder`` unless a current one
    is there (:func:`ours_is_current`), in a fresh process (``python bench/benchlib.py
    export``, so the PyTorch model's memory goes with it). Returns an error string, or None."""
    if ours_is_current(folder):
        return None
    if variant not in OURS_VARIANTS:
        return f"unknown export variant {variant!r} (known: {', '.join(OURS_VARIANTS)})"
    log(f"building our export {variant!r} of {model} ({OURS_VARIANTS[variant]}) into {folder}")
    digest = sources_digest()   # the code the build starts from
    r = run_peer(Path(sys.executable), [Path(__file__).resolve(), "export", variant, folder,
                                        "--model", model],
                 timeout=3 * 3600, env=worker_env())
    log(r["tail"].strip()[-400:])
    if r["rc"] != 0:
        return f"int4 export ({variant}) failed: {r['tail'].strip()[-800:]}"
    (folder / SOURCES_FILE).write_text(digest + "\n")
    return None


def quick_variants() -> list[str]:
    """Our exports a ``--quick`` run measures: the data-free :data:`QUICK_VARIANT`, plus the
    shipped ``default`` only when a current copy is already cached (never built here)."""
    return [QUICK_VARIANT] + (["default"] if ours_is_current(ours_folder("default")) else [])


def build_ours(variant: str, folder: Path, model: str = SMOLLM2) -> str:
    """Export ``model`` (an alias; SmolLM2-135M by default) to ``folder`` as
    :data:`OURS_VARIANTS` ``variant`` (int4, max_length 2048, overwriting; the head and an
    untied embedding as the family's export defaults say); returns the export's summary."""
    import edgeprune_exporters as exporters
    from edgeprune.models import load_model

    if variant not in OURS_VARIANTS:
        raise ValueError(f"unknown export variant {variant!r} (known: {', '.join(OURS_VARIANTS)})")
    m, t = load_model(model)
    kw: dict = {}
    summary: dict = {}
    if variant == "default":
        from edgeprune.calibration import build_calibration
        from edgeprune.engine import compress
        from edgeprune.pipeline import DEFAULT_CALIB, RunConfig, build_recipe

        c = RunConfig()
        cal = build_calibration(t, DEFAULT_CALIB, nsamples=c.nsamples, seqlen=c.seqlen,
                                seed=c.seed, model=m)
        kw["quantized"] = compress(m, build_recipe(c), cal.input_ids, progress=False).quantized
    elif variant in ("gptq-g64", "gptq-g128", "gptq-g128-h4", "best-w4-c4"):
        from edgeprune.calibration import build_calibration
        from edgeprune.engine import compress
        from edgeprune.recipe import GPTQConfig, Recipe

        gs = int(variant.removesuffix("-h4").rsplit("g", 1)[1]) if variant.startswith("gptq-") else 0
        recipe = (Recipe([GPTQConfig(bits=4, group_size=gs, sym=False,
                                     act_order=True, static_groups=True)])
                  if variant.startswith("gptq-") else
                  Recipe.from_file(ROOT / "edgeprune" / "recipes" / "best-w4.yaml"))
        cal = build_calibration(t, C4, nsamples=32, seqlen=512, seed=0)
        res = compress(m, recipe, cal.input_ids, progress=False, measure_errors=False)
        kw["quantized"] = res.quantized
        summary = {"compress_s": round(res.seconds, 1),
                   "avg_bits_per_weight": res.summary()["avg_bits_per_weight"]}
        if variant.endswith("-h4"):
            kw["lm_head"] = "int4"
    elif variant == "rtn-g64-sym":
        from edgeprune.engine import compress
        from edgeprune.methods.rtn import RTNConfig
        from edgeprune.recipe import Recipe

        res = compress(m, Recipe([RTNConfig(bits=4, group_size=64, sym=True)]), None,
                       progress=False, measure_errors=False)
        kw["quantized"] = res.quantized
    else:
        base, _, extra = variant.partition("-kv") if "-kv" in variant else variant.partition("-leank")
        base = base.removesuffix("-8k")
        kw["group_size"] = {"rtn-g32": 32, "rtn-g64": 64, "rtn-g128": 128, "rtn-g64-h4": 64}[base]
        if base.endswith("-h4"):
            kw["lm_head"] = "int4"
        if extra:
            kw["variants"] = [_cache_variant(variant, m, t)]
            summary["cache_variant"] = variant[len(base) + 1:]
    long = variant.split("-kv")[0].split("-leank")[0].endswith("-8k")
    r = exporters.export_onnx(m, t, folder, precision="int4", overwrite=True,
                              max_length=LONG_MAX_LENGTH if long else 2048,
                              provenance={"bench": "benchlib.build_ours", "variant": variant,
                                          "model": model, **summary}, **kw)
    return r.summary()


def _cache_variant(variant: str, model, tok):
    """The graph variant of an :data:`OURS_VARIANTS` name ending ``-kv16``, ``-kv8`` or
    ``-leank0.3`` (``rtn-g32-8k-kv8`` ...): a ``KVCacheSpec`` (int8 scales calibrated on C4 4 x 2,048, seed 0) or a
    learned LeanK mask (C4 4 x 2,048, the default recipe; cached as JSON under
    ``bench/.cache/leank/``)."""
    from edgeprune.calibration import build_calibration

    cal = lambda: build_calibration(tok, C4, nsamples=4, seqlen=2048, seed=0).input_ids  # noqa: E731
    if variant.endswith("-kv16"):
        from edgeprune.kvcache import KVCacheSpec
        return KVCacheSpec("fp16")
    if variant.endswith("-kv8"):
        from edgeprune.kvcache import KVCacheSpec
        return KVCacheSpec.calibrate(model, cal(), dtype="int8")
    from edgeprune.leank import LeanKMask
    from edgeprune.variants import load_spec, save_spec
    keep = float(variant.rsplit("-leank", 1)[1])
    path = CACHE / "leank" / f"bench_mask_learned_{keep:g}_c4_4x2048.json"
    if path.is_file():
        return load_spec(path, LeanKMask)
    path.parent.mkdir(parents=True, exist_ok=True)
    mask = LeanKMask.calibrate(model, cal(), k_keep=keep, method="learned")
    save_spec(mask, path)
    return mask


# ---------------------------------------------------------------------------------------------
# the repo's APIs the benches call that the redesign moves: one place to update
# ---------------------------------------------------------------------------------------------

def model_work(folder) -> dict:
    """Bytes and operations per token of an export (the profiler's graph work count)."""
    from edgeprune_devices.profiler import model_work as _model_work

    return _model_work(folder)


def load_countdown(folder, threads: int):
    """A COUNTDOWN session of an export (``mlp_read_report()`` included)."""
    import edgeprune_runtime.countdown as countdown

    return countdown.load(folder, threads=threads)


def main(argv=None) -> int:
    """``peers [NAME...]``: build peer venvs; ``export VARIANT FOLDER``: one of our exports."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("peers", help="build the peer virtualenvs (default: all)")
    p.add_argument("names", nargs="*", metavar="NAME", help=", ".join(PEER_VENVS))
    e = sub.add_parser("export", help="build one of our cached int4 exports")
    e.add_argument("variant", choices=list(OURS_VARIANTS))
    e.add_argument("folder", type=Path)
    e.add_argument("--model", default=SMOLLM2, help="the model alias (default %(default)s)")
    a = ap.parse_args(argv)
    if a.cmd == "peers":
        unknown = sorted(set(a.names) - set(PEER_VENVS))
        if unknown:
            ap.error(f"unknown peers {unknown}; known: {', '.join(PEER_VENVS)}")
        for name in a.names or PEER_VENVS:
            t0 = time.perf_counter()
            print(f"{name}: {ensure_peer(name)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    else:
        print(build_ours(a.variant, a.folder, a.model), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
