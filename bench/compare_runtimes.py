"""Our int4 ONNX export + runtime vs onnxruntime-genai's int4 model, side by side.

Both models come from the same weights (SmolLM2-135M-Instruct dequantized to fp32):
ours via ``exporters.export_onnx(precision="int4")`` (RTN asym, group 32, accuracy
level 4, 8-bit lm_head shared with the embedding), theirs via onnxruntime-genai's model
builder (``-p int4 -e cpu``: RTN sym block 32, accuracy level 4, int4 lm_head) run in
its own virtualenv ``.venv-ortgenai``. Each measurement runs in a fresh subprocess:
batch 1, a 128-token WikiText-2 prompt (the same ids for both), 128 greedy new tokens
(EOS ignored), 1 and 2 intra-op threads, KV cache sized 256 for both. Cases
``int4-t1``/``int4-t2`` use what ``edgeprune run`` ships by default (the best-w4 preset:
GPTQ int4 g64 asym with 8-bit v_proj and layers.0 down_proj, calibrated on text sampled from
the model; 8-bit lm_head shared with the embedding; ``benchlib.OURS_VARIANTS``);
``int4-rtn-g32-t*`` the plain ``export_onnx(precision="int4", group_size=32)`` of the dense
weights (data-free RTN asym block 32, block for block like the peer) and ``int4-rtn-g32-lmhead4-t*`` the same with
an int4 lm_head like the peer's builder default (like-for-like bytes per token). Reported: decode
tokens/s (127 steps after the first token), time to first token, peak RSS (the kernel's
``VmHWM`` of the worker, cross-checked by psutil polling from the parent), model file
size; medians over ``--repeat`` runs, ratios ours/theirs.

    python bench/compare_runtimes.py --quick --json bench/results/compare_runtimes.json
    python bench/compare_runtimes.py --model qwen2.5-coder-0.5b --json bench/results/compare_runtimes_qwen2.5-coder-0.5b.json

``--model ALIAS`` (Qwen2.5-Coder-0.5B, Gemma-3-270M): ours is that family's export
``--variant`` (default ``rtn-g64``, the data-free RTN int4 g64 asym that
``compare_llamacpp.py`` measures, shared through ``bench/.cache``), theirs the builder's int4
of the same dequantized weights; cases start with ``ALIAS/``. ``--ppl-windows N`` (default
40, quick 4, 0 = skip) adds WikiText-2 perplexity of both int4 models on the same
512-token windows (no BOS, ``compare_llamacpp``'s protocol): ours through the runtime,
theirs by running the builder's ``model.onnx`` in a plain onnxruntime session (the graph
onnxruntime-genai runs; one pass per window from an empty cache), metric ``wikitext2_ppl``.

``--quick``: 2 repeats, and the ``int4-t*`` cases only when a current ``default`` export
is already cached (building it takes 30+ min); the two data-free RTN exports take 1-3 min
each, the peer's venv (``make bench-peers``) and its model builder a few more.

``--ops`` also traces one generation per side and thread count with onnxruntime's own
profiler (ours: ``runtime.load(profile_prefix=...)``; theirs: ``session_options.enable_profiling``
in a copy of the builder's ``genai_config.json``) and puts a decode step side by side by
operator type (``edgeprune_devices.profiler.ops.op_breakdown``; records
``<case>/op/<type>`` ``decode_us_per_step`` and ``nodes_per_step``): where one graph spends
the time the other does not. Tracing slows every node, so compare the shares; the speeds
come from the timed runs::

    python bench/compare_runtimes.py --model gemma3-270m --variant gptq-g128-h4 --repeat 4 --ops \
        --ppl-windows 0 --json bench/results/compare_runtimes_gemma3-270m_gptq-g128-h4.json

JSON: a list of ``{"case", "metric", "ours", "peer", "theirs"}`` with metrics
``decode_tok_s``, ``ttft_ms``, ``peak_rss_mib``, ``file_mib``; cases ``int4-t1``,
``int4-t2``...; peer ``onnxruntime-genai``. A failure is recorded (the figure null, plus an
``error`` record with the message), never hidden. Timings on a shared 2-core machine are
noisy.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import benchlib

PEER = "onnxruntime-genai"
PROMPT_LEN, NEW_TOKENS, MAX_LENGTH = 128, 128, 256


# ----------------------------------------------------------------------------- workers
def _vm_hwm() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_ours(folder: str, threads: int, ids: list[int], new: int,
                max_length: int = MAX_LENGTH, trace: Optional[str] = None) -> dict:
    """A warm-up, then one generation of ``new`` tokens by our runtime. ``trace``: traced by
    onnxruntime's profiler (``runtime.load(profile_prefix=...)``), the trace moved there."""
    import edgeprune_runtime as runtime
    t0 = time.perf_counter()
    s = runtime.load(folder, threads=threads, max_length=max_length,
                     profile_prefix=trace and str(Path(trace).with_suffix("")) + "-ort")
    load_s = time.perf_counter() - t0
    s.eos_token_ids = []                      # always generate `new` tokens
    s.generate(ids[:16], max_new_tokens=4)    # warm-up (kernels, arena)
    r = s.generate(ids, max_new_tokens=new)
    if trace:
        shutil.move(str(s.end_profiling()), trace)
    return {"decode_tok_s": r.decode_tok_s, "ttft_ms": r.ttft_ms, "load_s": load_s,
            "n_tokens": len(r.token_ids[0]), "peak_rss_bytes": _vm_hwm(),
            "tokens": r.token_ids[0][:16]}


