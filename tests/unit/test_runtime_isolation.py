"""`import edgeprune_runtime` and a full generate work with torch and transformers made unimportable, and
load none of onnx, matplotlib, torch, transformers, devices, edgeprune, exporters (the runtime
is what apps embed; the profiler lives in devices and is never on its import path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny import export_tiny_llama

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):
        BLOCKED = ("torch", "transformers", "edgeprune", "edgeprune_exporters", "exporters", "accelerate",
                   "optimum")
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ImportError(f"{name} is blocked in this test")
            return None

    folder, prompt, block = sys.argv[1], sys.argv[2], sys.argv[3] == "block"
    if block:
        sys.meta_path.insert(0, Block())
        try:
            import torch  # noqa: F401
            raise SystemExit("torch import was not blocked")
        except ImportError:
            pass

    import edgeprune_runtime as runtime
    from edgeprune_runtime import sampling, tokenizer  # noqa: F401
    s = runtime.load(folder, threads=1)
    r = s.generate(prompt, max_new_tokens=12)
    streamed = "".join(s.stream(prompt, max_new_tokens=12))
    sampled = s.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    s.close()
    # nothing heavy or of the other packages on the runtime's path
    heavy = ("onnx", "matplotlib", "torch", "transformers", "edgeprune_devices", "edgeprune",
             "edgeprune_exporters", "devices", "exporters", "runtime")
    by_runtime = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
    # devices (profiles, the profiler) works beside it, still without torch
    import edgeprune_devices as devices
    import edgeprune_devices.profiler  # noqa: F401
    prof = devices.load_profile("raspberry-pi-5")
    bad = sorted(m for m in sys.modules if m.split(".")[0] in Block.BLOCKED)
    print(json.dumps({"ids": r.token_ids[0], "text": r.text, "streamed": streamed,
                      "sampled": sampled.token_ids[0], "profile": prof.name, "loaded": bad,
                      "by_runtime": by_runtime}))
""")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return export_tiny_llama(tmp_path_factory.mktemp("isolation") / "tiny")


def _child(folder, prompt: str, mode: str, cwd) -> dict:
    """Run CHILD in a fresh interpreter (``mode`` "block": torch & co. unimportable)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), prompt, mode], capture_output=True,
                         text=True, env=env, timeout=120, cwd=str(cwd))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_runtime_runs_without_torch_and_transformers(tiny, tmp_path):
    folder, model, tok = tiny
    prompt = "The quick brown fox"
    ids = tok.encode(prompt, add_special_tokens=False)
    # Reference: the PyTorch model's greedy continuation (12 tokens, no early stop).
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    res = _child(folder, prompt, "block", tmp_path)
    assert res["loaded"] == [] and res["by_runtime"] == []
    assert res["profile"] == "raspberry-pi-5"
    if 2 not in ref:  # eos would stop the runtime early
        assert res["ids"] == ref
    else:
        assert res["ids"] == ref[: ref.index(2)]
    assert res["text"] == tok.decode(res["ids"], skip_special_tokens=True) == res["streamed"]
    assert len(res["sampled"]) >= 1 and all(0 <= t < len(tok) for t in res["sampled"])


def test_import_runtime_and_generate_loads_no_heavy_or_foreign_module(tiny, tmp_path):
    """With everything importable, `import edgeprune_runtime` and a generation still load none of
    onnx, matplotlib, torch, transformers, devices, edgeprune, exporters."""
    folder, _, _ = tiny
    res = _child(folder, "Hello", "open", tmp_path)
    assert res["by_runtime"] == [], res["by_runtime"]
    assert res["profile"] == "raspberry-pi-5" and len(res["ids"]) >= 1
