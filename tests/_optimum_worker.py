"""Greedy generation with Optimum's ``ORTModelForCausalLM`` from an export folder, run in
its side virtualenv (``bench/benchlib.py peers optimum``), which has none of our packages.

    python tests/_optimum_worker.py FOLDER '{"prompt": [ids...], "max_new_tokens": 64}'

Optimum loads ``genai_model.onnx`` (``file_name``: the folder's ``model.onnx`` is our
runtime's graph, whose ``seqlens_k`` inputs Optimum does not feed) with the folder's
``config.json``. Prints one JSON line: ``{"version", "tokens": [generated ids, an
end-of-sequence token left out as our runtime does], "finish"}``.
"""

from __future__ import annotations

import json
import sys

import torch
from optimum.onnxruntime import ORTModelForCausalLM
from optimum.version import __version__


def main(folder: str, request: str) -> dict:
    req = json.loads(request)
    ids = torch.tensor([req["prompt"]], dtype=torch.long)
    n = int(req["max_new_tokens"])
    model = ORTModelForCausalLM.from_pretrained(folder, file_name="genai_model.onnx",
                                                use_cache=True)
    with open(f"{folder}/genai_config.json") as f:
        eos = json.load(f)["model"].get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, eos_token_id=eos or None, pad_token_id=eos[0] if eos else None)
    tokens = out[0, ids.shape[1]:].tolist()
    finish = "length"
    for k, t in enumerate(tokens):
        if t in eos:
            tokens, finish = tokens[:k], "eos"
            break
    return {"version": __version__, "tokens": tokens, "finish": finish}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