def worker_genai(folder: str, threads: int, ids: list[int], new: int,
                 max_length: int = MAX_LENGTH, trace: Optional[str] = None) -> dict:
    """The same with onnxruntime-genai. ``trace``: the folder's ``genai_config.json`` turns
    its profiler on (:func:`_thread_folder` ``profile``); the trace, written when the model
    is released, is moved there."""
    import numpy as np
    import onnxruntime_genai as og
    t0 = time.perf_counter()
    cfg = og.Config(folder)
    model = og.Model(cfg)
    tokenizer = og.Tokenizer(model)           # an app needs it (ours loads its tokenizer too)
    load_s = time.perf_counter() - t0

    def run(prompt, n):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=max_length, min_length=len(prompt) + n,
                                  do_sample=False)
        gen = og.Generator(model, params)
        t = time.perf_counter()
        gen.append_tokens(np.array(prompt, dtype=np.int32))
        gen.generate_next_token()
        out = [int(gen.get_next_tokens()[0])]
        ttft = time.perf_counter() - t
        td = time.perf_counter()
        while len(out) < n and not gen.is_done():
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        dec = time.perf_counter() - td
        return out, ttft, dec

    run(ids[:16], 4)
    out, ttft, dec = run(ids, new)
    tokenizer.decode(np.array(out, dtype=np.int32))
    if trace:
        prefix = json.loads((Path(folder) / "genai_config.json").read_text()
                            )["model"]["decoder"]["session_options"]["enable_profiling"]
        del tokenizer, model                  # the session writes its trace when released
        got = sorted(Path(prefix).parent.glob(Path(prefix).name + "*.json"))
        if not got:
            raise RuntimeError("onnxruntime-genai wrote no profile")
        shutil.move(str(got[-1]), trace)
    return {"decode_tok_s": (len(out) - 1) / dec, "ttft_ms": ttft * 1e3, "load_s": load_s,
            "n_tokens": len(out), "peak_rss_bytes": _vm_hwm(), "tokens": out[:16]}


