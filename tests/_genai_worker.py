"""Greedy generation with onnxruntime-genai from an export folder, run in its side
virtualenv (``bench/benchlib.py peers ortgenai``), which has none of our packages.

    python tests/_genai_worker.py FOLDER '{"prompt": [ids...], "max_new_tokens": 64}'

prints one JSON line: ``{"version", "tokens": [generated ids, the end-of-sequence token
left out as our runtime does], "finish": "eos" | "length", "first_logits": [vocab floats
of the prompt's last position]}``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import onnxruntime_genai as og


def main(folder: str, request: str) -> dict:
    req = json.loads(request)
    prompt = np.asarray([req["prompt"]], dtype=np.int32)
    n = int(req["max_new_tokens"])
    model = og.Model(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=prompt.shape[1] + n)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    first = np.asarray(gen.get_logits(), np.float32)[0, -1]         # [batch, 1, vocab]
    with open(os.path.join(folder, "genai_config.json")) as f:
        eos = json.load(f)["model"].get("eos_token_id")
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    tokens, finish = [], "length"
    while not gen.is_done() and len(tokens) < n:
        gen.generate_next_token()
        t = int(gen.get_next_tokens()[0])
        if t in eos:                 # our runtime does not return the end-of-sequence token
            finish = "eos"
            break
        tokens.append(t)
    return {"version": getattr(og, "__version__", None), "tokens": tokens, "finish": finish,
            "first_logits": first.tolist()}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
