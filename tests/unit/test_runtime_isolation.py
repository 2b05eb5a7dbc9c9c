"""`import runtime` and a full generate work with torch and transformers made unimportable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from tiny import export_tiny_llama

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):
        BLOCKED = ("torch", "transformers", "edgeprune", "exporters", "accelerate", "optimum")
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    try:
        import torch  # noqa: F401
        raise SystemExit("torch import was not blocked")
    except ImportError:
        pass

    import runtime
    from runtime import profiler, sampling, tokenizer  # noqa: F401
    import devices
    folder, prompt = sys.argv[1], sys.argv[2]
    s = runtime.load(folder, threads=1)
    r = s.generate(prompt, max_new_tokens=12)
    streamed = "".join(s.stream(prompt, max_new_tokens=12))
    sampled = s.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    prof = devices.load_profile("raspberry-pi-5")
    s.close()
    bad = sorted(m for m in sys.modules if m.split(".")[0] in Block.BLOCKED)
    print(json.dumps({"ids": r.token_ids[0], "text": r.text, "streamed": streamed,
                      "sampled": sampled.token_ids[0], "profile": prof.name, "loaded": bad}))
""")


def test_runtime_runs_without_torch_and_transformers(tmp_path):
    folder, model, tok = export_tiny_llama(tmp_path / "tiny")
    prompt = "The quick brown fox"
    ids = tok.encode(prompt, add_special_tokens=False)
    # Reference: the PyTorch model's greedy continuation (12 tokens, no early stop).
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), prompt], capture_output=True, text=True,
                         env=env, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["loaded"] == []
    assert res["profile"] == "raspberry-pi-5"
    if 2 not in ref:  # eos would stop the runtime early
        assert res["ids"] == ref
    else:
        assert res["ids"] == ref[: ref.index(2)]
    assert res["text"] == tok.decode(res["ids"], skip_special_tokens=True) == res["streamed"]
    assert len(res["sampled"]) >= 1 and all(0 <= t < len(tok) for t in res["sampled"])