def worker_genai_ppl(folder: str, windows_json: str, threads: int) -> dict:
    """Perplexity of the builder's int4 model on ``windows_json`` (lists of token ids):
    its ``genai_config.json`` decoder file in an onnxruntime session, each window one pass
    from an empty KV cache (the same graph and kernels onnxruntime-genai runs). Runs in the
    peer's venv (onnxruntime + numpy only)."""
    import numpy as np
    import onnxruntime as ort

    cfg = json.loads((Path(folder) / "genai_config.json").read_text())["model"]
    dec = cfg["decoder"]
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = int(threads), 1
    sess = ort.InferenceSession(str(Path(folder) / dec["filename"]), so, providers=["CPUExecutionProvider"])
    kv, hd = int(dec["num_key_value_heads"]), int(dec["head_size"])
    # a sliding-window GroupQueryAttention needs a KV buffer of at least its window
    # (onnxruntime-genai preallocates max_length): zeros of that capacity, nothing cached
    window = int(((dec.get("sliding_window") or {}).get("window_size")) or 0)
    np_type = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
               "tensor(float16)": np.float16}
    ins = {i.name: np_type.get(i.type, np.float32) for i in sess.get_inputs()}
    out_name = next(o.name for o in sess.get_outputs() if o.name == "logits")

    def logits(w):
        n = len(w)
        feed = {}
        for name, dt in ins.items():
            if name == "input_ids":
                feed[name] = np.asarray([w], dt)
            elif name == "attention_mask":
                feed[name] = np.ones((1, n), dt)
            elif name == "position_ids":
                feed[name] = np.arange(n, dtype=dt)[None]
            elif name.startswith("past_key_values"):
                feed[name] = np.zeros((1, kv, max(window, n) if window else 0, hd), dt)
            else:
                raise RuntimeError(f"unknown input {name} of the builder's model")
        return sess.run([out_name], feed)[0][0].astype(np.float32)

    windows = json.loads(Path(windows_json).read_text())
    import compare_llamacpp as cl            # numpy-only helper, no project imports
    return cl._nll_of_windows(logits, windows)


# ----------------------------------------------------------------------------- driver
def op_records(case: str, ours: dict, theirs: Optional[dict]) -> list[dict]:
    """Records of two :func:`edgeprune_devices.profiler.ops.op_breakdown` results (ours,
    the peer's; decode steps): per operator type ``decode_us_per_step`` and
    ``nodes_per_step``, case ``<case>/op/<type>``, plus ``<case>/op`` totals
    (``traced_step_us``, ``outside_nodes_us_per_step``)."""
    def table(b):
        return {o["op"]: o for o in b["decode"]["ops"]} if b else {}
    o, t = table(ours), table(theirs)
    recs = []
    for op in sorted(set(o) | set(t), key=lambda k: -max(o.get(k, {}).get("us_per_run", 0),
                                                        t.get(k, {}).get("us_per_run", 0))):
        for metric, key in (("decode_us_per_step", "us_per_run"), ("nodes_per_step", "nodes_per_run")):
            recs.append(benchlib.record(f"{case}/op/{op}", metric, o.get(op, {}).get(key, 0.0), peer=PEER,
                                        theirs=t.get(op, {}).get(key, 0.0) if theirs else None))
    for metric, key in (("traced_step_us", "run_us_median"), ("outside_nodes_us_per_step", "outside_nodes_us_per_run")):
        recs.append(benchlib.record(f"{case}/op", metric, ours["decode"][key], peer=PEER,
                                    theirs=theirs["decode"][key] if theirs else None))
    return recs


def _max_length(theirs: Optional[Path]) -> int:
    """Both sides' ``max_length``: :data:`MAX_LENGTH`, or the peer's sliding window where
    its model has one (onnxruntime-genai's ``GroupQueryAttention`` refuses a KV buffer
    shorter than ``local_window_size``: Gemma 3's 512), so both allocate alike."""
    try:
        cfg = json.loads((theirs / "genai_config.json").read_text())
        ws = int(cfg["model"]["decoder"]["sliding_window"]["window_size"])
    except (OSError, TypeError, KeyError, ValueError, AttributeError):
        return MAX_LENGTH
    return max(MAX_LENGTH, ws)


