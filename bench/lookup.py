"""When prompt lookup pays: decode speed with and without it, ours and llama.cpp's, by kind of text.

Prompt-lookup speculative decoding (``runtime.lookup``) drafts tokens from an earlier
occurrence of the last n-gram, so its gain depends on how much the output repeats its
context. This bench measures, on SmolLM2-135M (our default int4 export vs llama.cpp Q4_0
through llama-cpp-python, same token ids, greedy, end-of-sequence honoured, up to
``--gen-len`` new tokens), four kinds of prompt:

* ``copy``: "Repeat the following text word for word" + a WikiText-2 paragraph (chat);
* ``summarize``: "Summarize the following text" + a paragraph (chat);
* ``chat``: open questions that quote nothing (chat);
* ``continue``: the plain-text continuation prompt of ``bench/compare_llamacpp.py``.

Each runtime runs plain and with prompt lookup (ours: ``prompt_lookup_num_tokens=K``,
adaptive length and cost gate; llama-cpp-python: its own ``LlamaPromptLookupDecoding(
num_pred_tokens=K)`` through ``Llama.generate``), every configuration in a fresh process
over all prompts, rounds interleaved. The paragraphs come from ``../shared/data`` (bench
data, never the product's).

Usage::

    .venv/bin/python bench/lookup.py --json bench/results/lookup.json
    .venv/bin/python bench/lookup.py --quick          # 1 round, 1 thread, 2 prompts per kind (~3 min)

``--quick`` measures the data-free ``rtn-g32`` export (``benchlib.OURS_VARIANTS``; 1-3 min
to build) unless a current copy of the shipped ``default`` export is cached, never
building that one (30+ min); the case names then end in ``/rtn-g32``. The full run
measures (and if needed builds) ``default``. Both need ``.venv-llamacpp`` (``make
bench-peers``); the Q4_0 GGUF is re-quantized once from the shipped Q4_1.

JSON records ``{"case", "metric", "ours", "peer", "theirs"}``: case ``KIND/tT``, metrics
``decode_tok_s`` (ours with lookup vs llama.cpp with lookup; the median over prompts of
the median over rounds), ``plain_decode_tok_s`` (both without), ``lookup_speedup`` (each
runtime's lookup over its own plain run) and ``draft_acceptance`` (ours; theirs null:
llama-cpp-python does not report it); peer ``"llama.cpp"``. Shared 2-core machine:
differences under 10-15 % are noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import benchlib
from compare_llamacpp import (CACHE, PEER, PROMPT_TEXT, _spawn, _vm_hwm, ensure_gguf,
                              ensure_llamacpp, llama_generate, llama_lookup_kwargs)

QUESTIONS = ["Explain why the sky is blue in two short paragraphs.",
             "What are three tips for staying focused while studying?",
             "Write a short story about a robot who learns to paint.",
             "How does a refrigerator keep food cold?"]


def _paragraphs(n: int) -> list[str]:
    """``n`` WikiText-2 test paragraphs of 400-1,000 characters, the dataset's spacing
    around punctuation undone."""
    out = []
    for line in benchlib.WIKI.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("=") or not 400 <= len(line) <= 1000:
            continue
        for a, b in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" ,", ","), (" .", "."),
                     (" 's", "'s"), ("( ", "("), (" )", ")"), (" ;", ";"), (" :", ":")):
            line = line.replace(a, b)
        out.append(line)
        if len(out) == n:
            break
    return out


def prompts(per_kind: int) -> dict[str, list[tuple[str, bool]]]:
    """``{kind: [(text, chat), ...]}``."""
    paras = _paragraphs(2 * per_kind)
    return {
        "copy": [(f"Repeat the following text word for word:\n\n{p}", True) for p in paras[:per_kind]],
        "summarize": [(f"Summarize the following text in a few sentences:\n\n{p}", True)
                      for p in paras[per_kind:2 * per_kind]],
        "chat": [(q, True) for q in QUESTIONS[:per_kind]],
        "continue": [(PROMPT_TEXT, False)],
    }


def _token_ids(folder: str, items: list[tuple[str, bool]]) -> list[list[int]]:
    from edgeprune_runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(folder)
    out = []
    for text, chat in items:
        if chat:
            out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                                  add_special_tokens=False))
        else:
            out.append(tok.encode(text)[:128])
    return out


# ---------------------------------------------------------------------------------------------
# workers (fresh processes; each imports only what its venv has)
# ---------------------------------------------------------------------------------------------

def worker_ours(folder: str, threads: int, gen_len: int, lookup: int, ids_json: str) -> dict:
    """Our runtime over every prompt: decode tok/s, tokens, drafts per prompt."""
    import edgeprune_runtime as runtime

    prompts_ = json.loads(Path(ids_json).read_text())
    s = runtime.load(folder, threads=threads, max_length=max(map(len, prompts_)) + gen_len + 8)
    s.generate(prompts_[0][:16], max_new_tokens=4, prompt_lookup_num_tokens=lookup)   # warm-up
    res = []
    for ids in prompts_:
        r = s.generate(ids, max_new_tokens=gen_len, prompt_lookup_num_tokens=lookup)
        res.append({"decode_tok_s": r.decode_tok_s, "tokens": len(r.token_ids[0]),
                    "draft_tokens": r.draft_tokens, "accepted_draft_tokens": r.accepted_draft_tokens})
    return {"prompts": res, "peak_rss_bytes": _vm_hwm()}


def worker_llamacpp(gguf: str, threads: int, gen_len: int, lookup: int, ids_json: str) -> dict:
    """llama-cpp-python over every prompt (same ids), greedy ``Llama.generate``, its own
    prompt-lookup draft model when ``lookup`` > 0."""
    from llama_cpp import Llama

    prompts_ = json.loads(Path(ids_json).read_text())
    llm = Llama(model_path=gguf, n_ctx=max(map(len, prompts_)) + gen_len + lookup + 8, n_batch=512,
                n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False,
                **llama_lookup_kwargs(lookup))
    eos = llm.token_eos()
    llama_generate(llm, prompts_[0][:16], 4, eos)    # warm-up
    res = []
    for ids in prompts_:
        out, _, st = llama_generate(llm, ids, gen_len, eos)
        res.append({"decode_tok_s": (len(out) - 1) / (st[-1] - st[0]) if len(out) > 1 else 0.0,
                    "tokens": len(out)})
    return {"prompts": res, "peak_rss_bytes": _vm_hwm()}


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(ap, "1 round, 1 thread, 2 prompts per kind, the data-free rtn-g32 "
                                 "export unless default is cached (~5 min)")
    ap.add_argument("--repeat", type=int, default=None, help="rounds (default 3, quick 1)")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="default 1 2 (quick 1)")
    ap.add_argument("--per-kind", type=int, default=None, help="prompts per kind (default 3, quick 2)")
    ap.add_argument("--lookup", type=int, default=10, help="draft tokens at most (both runtimes)")
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        mode, path, *rest = a.worker
        fn = {"ours": worker_ours, "llamacpp": worker_llamacpp}[mode]
        print(json.dumps(fn(path, *map(int, rest[:3]), rest[3])))
        return 0

    repeat = a.repeat or (1 if a.quick else 3)
    threads = a.threads or ([1] if a.quick else [1, 2])
    per_kind = a.per_kind or (2 if a.quick else 3)

    def log(msg):
        print(msg, flush=True)

    t0 = time.perf_counter()
    variant = benchlib.quick_variants()[-1] if a.quick else "default"
    folder = benchlib.ours_folder(variant)
    err = benchlib.ensure_ours(folder, log, variant)
    if err:
        log(f"our export failed: {err}")
        return 1
    log(f"ours: {variant} = {benchlib.OURS_VARIANTS[variant]}")
    sfx = "" if variant == "default" else f"/{variant}"     # the case names say which export
    py, peer_err = ensure_llamacpp(CACHE / "venv-build.log")
    gguf = ensure_gguf(py, "q4_0", log)
    if py and gguf is None:
        peer_err = "no Q4_0 GGUF: re-quantizing the shipped Q4_1 failed (see above)"
    kinds = prompts(per_kind)
    ids = {k: _token_ids(str(folder), v) for k, v in kinds.items()}
    CACHE.mkdir(parents=True, exist_ok=True)
    ids_file = CACHE / "lookup_prompts.json"
    flat = [(k, i) for k in ids for i in range(len(ids[k]))]
    ids_file.write_text(json.dumps([ids[k][i] for k, i in flat]))

    runs: dict[tuple, list] = {}       # (who, lookup, threads) -> [per-prompt lists per round]
    for rep in range(repeat):
        for t in threads:
            jobs = [("ours", sys.executable, str(folder))]
            if py and not peer_err:
                jobs.append(("llama.cpp", py, str(gguf)))
            order = [(w, exe, p, k) for w, exe, p in jobs for k in (0, a.lookup)]
            for who, exe, path, k in (order if rep % 2 == 0 else order[::-1]):
                mode = "ours" if who == "ours" else "llamacpp"
                r = _spawn(exe, mode, [path, t, a.gen_len, k, str(ids_file)], 1800, script=__file__)
                if "error" in r:
                    log(f"{who} lookup={k} t{t}: {r['error'][:300]}")
                    continue
                runs.setdefault((who, k, t), []).append(r["prompts"])
        log(f"round {rep + 1}/{repeat} done ({time.perf_counter() - t0:.0f} s)")

    def per_kind_median(who, k, t, kind, key="decode_tok_s"):
        rounds = runs.get((who, k, t))
        if not rounds:
            return None
        idx = [j for j, (kk, _) in enumerate(flat) if kk == kind]
        vals = [statistics.median(r[j][key] for r in rounds) for j in idx]
        return statistics.median(vals)

    def acceptance(t, kind):
        rounds = runs.get(("ours", a.lookup, t)) or []
        idx = [j for j, (kk, _) in enumerate(flat) if kk == kind]
        d = sum(r[j]["draft_tokens"] for r in rounds for j in idx)
        return sum(r[j]["accepted_draft_tokens"] for r in rounds for j in idx) / d if d else None

    records = []
    hdr = (f"{'case':<16}{'ours plain':>11}{'ours lookup':>12}{'speedup':>9}{'confirmed':>10}"
           f"{'l.cpp plain':>12}{'l.cpp lookup':>13}{'speedup':>9}{'lookup ours/l.cpp':>19}")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for t in threads:
        for kind in kinds:
            case = f"{kind}/t{t}{sfx}"
            op, ol = per_kind_median("ours", 0, t, kind), per_kind_median("ours", a.lookup, t, kind)
            tp, tl = per_kind_median("llama.cpp", 0, t, kind), per_kind_median("llama.cpp", a.lookup, t, kind)
            acc = acceptance(t, kind)
            su_o = ol / op if op and ol else None
            su_t = tl / tp if tp and tl else None

            def f(x, w, fmt="{:.1f}"):
                return (fmt.format(x) if x is not None else "-").rjust(w)
            print(f"{case:<16}{f(op, 11)}{f(ol, 12)}{f(su_o, 9, '{:.2f}x')}{f(acc, 10, '{:.0%}')}"
                  f"{f(tp, 12)}{f(tl, 13)}{f(su_t, 9, '{:.2f}x')}"
                  f"{f(ol / tl if ol and tl else None, 19, '{:.2f}x')}")
            records += [benchlib.record(case, "decode_tok_s", ol, peer=PEER, theirs=tl),
                        benchlib.record(case, "plain_decode_tok_s", op, peer=PEER, theirs=tp),
                        benchlib.record(case, "lookup_speedup", su_o, peer=PEER, theirs=su_t),
                        benchlib.record(case, "draft_acceptance", acc)]
            if tp is None:
                records.append(benchlib.error_record(case, peer_err or "not run", peer=PEER))
    print(f"\nup to {a.lookup} draft tokens, greedy, <= {a.gen_len} new tokens (eos honoured), "
          f"{per_kind} prompt(s) per kind, {repeat} round(s), medians; {time.perf_counter() - t0:.0f} s. "
          f"Shared machine: differences under 10-15% are noise. Ours: {variant} = "
          f"{benchlib.OURS_VARIANTS[variant]}.")
    if a.json:
        benchlib.write_records(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
