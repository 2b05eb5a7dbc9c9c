"""Peak resident memory of our int4 export vs llama.cpp, and where ours goes (issue 22).

The protocol of ``compare_llamacpp.py``'s speed runs, kept for memory only: batch 1, a
128-token prompt and 128 greedy new tokens (end of sequence ignored), one warm-up, every
run in a fresh process, peak RSS = ``VmHWM`` of ``/proc/self/status`` at the end (the same
reading on both sides: ``compare_llamacpp.worker_ours`` / ``worker_llamacpp``). No timing
is reported, so it is valid on a loaded machine. Plus, for ours, the resident set after
each stage of one load (``stages``: imports, tokenizer, session, generation; heap
trimmed before each reading), the breakdown that says where the memory goes.

Usage::

    python bench/load_memory.py --model gemma3-270m --variants rtn-g64 \\
        --json bench/results/load_memory_gemma3-270m.json

JSON records ``{"case", "metric", "ours", "peer", "theirs"}``: case
``<alias>/int4-<variant>_vs_<quant>/t<threads>`` metric ``peak_rss_mib`` (median over
``--repeat`` runs, peer ``llama.cpp``) and ``peak_rss_mib_max``; case
``<alias>/int4-<variant>/stages`` metrics ``rss_mib_after_<stage>`` and
``peak_rss_mib_at_<stage>`` (ours only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import benchlib
import compare_llamacpp as cl

STAGES = ("imports", "tokenizer", "session", "generate")


def _status() -> dict:
    """``{"rss": MiB, "hwm": MiB}`` of this process, after handing free heap back."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS:", "VmHWM:")):
            out["rss" if line.startswith("VmRSS") else "hwm"] = int(line.split()[1]) / 1024
    return out


def worker_stages(folder: str, threads: int, prompt_len: int, gen_len: int) -> dict:
    """Our runtime in stages (fresh process): ``{stage: {"rss", "hwm"}}`` in MiB for the
    :data:`STAGES` (the tokenizer loaded alone first, then dropped, then the session
    that loads its own, as an app does; the generation is ``compare_llamacpp``'s)."""
    out = {}
    import edgeprune_runtime as runtime
    from edgeprune_runtime.tokenizer import Tokenizer

    out["imports"] = _status()
    tok = Tokenizer.from_folder(folder)
    out["tokenizer"] = _status()
    del tok
    s = runtime.load(folder, threads=threads, max_length=prompt_len + gen_len + 8)
    out["session"] = _status()
    s.eos_token_ids = []
    ids = cl._repeat_to(s.tokenizer.encode(cl.PROMPT_TEXT), prompt_len)
    s.generate(ids[:16], max_new_tokens=4)
    s.generate(ids, max_new_tokens=gen_len)
    out["generate"] = _status()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(ap, "one run per side (no stages)")
    ap.add_argument("--model", default="gemma3-270m", choices=list(cl.MODELS), metavar="ALIAS")
    ap.add_argument("--variants", default="rtn-g64", help="our exports (benchlib.OURS_VARIANTS)")
    ap.add_argument("--ours", default=None, help="measure this export folder as it is instead")
    ap.add_argument("--quants", nargs="+", default=["q4_0"])
    ap.add_argument("--repeat", type=int, default=3, help="fresh-process runs per side")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        mode, folder, *rest = a.worker
        print(json.dumps({"stages": worker_stages}[mode](folder, *map(int, rest))))
        return 0

    def log(msg):
        print(msg, flush=True)

    model = a.model
    if a.ours:
        dirs = {"ours": Path(a.ours)}
        errs = {"ours": None if (Path(a.ours) / "model.onnx").is_file() else f"no model.onnx in {a.ours}"}
    else:
        dirs = {v: benchlib.ours_folder(v, model) for v in a.variants.split(",") if v}
        errs = {v: benchlib.ensure_ours(d, log, v, model) for v, d in dirs.items()}
    py, peer_err = cl.ensure_llamacpp(cl.CACHE / "venv-build.log")
    ggufs = {q: cl.ensure_gguf(py, q, log, model) for q in a.quants}
    args = [a.threads, a.prompt_len, a.gen_len, 0]
    repeat = 1 if a.quick else a.repeat
    peaks: dict = {}
    for rep in range(repeat):
        jobs = [(v, sys.executable, "ours", d) for v, d in dirs.items() if not errs[v]]
        jobs += [(q, py, "llamacpp", g) for q, g in ggufs.items() if py and g]
        for key, exe, kind, path in (jobs if rep % 2 == 0 else jobs[::-1]):
            r = cl._spawn(exe, kind, [str(path), *args], 900)
            if "error" in r:
                errs[key] = r["error"]
                log(f"{key}: {r['error'][:300]}")
            else:
                peaks.setdefault(key, []).append(r["peak_rss_bytes"] / 2**20)
        log(f"round {rep + 1}/{repeat}: " + ", ".join(f"{k} {v[-1]:.1f} MiB" for k, v in peaks.items()))

    records = []
    if a.ours:
        records.append(benchlib.note_record(f"{model}/int4", f"ours: the export folder {a.ours} "
                                            "(--ours), measured as it is"))
    for v in dirs:
        pref = "int4" if v == "ours" else f"int4-{v}"
        for q in a.quants:
            case = f"{model}/{pref}_vs_{q}/t{a.threads}"
            o, t = peaks.get(v), peaks.get(q)
            records.append(benchlib.record(case, "peak_rss_mib", o and statistics.median(o),
                                           peer=cl.PEER, theirs=t and statistics.median(t)))
            records.append(benchlib.record(case, "peak_rss_mib_max", o and max(o), peer=cl.PEER,
                                           theirs=t and max(t)))
            if o and t:
                log(f"{case}: peak RSS ours {statistics.median(o):.1f} MiB, llama.cpp {q} "
                    f"{statistics.median(t):.1f} MiB ({statistics.median(o) / statistics.median(t):.2f}x)")
            for side, key in (("ours", v), ("theirs", q)):
                if errs.get(key) or (side == "theirs" and not ggufs.get(q)):
                    records.append(benchlib.error_record(case, errs.get(key) or peer_err or
                                                         f"no {q} GGUF", peer=cl.PEER, side=side))
        if not a.quick and not errs[v]:
            st = cl._spawn(sys.executable, "stages", [str(dirs[v]), a.threads, a.prompt_len, a.gen_len],
                           900, script=str(Path(__file__).resolve()))
            if "error" in st:
                records.append(benchlib.error_record(f"{model}/{pref}/stages", st["error"], side="ours"))
                continue
            log(f"{model}/{pref} stages (MiB, resident / peak so far): " +
                ", ".join(f"{k} {st[k]['rss']:.1f} / {st[k]['hwm']:.1f}" for k in STAGES))
            for k in STAGES:
                records.append(benchlib.record(f"{model}/{pref}/stages", f"rss_mib_after_{k}", st[k]["rss"]))
                records.append(benchlib.record(f"{model}/{pref}/stages", f"peak_rss_mib_at_{k}", st[k]["hwm"]))
    if a.json:
        benchlib.write_records(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
