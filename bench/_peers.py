"""Shared helpers for bench scripts that run peer tools in their own virtualenvs.

Each peer (llm-compressor, onnxruntime-genai, llama-cpp-python) lives in a git-ignored
``.venv-<peer>`` at the repository root, created on first use. ``torch==2.13.0`` is
installed first from the CPU wheel index so that an unpinned dependency never pulls a
multi-GB CUDA build (see ``../shared/PEERS.md``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
# evaluation data the benches read (never the product): ../shared/data, see its SOURCES.md
SHARED = Path(os.environ.get("EDGEPRUNE_SHARED", ROOT.parent / "shared"))
C4 = SHARED / "data" / "c4" / "c4_validation_2k.parquet"
WIKI = SHARED / "data" / "wikitext2" / "wiki.test.raw"
TORCH_PIN = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def venv_python(name: str) -> Path:
    """Path of the python interpreter of ``.venv-<name>``."""
    return ROOT / f".venv-{name}" / "bin" / "python"


def ensure_venv(name: str, packages: Sequence[str], *, check_import: str | None = None,
                log: Path | None = None) -> Path:
    """Create ``.venv-<name>`` (if missing) and install ``torch==2.13.0`` then ``packages``.

    Args:
        name: peer short name; the venv is ``ROOT/.venv-<name>``.
        packages: pip requirement strings installed after torch.
        check_import: module name whose import proves the venv is ready (skips pip).
        log: file receiving pip's output (appended).

    Returns:
        The venv's python path.

    Raises:
        RuntimeError: venv creation or pip install failed (message holds the log tail).
    """
    py = venv_python(name)
    if check_import and py.exists():
        ok = subprocess.run([str(py), "-c", f"import {check_import}"],
                            capture_output=True).returncode == 0
        if ok:
            return py
    out = open(log, "a") if log else subprocess.DEVNULL
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(py.parent.parent)],
                           check=True, stdout=out, stderr=out)
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check"]
        # torch first: try the local/CPU wheel; fall back to the default index.
        r = subprocess.run(pip + [TORCH_PIN], stdout=out, stderr=out)
        if r.returncode:
            r = subprocess.run(pip + ["--index-url", CPU_INDEX, TORCH_PIN], stdout=out, stderr=out)
        if r.returncode:
            raise RuntimeError(f"installing {TORCH_PIN} into .venv-{name} failed (see {log})")
        r = subprocess.run(pip + [TORCH_PIN, *packages], stdout=out, stderr=out)
        if r.returncode:
            raise RuntimeError(f"installing {packages} into .venv-{name} failed (see {log})")
    finally:
        if log:
            out.close()
    return py


def run_peer(py: Path, args: Sequence[str], *, timeout: float, env: dict | None = None,
             log: Path | None = None) -> dict:
    """Run ``py args...`` and return ``{"rc", "seconds", "tail"}`` (never raises on failure).

    ``tail`` is the last 3000 characters of stdout+stderr, so a peer's crash is recorded
    rather than hidden.
    """
    e = dict(os.environ)
    e.update(env or {})
    t0 = time.perf_counter()
    try:
        p = subprocess.run([str(py), *args], capture_output=True, text=True, timeout=timeout, env=e)
        rc, text = p.returncode, (p.stdout or "") + (p.stderr or "")
    except subprocess.TimeoutExpired as ex:
        rc = 124
        text = ((ex.stdout or b"").decode(errors="replace") if isinstance(ex.stdout, bytes)
                else (ex.stdout or "")) + f"\n[timed out after {timeout:.0f} s]"
    if log:
        with open(log, "a") as f:
            f.write(f"\n$ {py} {' '.join(map(str, args))}\n{text}\n")
    return {"rc": rc, "seconds": time.perf_counter() - t0, "tail": text[-3000:]}


def write_json_records(path: str | os.PathLike, records: list[dict]) -> None:
    """Write bench records atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(records, indent=2))
    os.replace(tmp, path)




OURS_VARIANTS = {
    # what `edgeprune run` ships by default (edgeprune.pipeline.RunConfig()): the best-w4
    # preset (GPTQ int4 g64 asym, 8-bit v_proj and layers.0 down_proj) calibrated on 32 x 512
    # tokens sampled from the model, 8-bit lm_head shared with the embedding
    "default": ("from edgeprune.calibration import build_calibration\n"
                "from edgeprune.engine import compress\n"
                "from edgeprune.pipeline import DEFAULT_CALIB, RunConfig, build_recipe\n"
                "c = RunConfig()\n"
                "cal = build_calibration(t, DEFAULT_CALIB, nsamples=c.nsamples, seqlen=c.seqlen, seed=c.seed, model=m)\n"
                "res = compress(m, build_recipe(c), cal.input_ids, progress=False)\n"
                "kw = dict(quantized=res.quantized)\n"),
    # block-for-block like Q4_0: RTN int4 g32 (asym), 8-bit lm_head
    "rtn-g32": "kw = dict(group_size=32)\n",
}


def ensure_ours(folder: Path, log, variant: str = "default") -> str | None:
    """Export SmolLM2 to int4 once (cached; re-exported when any ``exporters/*.py`` or
    compression code ``edgeprune/**/*.py`` is newer than the cached folder, so a stale
    export never gets measured); returns an error string or None. ``variant``: a key of
    :data:`OURS_VARIANTS`."""
    meta = folder / "edgeprune.json"
    srcs = [*(ROOT / "exporters").glob("*.py"), *(ROOT / "edgeprune").rglob("*.py")]
    newest = max(p.stat().st_mtime for p in srcs)
    if (folder / "model.onnx").is_file() and meta.is_file() and meta.stat().st_mtime > newest:
        return None
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from edgeprune.models import load_model\nimport exporters\n"
            "m, t = load_model('smollm2-135m')\n" + OURS_VARIANTS[variant] +
            "r = exporters.export_onnx(m, t, %r, precision='int4', max_length=2048, overwrite=True,"
            " provenance={'bench': 'compare_llamacpp', 'variant': %r}, **kw)\n"
            "print(r.summary())\n") % (str(ROOT), str(folder), variant)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    log(p.stdout.strip()[-400:])
    return None if p.returncode == 0 else f"int4 export ({variant}) failed: {p.stderr.strip()[-800:]}"


def ours_folder(variant: str) -> Path:
    """The cached export folder of an :data:`OURS_VARIANTS` entry."""
    return ROOT / "bench" / ".cache" / ("smollm2-int4" if variant == "rtn-g32" else f"smollm2-int4-{variant}")


if __name__ == "__main__":  # python bench/_peers.py llmcompressor llmcompressor==0.14.0.1
    name, *pkgs = sys.argv[1:]
    print(ensure_venv(name, pkgs, log=ROOT / "bench" / ".cache" / f"venv-{name}.log"))
