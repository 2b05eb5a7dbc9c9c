"""Prefix reuse between chat turns: time to first token of turn 5 with the KV cache of turns
1-4 kept, vs recomputing the whole conversation.

A 5-turn conversation (a system prompt, five user questions, the model's own greedy answers
of up to ``--answer-tokens`` tokens) runs on a session with prefix reuse on
(``session.reuse_prefix = True``, as ``edgeprune serve`` and ``edgeprune chat`` use it):
each turn keeps the rows of the conversation so far and prefills only the new message.
The same turn-5 prompt then runs on a second session with reuse off (the whole
conversation prefilled). Both sessions load the same export with the same threads; rounds
alternate the two. Also checked: the turn-5 answer's tokens with and without reuse (equal
on fp32 exports; an int8-activation int4 export may resolve a near-tie differently).

The export: ``--export FOLDER``, or (default) SmolLM2-135M RTN int4 g64 built once into
``bench/.cache/serve_prefix/`` with the CLI::

    edgeprune compress smollm2-135m --method rtn --bits 4 --group-size 64 --nsamples 2 --seqlen 32 --out CKPT
    edgeprune export CKPT ONNX

Usage::

    .venv/bin/python bench/serve_prefix.py --json bench/results/serve_prefix.json
    .venv/bin/python bench/serve_prefix.py --quick       # 1 round, short answers (correctness)

Prints per round and the medians; the last line is the ratio (recompute / reuse). JSON
records ``{"case": "turn5/tT", "metric": "ttft_ms", "reuse", "recompute", "ratio",
"prompt_tokens", "cached_tokens", "same_tokens", "rounds"}``. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import benchlib

ROOT = benchlib.ROOT

CACHE = ROOT / "bench" / ".cache" / "serve_prefix"
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTIONS = ["What is the capital of France?",
             "Name three things people usually visit there.",
             "Which of them is the oldest?",
             "How would I get there from the airport?",
             "Summarize our conversation in one sentence."]


def build_export() -> Path:
    """SmolLM2-135M RTN int4 g64 exported once into :data:`CACHE` (the CLI, as a user would)."""
    ckpt, onnx = CACHE / "rtn4-g64", CACHE / "rtn4-g64-onnx"
    if (onnx / "model.onnx").is_file():
        return onnx
    env = benchlib.worker_env()
    cli = [sys.executable, "-m", "edgeprune.cli"]
    if not (ckpt / "config.json").is_file():
        subprocess.run(cli + ["compress", "smollm2-135m", "--method", "rtn", "--bits", "4",
                              "--group-size", "64", "--nsamples", "2", "--seqlen", "32",
                              "--out", str(ckpt)], check=True, env=env, cwd=ROOT)
    subprocess.run(cli + ["export", str(ckpt), str(onnx)], check=True, env=env, cwd=ROOT)
    return onnx


def conversation(sess, turns: int, answer_tokens: int) -> tuple[list, object]:
    """Run ``turns`` turns on ``sess``; ``(the last turn's messages, its result)``."""
    msgs = [{"role": "system", "content": SYSTEM}]
    res = None
    for t in range(turns):
        msgs.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        res = sess.generate(msgs, max_new_tokens=answer_tokens)
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": res.text})
    return msgs, res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", help="export folder (default: build SmolLM2 RTN int4 into the cache)")
    benchlib.add_common_args(ap, "1 round, 16-token answers")
    ap.add_argument("--repeat", type=int, default=None, help="rounds (default 5, quick 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--answer-tokens", type=int, default=None, help="default 64, quick 16")
    a = ap.parse_args(argv)
    rounds = a.repeat or (1 if a.quick else 5)
    answer = a.answer_tokens or (16 if a.quick else 64)
    folder = Path(a.export) if a.export else build_export()

    import edgeprune_runtime as runtime

    reuse = runtime.load(folder, threads=a.threads)
    reuse.reuse_prefix = True
    plain = runtime.load(folder, threads=a.threads)
    # warm both (first-run allocations, onnxruntime's first passes)
    reuse.generate(QUESTIONS[0], max_new_tokens=4)
    plain.generate(QUESTIONS[0], max_new_tokens=4)
    t_reuse, t_plain, same = [], [], []
    for r in range(rounds):
        reuse.free_kv_cache()                 # each round a new conversation from turn 1
        msgs, last = conversation(reuse, a.turns, answer)
        ref = plain.generate(msgs, max_new_tokens=answer)
        t_reuse.append(last.ttft_ms)
        t_plain.append(ref.ttft_ms)
        same.append(last.token_ids == ref.token_ids)
        print(f"round {r + 1}: turn {a.turns} prompt {last.prompt_tokens[0]} tokens, "
              f"{last.cached_tokens} cached; first token {last.ttft_ms:.1f} ms with reuse, "
              f"{ref.ttft_ms:.1f} ms recomputed; same answer tokens: {same[-1]}")
    med_r, med_p = statistics.median(t_reuse), statistics.median(t_plain)
    case = f"turn{a.turns}/t{a.threads}"
    peer = "recompute (same export, no prefix reuse)"
    records = [benchlib.record(case, "ttft_ms", med_r, peer=peer, theirs=med_p),
               benchlib.record(case, "prompt_tokens", last.prompt_tokens[0]),
               benchlib.record(case, "cached_tokens", last.cached_tokens),
               benchlib.record(case, "same_answer_tokens", int(all(same))),
               benchlib.note_record(case, f"{rounds} rounds, {answer}-token answers, export {folder}")]
    record = {"case": case, "reuse_ttft_ms": med_r, "recompute_ttft_ms": med_p,
              "ratio": med_p / med_r if med_r > 0 else None, "same_tokens": all(same)}
    reuse.close()
    plain.close()
    if a.json:
        benchlib.write_records(a.json, records)
    print(json.dumps(record))
    print(f"turn-{a.turns} time to first token: {med_p:.1f} ms recomputed / {med_r:.1f} ms with "
          f"prefix reuse = {record['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
