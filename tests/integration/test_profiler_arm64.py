"""The ARM64 numerics check (devices.arm64_check) on a tiny int4 export, under QEMU.

Runs only where the emulation tree is already set up (``python -m devices.arm64_check``
builds it once, ~2 min, with root and registry access) and ``unshare`` works: it never
downloads anything by itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))


def _ready():
    from devices.arm64_check import DEFAULT_ROOT

    if not shutil.which("qemu-aarch64-static") or not (DEFAULT_ROOT / "sysroot" / "usr" / "bin" / "python3").exists():
        return False
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        return False
    import onnxruntime
    return any(DEFAULT_ROOT.glob(f"site-py*-ort{onnxruntime.__version__}"))


@pytest.mark.skipif(not _ready(), reason="arm64 emulation tree not set up (run python -m devices.arm64_check once)")
def test_int4_logits_match_between_x86_and_emulated_arm64(tmp_path):
    from _h4_tiny_tokenizer import export_tiny_llama

    from devices.arm64_check import compare

    folder, _, _ = export_tiny_llama(tmp_path / "tiny-int4", precision="int4")
    res = compare(folder, tokens=12)
    assert res["x86"]["machine"] == "x86_64" and res["arm64"]["machine"] == "aarch64"
    assert res["arm64"]["onnxruntime"] == res["x86"]["onnxruntime"]
    assert res["max_abs_logit_diff"] < 1e-3 and res["top1_agreement"] == 1.0
    assert res["greedy_equal"] and len(res["greedy_arm64"]) == 12
    assert "NOT device timings" in res["note"]