def _run_worker(py: Path, impl: str, folder: Path, threads: int, prompt: Path, new: int,
                timeout: float = 600, max_length: int = MAX_LENGTH, trace: Optional[Path] = None) -> dict:
    import psutil
    cmd = [str(py), str(Path(__file__).resolve()), "--worker", impl, "--folder", str(folder),
           "--threads", str(threads), "--prompt", str(prompt), "--new", str(new),
           "--max-length", str(max_length)] + (["--trace", str(trace)] if trace else [])
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=benchlib.worker_env(OMP_NUM_THREADS=threads))
    proc = psutil.Process(p.pid)
    sampled = 0
    t0 = time.time()
    while p.poll() is None:
        try:
            sampled = max(sampled, proc.memory_info().rss)
        except psutil.Error:
            pass
        if time.time() - t0 > timeout:
            p.kill()
            break
        time.sleep(0.02)
    out, err = p.communicate()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"error": f"rc={p.returncode}: {(err or out)[-1500:]}"}
    rec = json.loads(lines[-1])
    rec["psutil_peak_rss_bytes"] = sampled
    return rec


def _build_theirs(info: dict, hf: Path, theirs: Path, work: Path, log, rebuild: bool) -> None:
    """The peer's venv and its int4 model of the HF folder ``hf`` into ``theirs``
    (``info["genai_py"]``, ``info["theirs"]``; a failure goes to ``info["errors"]``)."""
    try:
        py = benchlib.ensure_peer("ortgenai", log=work / "venv-ortgenai.log")
        info["genai_py"] = py
        if rebuild or not (theirs / "model.onnx").exists():
            shutil.rmtree(theirs, ignore_errors=True)
            t = time.perf_counter()
            # the builder behind a config shim (Gemma 3 under transformers 5.x: _genai_builder.py)
            r = subprocess.run([str(py), str(Path(__file__).with_name("_genai_builder.py")), "-i", str(hf),
                                "-o", str(theirs), "-p", "int4", "-e", "cpu", "-c",
                                str(work / "genai-cache")], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"builder failed: {(r.stderr or r.stdout)[-1500:]}")
            log(f"theirs: built in {time.perf_counter() - t:.1f}s")
        info["theirs"] = theirs
    except Exception as e:  # noqa: BLE001  (record the peer failure)
        info["errors"][PEER] = str(e)
        log(f"peer {PEER} unavailable: {e}")


