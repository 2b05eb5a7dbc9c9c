"""The two distributions (issue 24 item 2): ``edgeprune`` and ``edgeprune-runtime``.

* Both ``pyproject.toml`` files list every package folder of the tree under its import name
  (an explicit list: a new subpackage left out would be missing from the wheel).
* The runtime wheel, built from ``runtime/``, installs into a bare virtualenv (no torch,
  transformers or matplotlib) and generates the same greedy tokens as the runtime here. The
  virtualenv is ``.venv-runtime-wheel`` (git-ignored), built on first use from pip's cache or
  the package index; the test skips only when the runtime's dependencies cannot be installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import edgeprune_runtime as runtime

from tiny import export_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
BARE = ROOT / ".venv-runtime-wheel"
#: the import names of the main distribution's folders (pyproject.toml package-dir)
MAIN_FOLDERS = {"edgeprune": "edgeprune", "exporters": "edgeprune_exporters",
                "devices": "edgeprune_devices"}


def _packages_in(folder: Path, name: str) -> set[str]:
    """Dotted names of ``folder`` and its subfolders that hold an ``__init__.py``."""
    return {".".join([name, *p.parent.relative_to(folder).parts])
            for p in folder.rglob("__init__.py") if "build" not in p.parts}


def test_main_pyproject_lists_every_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    st = cfg["tool"]["setuptools"]
    want = set().union(*(_packages_in(ROOT / f, n) for f, n in MAIN_FOLDERS.items()))
    assert set(st["packages"]) == want
    assert st["package-dir"] == {"edgeprune_exporters": "exporters", "edgeprune_devices": "devices"}
    runtime_cfg = tomllib.loads((ROOT / "runtime" / "pyproject.toml").read_text())["project"]
    assert f"edgeprune-runtime=={runtime_cfg['version']}" in cfg["project"]["dependencies"]


def test_runtime_pyproject_lists_every_package_and_only_small_dependencies():
    cfg = tomllib.loads((ROOT / "runtime" / "pyproject.toml").read_text())
    assert set(cfg["tool"]["setuptools"]["packages"]) == _packages_in(ROOT / "runtime", "edgeprune_runtime")
    deps = {d.split(">")[0].split("=")[0].split("<")[0] for d in cfg["project"]["dependencies"]}
    assert deps == {"onnxruntime", "numpy", "tokenizers", "jinja2", "psutil"}


def _pip(py: Path, *args: str, timeout: float = 900) -> None:
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError((p.stdout + p.stderr)[-1500:])


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


CHILD = """
import importlib.util, json, sys
import edgeprune_runtime as runtime
folder, ids = sys.argv[1], json.loads(sys.argv[2])
with runtime.load(folder, threads=1) as s:
    r = s.generate(ids, max_new_tokens=16)
print(json.dumps({"ids": r.token_ids[0], "file": runtime.__file__,
                  "absent": [m for m in ("torch", "transformers", "matplotlib", "edgeprune",
                                         "edgeprune_exporters", "onnx")
                             if importlib.util.find_spec(m) is None]}))
"""


def test_runtime_wheel_installs_in_a_bare_venv_and_generates(tmp_path):
    wheels = tmp_path / "wheels"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(wheels), str(ROOT / "runtime")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    (wheel,) = wheels.glob("edgeprune_runtime-*.whl")
    import zipfile
    names = zipfile.ZipFile(wheel).namelist()
    assert "edgeprune_runtime/session.py" in names and "edgeprune_runtime/serve/app.py" in names
    assert not [n for n in names if n.startswith(("runtime/", "edgeprune/", "tests/"))]

    py = BARE / "bin" / "python"
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(BARE)], check=True, timeout=300)
        _pip(py, str(wheel))                                   # its dependencies
        _pip(py, "--force-reinstall", "--no-deps", str(wheel))  # this build of it
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"the runtime's dependencies cannot be installed here: {e}")

    folder, _, tok = export_tiny_llama(tmp_path / "tiny")
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    out = subprocess.run([str(py), "-c", CHILD, str(folder), json.dumps(ids)], capture_output=True,
                         text=True, timeout=300, cwd=str(tmp_path), env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(res["file"]).is_relative_to(BARE)               # the wheel's copy, not this checkout
    assert set(res["absent"]) == {"torch", "transformers", "matplotlib", "edgeprune",
                                  "edgeprune_exporters", "onnx"}
    with runtime.load(folder, threads=1) as s:
        assert res["ids"] == s.generate(ids, max_new_tokens=16).token_ids[0]
    size_mb = _du(BARE) / 2**20
    print(f"bare runtime virtualenv: {size_mb:.0f} MiB")
    assert size_mb < 400