def _prepare_family(model: str, variant: str, work: Path, log, rebuild: bool) -> dict:
    """Another family's side by side: our cached export ``variant`` of ``model``
    (``benchlib.ensure_ours``, shared with ``compare_llamacpp.py``), the dense weights
    saved as an HF folder for the peer's builder, theirs, the prompt."""
    info: dict = {"errors": {}}
    folder = benchlib.ours_folder(variant, model)
    err = benchlib.ensure_ours(folder, log, variant, model)
    if err:
        info["errors"]["ours"] = err
    else:
        info["ours"] = folder
    hf, theirs, prompt = work / "hf-fp32", work / "genai-int4", work / "prompt.json"
    if rebuild or not (hf / "config.json").exists() or not prompt.exists():
        from edgeprune.models import load_model
        m, tok = load_model(model)
        if rebuild or not (hf / "config.json").exists():
            tmp = hf.with_name(hf.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            m.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            shutil.rmtree(hf, ignore_errors=True)
            tmp.rename(hf)
        ids = tok(benchlib.WIKI.read_text()[:20000], add_special_tokens=False)["input_ids"]
        prompt.write_text(json.dumps(ids[1000:1000 + PROMPT_LEN]))
        del m
    _build_theirs(info, hf, theirs, work, log, rebuild)
    info["prompt"] = prompt
    return info


def quality_genai(info: dict, model: str, nwin: int, threads: int, log) -> list[dict]:
    """WikiText-2 perplexity of ours and theirs on the same ``nwin`` windows of 512 tokens
    (our export's tokenizer; no BOS): records ``wikitext2_ppl`` per side."""
    from tokenizers import Tokenizer

    import compare_llamacpp as cl
    case = f"{model}/int4-ppl"
    if "ours" not in info:
        return [benchlib.error_record(case, info["errors"].get("ours", "no export"), peer=PEER, side="ours")]
    tk = Tokenizer.from_file(str(info["ours"] / "tokenizer.json"))
    ids = tk.encode(benchlib.WIKI.read_text(), add_special_tokens=False).ids
    wins = [ids[i * 512:(i + 1) * 512] for i in range(min(nwin, len(ids) // 512))]
    wfile = benchlib.CACHE / f"{model}_wikitext_windows_{len(wins)}x512_runtimes.json"
    wfile.write_text(json.dumps(wins))
    ours = cl._spawn(sys.executable, "ppl_ours", [info["ours"], wfile, threads], 3 * 3600,
                     script=str(Path(cl.__file__)))
    theirs = ({"error": info["errors"].get(PEER, "no peer model")} if "theirs" not in info else
              cl._spawn(str(info["genai_py"]), "genai_ppl", ["--folder", info["theirs"], "--prompt", wfile,
                                                           "--threads", threads], 3 * 3600,
                        script=__file__))
    log(f"perplexity ({len(wins)} x 512): ours {ours.get('ppl', ours.get('error'))}, "
        f"theirs {theirs.get('ppl', theirs.get('error'))}")
    recs = [benchlib.record(case, "wikitext2_ppl", ours.get("ppl"), peer=PEER, theirs=theirs.get("ppl")),
            benchlib.record(case, "ppl_windows", len(wins), peer=PEER, theirs=len(wins))]
    for side, r in (("ours", ours), ("theirs", theirs)):
        if "error" in r:
            recs.append(benchlib.error_record(case, r["error"], peer=PEER, side=side))
    return recs


def _prepare(work: Path, log, rebuild: bool, quick: bool) -> dict:
    """Export ours, build theirs (own venv), write the prompt. Returns paths/errors.
    ``quick``: the shipped default export only if a current one is cached."""
    info: dict = {"errors": {}}
    # g32 in the folder name: exports cached before group_size=32 was explicit were g64
    ours, hf, theirs = work / "ours-int4-g32", work / "hf-fp32", work / "genai-int4"
    ours4 = work / "ours-int4-g32-lmhead4"
    prompt = work / "prompt.json"
    need_model = rebuild or not all(p.exists() for p in (ours / "model.onnx",
                                                         ours4 / "model.onnx", hf / "config.json"))
    if need_model or not prompt.exists():
        from edgeprune.models import load_model
        import edgeprune_exporters as exporters
        model, tok = load_model("smollm2-135m")
        if rebuild or not (ours / "model.onnx").exists():
            t = time.perf_counter()
            res = exporters.export_onnx(model, tok, ours, precision="int4", group_size=32,
                                        overwrite=True, max_length=2048,
                                        provenance={"bench": "compare_runtimes"})
            log(f"ours: exported in {time.perf_counter() - t:.1f}s: {res.summary()}")
        if rebuild or not (ours4 / "model.onnx").exists():
            # like-for-like with the peer's builder default: int4 lm_head (shared table)
            res = exporters.export_onnx(model, tok, ours4, precision="int4", lm_head="int4",
                                        group_size=32, overwrite=True, max_length=2048,
                                        provenance={"bench": "compare_runtimes"})
            log(f"ours (int4 lm_head): {res.summary()}")
        if rebuild or not (hf / "config.json").exists():
            model.save_pretrained(hf)
            tok.save_pretrained(hf)
        text = benchlib.WIKI.read_text()
        ids = tok(text[:20000], add_special_tokens=False)["input_ids"][1000:1000 + PROMPT_LEN]
        prompt.write_text(json.dumps(ids))
        del model
    info["ours"] = ours
    info["ours4"] = ours4
    # what `edgeprune run` ships: best-w4, self-calibrated (cached, shared with
    # bench/compare_llamacpp.py); --quick never builds it
    if not quick or "default" in benchlib.quick_variants():
        err = benchlib.ensure_ours(benchlib.ours_folder("default"), log, "default")
        if err:
            info["errors"]["default"] = err
        else:
            info["default"] = benchlib.ours_folder("default")
    else:
        log("quick: no current cached `default` export, so no int4-t* cases (building it takes "
            "30+ min: run once without --quick or bench/compare_llamacpp.py)")
    _build_theirs(info, hf, theirs, work, log, rebuild)    # the peer: own venv + its builder
    info["prompt"] = prompt
    return info


def _thread_folder(base: Path, threads: int, profile: Optional[Path] = None) -> Path:
    """A copy of the genai folder whose genai_config.json pins intra_op_num_threads
    (``profile``: and turns onnxruntime's profiler on, traces named ``<profile>_<date>.json``)."""
    d = base.parent / f"{base.name}-t{threads}{'-ops' if profile else ''}"
    d.mkdir(exist_ok=True)
    for f in base.iterdir():
        if f.name != "genai_config.json" and not (d / f.name).exists():
            (d / f.name).symlink_to(f.resolve())
    cfg = json.loads((base / "genai_config.json").read_text())
    so = cfg["model"]["decoder"].setdefault("session_options", {})
    so["intra_op_num_threads"] = threads
    so["inter_op_num_threads"] = 1
    if profile:
        so["enable_profiling"] = str(profile)
    cfg["search"]["max_length"] = MAX_LENGTH
    (d / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return d


def _ops(info: dict, threads, name: str, work: Path, max_len: int, log) -> list[dict]:
    """``--ops``: one more traced run of each side's worker (``trace``; theirs on a
    :func:`_thread_folder` with the profiler on), a decode step by operator type side by
    side (printed, and :func:`op_records`)."""
    from edgeprune_devices.profiler.ops import op_breakdown

    records = []
    for t in threads:
        got = {}
        for side, py, impl, folder in (
                ("ours", Path(sys.executable), "ours", info.get("ours")),
                ("theirs", info.get("genai_py"), "genai",
                 info.get("theirs") and _thread_folder(info["theirs"], t, work / f"genai-ort-t{t}"))):
            if folder is None or py is None:
                continue
            trace = work / f"trace-{side}-t{t}.json"
            r = _run_worker(py, impl, folder, t, info["prompt"], NEW_TOKENS, max_length=max_len, trace=trace)
            if "error" in r or not trace.exists():
                records.append(benchlib.error_record(f"{name}-t{t}/op", f"{side} trace failed: "
                                                     f"{r.get('error', 'no trace written')[-800:]}", peer=PEER))
                continue
            got[side] = op_breakdown(trace, decode_steps=NEW_TOKENS - 1)
        if "ours" not in got:
            continue
        o, th = got["ours"]["decode"], (got.get("theirs") or {}).get("decode")
        log(f"decode step by operator type, {t} thread(s) (traced: ours {o['run_us_median']:.0f} us"
            + (f", theirs {th['run_us_median']:.0f} us" if th else "") + " per step)")
        to = {x["op"]: x for x in (th or {}).get("ops", [])}
        for x in o["ops"][:10]:
            y = to.get(x["op"], {})
            log(f"  {x['op']:<34}{x['us_per_run']:9.0f} us {x['nodes_per_run']:5.0f} nodes   theirs "
                f"{y.get('us_per_run', 0):9.0f} us {y.get('nodes_per_run', 0):5.0f} nodes")
        records += op_records(f"{name}-t{t}", got["ours"], got.get("theirs"))
    return records


def quality(folder: Path, nwindows: int, log) -> list[dict]:
    """WikiText-2 perplexity (512-token windows) of our int4 export vs the PyTorch
    fake-quantized model with the same integer weights (the issue's 0.5% criterion)."""
    import edgeprune_runtime as runtime
    from edgeprune.evaluate import perplexity
    from edgeprune.models import load_model
    from edgeprune_exporters import BUILDERS, BuildOptions, DecoderSpec
    from edgeprune_exporters.validate import substituted_weights
    model, tok = load_model("smollm2-135m")
    text = benchlib.WIKI
    spec = DecoderSpec.from_model(model)
    b = BUILDERS[spec.architecture](model, spec, BuildOptions(precision="int4", lm_head="q8",
                                                              max_length=2048))
    b.build()
    with substituted_weights(model, b.int_weights):
        ref = perplexity(model, tok, text, nwindows=nwindows, progress=False).ppl
    with runtime.load(folder, max_length=512) as s:
        got = perplexity(lambda ids: s.logits(ids.numpy()), tok, text, nwindows=nwindows,
                         progress=False).ppl
    log(f"quality: torch fake-quant ppl {ref:.3f}, ours {got:.3f} ({100 * (got / ref - 1):+.2f}%)")
    return [benchlib.record("int4-quality", "wikitext2_ppl", got, peer="pytorch", theirs=ref)]


def _size_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in Path(folder).iterdir()
               if f.name.startswith("model.onnx")) / 2 ** 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(ap, "2 repeats; the default export only if cached (< 10 min once "
                                 ".venv-ortgenai exists)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="speed runs per side and thread count (default 5, quick 2; 0: perplexity only)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--work", type=Path, default=benchlib.CACHE / "compare_runtimes")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--quality", type=int, default=0, metavar="N",
                    help="also compare WikiText-2 perplexity on N windows vs PyTorch (slow)")
    ap.add_argument("--model", default=benchlib.SMOLLM2, metavar="ALIAS",
                    help="an edgeprune.load_model alias: smollm2-135m (default), qwen2.5-coder-0.5b, "
                         "gemma3-270m")
    ap.add_argument("--variant", default="rtn-g64",
                    help="our export of the other models (benchlib.OURS_VARIANTS; default %(default)s)")
    ap.add_argument("--ppl-windows", type=int, default=None,
                    help="WikiText-2 512-token windows for both int4 models' perplexity (default 40 for "
                         "the other models, quick 4, SmolLM2 0; 0 = skip)")
    ap.add_argument("--ops", action="store_true",
                    help="also trace one generation per side and thread count with onnxruntime's "
                         "profiler and compare a decode step by operator type (records "
                         "<case>/op/<type> decode_us_per_step, nodes_per_step; traced steps are "
                         "slower than timed ones: compare the shares)")
    ap.add_argument("--worker", choices=["ours", "genai", "genai_ppl"], help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--prompt", help=argparse.SUPPRESS)
    ap.add_argument("--new", type=int, default=NEW_TOKENS, help=argparse.SUPPRESS)
    ap.add_argument("--max-length", type=int, default=MAX_LENGTH, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker == "genai_ppl":
        print(json.dumps(worker_genai_ppl(a.folder, a.prompt, a.threads[0])))
        return 0
    if a.worker:
        ids = json.loads(Path(a.prompt).read_text())
        fn = worker_ours if a.worker == "ours" else worker_genai
        print(json.dumps(fn(a.folder, a.threads[0], ids, a.new, a.max_length, a.trace)))
        return 0

    smol = a.model == benchlib.SMOLLM2
    if not smol and a.work == benchlib.CACHE / "compare_runtimes":
        a.work = benchlib.CACHE / f"compare_runtimes-{a.model}"
    a.work.mkdir(parents=True, exist_ok=True)
    repeat = a.repeat if a.repeat is not None else (2 if a.quick else 5)
    log = lambda m: print(f"[compare_runtimes] {m}", flush=True)  # noqa: E731
    info = (_prepare(a.work, log, a.rebuild, a.quick) if smol else
            _prepare_family(a.model, a.variant, a.work, log, a.rebuild))
    runs: dict = {}
    names_log = "rtn-g32" if smol else a.variant
    max_len = _max_length(info.get("theirs"))
    if max_len != MAX_LENGTH:
        log(f"max_length {max_len} on both sides (the peer's sliding window)")
    run = functools.partial(_run_worker, max_length=max_len)
    for t in a.threads:
        for rep in range(repeat):          # interleave ours/theirs to share the noise
            if "default" in info:
                rd = run(Path(sys.executable), "ours", info["default"], t, info["prompt"],
                                 NEW_TOKENS)
                runs.setdefault(("default", t), []).append(rd)
            r = (run(Path(sys.executable), "ours", info["ours"], t, info["prompt"], NEW_TOKENS)
                 if "ours" in info else {"error": info["errors"].get("ours")})
            runs.setdefault(("ours", t), []).append(r)
            if "ours4" in info:
                r4 = run(Path(sys.executable), "ours", info["ours4"], t, info["prompt"],
                                 NEW_TOKENS)
                runs.setdefault(("ours4", t), []).append(r4)
            if "theirs" in info:
                r2 = run(info["genai_py"], "genai", _thread_folder(info["theirs"], t), t,
                                 info["prompt"], NEW_TOKENS)
                runs.setdefault(("theirs", t), []).append(r2)
            log(f"t={t} rep {rep + 1}/{repeat}: ours "
                f"{rd.get('decode_tok_s', rd.get('error')) if 'default' in info else '-'} (default), "
                f"{r.get('decode_tok_s', r.get('error'))} ({names_log})"
                + (f", theirs {r2.get('decode_tok_s', r2.get('error'))}" if "theirs" in info
                   else ""))

    def med(impl, t, key):
        vals = [r[key] for r in runs.get((impl, t), []) if key in r]
        return statistics.median(vals) if vals else None

    records = []
    print(f"\n{'case':<18}{'metric':<14}{'ours':>10}{PEER:>20}{'ratio':>8}")
    impls = [i for i in ("default", "ours", "ours4") if i in info]
    names = ({"default": "int4", "ours": "int4-rtn-g32", "ours4": "int4-rtn-g32-lmhead4"} if smol else
             {"ours": f"{a.model}/int4-{a.variant}"})
    for t, impl in [(t, i) for i in impls for t in a.threads if repeat]:
        case = f"{names[impl]}-t{t}"
        errs = [r["error"] for r in runs.get(("theirs", t), []) if "error" in r]
        oerrs = [r["error"] for r in runs.get((impl, t), []) if "error" in r]
        rows = {
            "decode_tok_s": (med(impl, t, "decode_tok_s"), med("theirs", t, "decode_tok_s")),
            "ttft_ms": (med(impl, t, "ttft_ms"), med("theirs", t, "ttft_ms")),
            "peak_rss_mib": tuple(None if v is None else v / 2 ** 20 for v in
                                  (med(impl, t, "peak_rss_bytes"),
                                   med("theirs", t, "peak_rss_bytes"))),
            "file_mib": (_size_mib(info[impl]),
                         _size_mib(info["theirs"]) if "theirs" in info else None),
        }
        if errs or PEER in info["errors"]:
            records.append(benchlib.error_record(case, (errs or [info["errors"].get(PEER)])[0],
                                                 peer=PEER))
        if oerrs:
            records.append(benchlib.error_record(case, oerrs[0], peer=PEER, side="ours"))
        for metric, (o, th) in rows.items():
            records.append(benchlib.record(case, metric, o, peer=PEER, theirs=th))
            ratio = f"{o / th:.2f}x" if (o and th) else "-"
            print(f"{case:<18}{metric:<14}{o if o is None else round(o, 1)!s:>10}"
                  f"{th if th is None else round(th, 1)!s:>20}{ratio:>8}")
        same = [r.get("tokens") for r in runs.get((impl, t), [])[:1] +
                runs.get(("theirs", t), [])[:1]]
        if len(same) == 2 and all(same):
            n = sum(x == y for x, y in zip(*same))
            print(f"{case:<18}first 16 greedy tokens equal: {n}/16 (different int4 grids)")
    if a.ops:
        records += _ops(info, a.threads, names["ours"], a.work, max_len, log)
    if a.quality and smol:
        records += quality(info["ours"], a.quality, log)
    nwin = a.ppl_windows if a.ppl_windows is not None else (0 if smol else 4 if a.quick else 40)
    if nwin:
        records += quality_genai(info, a.model if not smol else "smollm2-135m", nwin, max(a.threads), log)
        for r in records[-2:]:
            if r["metric"] == "wikitext2_ppl" and r["ours"] and r["theirs"]:
                print(f"{r['case']:<18}wikitext2_ppl {r['ours']:.2f} vs {r['theirs']:.2f} "
                      f"({r['ours'] / r['theirs']:.3f}x)")
    if a.json:
        benchlib.write_records(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
