"""Measure an exported folder on this machine and project it to device profiles.

:func:`profile` answers "how fast, and how much memory, on my device?":

* **measured** (on this host, with the profile's thread count and memory budget):
  time to first token, prefill tokens/s, decode tokens/s (median and p90 over every
  decode step of ``repeat`` runs), peak RSS, weights bytes, KV-cache bytes (K and V)
  at the final length. The run happens in a fresh subprocess that imports only the
  runtime (``python -m runtime.profiler --worker``), so peak RSS is what an app
  embedding the runtime would see, not the caller's torch. A sampling thread kills
  the run as soon as RSS exceeds the profile's budget and :func:`profile` raises
  :class:`~runtime.errors.DeviceError`.
* **projected** (for targets not at hand): the roofline model of ``devices.project``
  (bytes moved and operations per token vs the target's bandwidth and compute,
  scaled by the efficiency measured on the host), always labelled "projected".
* **sweep**: decode latency and memory vs context length, drawn to a PNG.

Outputs: :meth:`ProfileReport.to_json`, :meth:`ProfileReport.to_markdown`,
:meth:`ProfileReport.plot`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from .errors import DeviceError, GenerationError, RuntimeLoadError
from .files import atomic_write

__all__ = ["profile", "ProfileReport", "model_work", "gpu_availability", "DEFAULT_SWEEP"]

MiB = 1024 * 1024
DEFAULT_SWEEP = (128, 256, 512, 1024, 2048)
SWEEP_NEW_TOKENS = 16
_BUDGET_EXIT = 3
_PROMPT_TEXT = (
    "Small language models can run on phones, laptops and single-board computers when their "
    "weights are pruned and quantized. The runtime streams the weights from memory once per "
    "generated token, so the memory bandwidth of the device bounds the decoding speed, while "
    "the prompt is processed in one batch whose speed depends on the arithmetic throughput. "
)


# ------------------------------------------------------------------------------------------
# static work per token, read from the graph
# ------------------------------------------------------------------------------------------

def model_work(folder: Union[str, Path]) -> dict[str, Any]:
    """Bytes read and operations per token of an exported graph, from its initializers.

    Each weight initializer is attributed to the operator that consumes it:
    ``MatMulNBits`` (packed int4/int8 codes + scales + zeros; ``2*K*N`` ops),
    ``MatMul``/``Gemm`` with a constant ``[K, N]`` weight (``2*K*N`` ops),
    ``Gather`` (embedding table: one row read per token, no ops), everything else
    (norms, rotary caches, biases) read in full. Attention adds, per token and per
    cached position, ``4 * num_heads * head_dim`` ops per layer (QK^T and AV).

    Returns:
        ``{"weight_bytes_per_token", "weight_ops_per_token", "embedding_bytes",
        "file_bytes", "attn_ops_per_position", "compute", "graph_nodes"}``; ``compute``
        is ``"int8"`` when the linears run MatMulNBits at accuracy level 4 (int8
        activations), else ``"fp32"``; ``graph_nodes``: operators one run executes.
        ``If`` subgraphs count: their weights by the branch that reads more bytes (an
        upper bound), their operators by the longer branch.

    Raises:
        RuntimeLoadError: no readable ``model.onnx``.
    """
    import onnx
    from onnx import numpy_helper  # noqa: F401  (size helpers below)

    folder = Path(folder)
    path = folder / "model.onnx"
    try:
        m = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001
        raise RuntimeLoadError(f"cannot read {path}: {e}", "pass an export folder written by `edgeprune export`") from e
    g = m.graph
    sizes, shapes = _initializer_sizes(g)
    nodes = _executed_nodes(g, sizes, shapes)
    t = _tally(nodes, sizes, shapes)
    weight_bytes, ops, embed, int8 = t["weight_bytes"], t["ops"], t["embed"], t["int8"]
    meta = {}
    try:
        meta = json.loads((folder / "edgeprune.json").read_text())
    except (OSError, ValueError):
        pass
    heads = int(meta.get("num_heads") or 0)
    hd = int(meta.get("head_dim") or 0)
    layers = int(meta.get("num_layers") or 0)
    file_bytes = sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("model.onnx") and p.is_file())
    quant = meta.get("quantization") or {}
    if quant.get("accuracy_level") == 4:
        int8 = True
    return {"weight_bytes_per_token": int(weight_bytes), "weight_ops_per_token": int(ops),
            "embedding_bytes": int(embed), "file_bytes": int(file_bytes),
            "attn_ops_per_position": int(4 * heads * hd * layers),
            "compute": "int8" if int8 else "fp32", "graph_nodes": _node_count(g)}


def _node_count(g) -> int:
    """Operators one run of ``g`` executes, taking each ``If``'s longer branch (a
    COUNTDOWN decode step runs its filtered branch, the longer one)."""
    n = 0
    for node in g.node:
        subs = [_node_count(a.g) for a in node.attribute if a.type == a.GRAPH]
        n += 1 + ((max(subs) if node.op_type == "If" else sum(subs)) if subs else 0)
    return n


def _initializer_sizes(g) -> tuple[dict, dict]:
    """Bytes and dims of every initializer of ``g`` and of its subgraphs, by name."""
    sizes: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    stack = [g]
    while stack:
        graph = stack.pop()
        stack.extend(a.g for n in graph.node for a in n.attribute if a.type == a.GRAPH)
        for t in graph.initializer:
            n = int(np.prod(t.dims)) if len(t.dims) else 1
            item = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 10: 2, 11: 8, 16: 2, 12: 4, 13: 8, 21: 1, 22: 1}.get(t.data_type, 4)
            if t.data_type in (21, 22):  # uint4 / int4: two per byte
                sizes[t.name] = (n + 1) // 2
            else:
                sizes[t.name] = n * item
            shapes[t.name] = list(t.dims)
    return sizes, shapes


def _tally(nodes: list, sizes: dict, shapes: dict) -> dict:
    """Weight bytes read and weight ops of one decode step running ``nodes`` (see
    :func:`model_work`): ``{"weight_bytes", "ops", "embed", "int8"}``."""
    import onnx

    consumers: dict[str, list] = {}
    for node in nodes:
        for i, name in enumerate(node.input):
            if name in sizes:
                consumers.setdefault(name, []).append((node, i))
    # Constant-folded graphs may wrap weights in DequantizeLinear / Transpose; follow one hop.
    produced_by_const_op = {}
    for node in nodes:
        if node.op_type in ("DequantizeLinear", "Transpose", "Cast", "Reshape") and node.input and node.input[0] in sizes:
            produced_by_const_op[node.output[0]] = node.input[0]
    weight_bytes = 0
    ops = 0
    embed = 0
    int8 = False
    seen_nbits = set()
    for node in nodes:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            K, N = int(attrs.get("K", 0)), int(attrs.get("N", 0))
            ops += 2 * K * N
            if int(attrs.get("accuracy_level", 0)) == 4:
                int8 = True
            for name in node.input[1:]:
                if name in sizes and name not in seen_nbits:
                    seen_nbits.add(name)
                    weight_bytes += sizes[name]
        elif node.op_type in ("MatMul", "Gemm", "MatMulInteger"):
            for name in node.input[:2]:
                src = produced_by_const_op.get(name, name)
                if src in sizes and len(shapes.get(src, [])) == 2:
                    K, N = shapes[src]
                    if node.op_type == "Gemm":
                        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                        if attrs.get("transB", 0):
                            K, N = N, K
                    ops += 2 * K * N
    counted = set(seen_nbits)
    for name, users in consumers.items():
        if name in counted:
            continue
        kinds = {n.op_type for n, _ in users}
        if kinds <= {"Gather", "GatherBlockQuantized"} and len(shapes.get(name, [])) >= 2:
            rows = shapes[name][0] or 1
            row_bytes = sizes[name] // rows
            embed += sizes[name]
            weight_bytes += row_bytes
        else:
            weight_bytes += sizes[name]
        counted.add(name)
    for name in produced_by_const_op.values():
        if name not in counted:
            weight_bytes += sizes[name]
            counted.add(name)
    return {"weight_bytes": weight_bytes, "ops": ops, "embed": embed, "int8": int8}


def _executed_nodes(g, sizes: dict, shapes: dict) -> list:
    """The nodes a run of graph ``g`` executes: its own, and for each ``If`` the nodes of
    the branch that reads more weight bytes (a COUNTDOWN graph's dense MLP rather than its
    filtered decode branch: an upper bound; what the filter saves is
    ``runtime.countdown``'s to report); ``Loop`` / ``Scan`` bodies once."""
    nodes = []
    for node in g.node:
        nodes.append(node)
        walked = [_executed_nodes(a.g, sizes, shapes) for a in node.attribute if a.type == a.GRAPH]
        if node.op_type == "If" and walked:
            walked = [max(walked, key=lambda w: _tally(w, sizes, shapes)["weight_bytes"])]
        for sub in walked:
            nodes.extend(sub)
    return nodes


def gpu_availability() -> tuple[bool, str]:
    """Whether the CUDA execution provider can run here, and why not.

    Returns:
        ``(True, "CUDAExecutionProvider on <GPU>")`` or ``(False, reason)``; never raises.
    """
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover
        return False, f"onnxruntime is not importable: {e}"
    avail = ort.get_available_providers()
    if "CUDAExecutionProvider" not in avail:
        return False, (f"not available here: onnxruntime {ort.__version__} has no CUDAExecutionProvider "
                       f"(providers: {', '.join(avail)}); install onnxruntime-gpu on a machine with an NVIDIA GPU")
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode != 0 or not out.stdout.strip():
            return False, f"not available here: nvidia-smi found no GPU ({out.stderr.strip()[:200]})"
        return True, f"CUDAExecutionProvider on {out.stdout.strip().splitlines()[0]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"not available here: no NVIDIA driver (nvidia-smi: {e})"


# ------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------

def _fmt(v: Optional[float], decimals: int) -> str:
    """A table cell: ``decimals`` places (thousands separated) from 1 up, two significant
    digits below (a tiny model's 0.004 MiB KV cache is not "0.0"), "—" for ``None``."""
    if v is None:
        return "—"
    return f"{v:,.{decimals}f}" if v == 0 or abs(v) >= 1 else f"{v:.2g}"


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


@dataclasses.dataclass
class ProfileReport:
    """Everything :func:`profile` measured and projected.

    Attributes:
        folder: the export folder.
        profile: the target profile (``DeviceProfile.to_dict()``).
        ran_on: where the measured figures come from (``"cpu-host, 2 threads, CPUExecutionProvider"``).
        settings: ``prompt_len``, ``gen_len``, ``repeat``, ``threads``, ``device``.
        measured: ``ttft_ms`` / ``prefill_tok_s`` / ``decode_tok_s`` / ``decode_step_ms``
            (each ``{"median", "p90"}``; for rates, "p90" is the slow tail: decode tok/s
            at the p90 step latency, the 10th-percentile prefill rate; decode's ``median``
            is at the median step latency over all runs, its ``runs`` each run's mean rate,
            as its ``basis`` says), ``peak_rss_bytes``, ``weights_bytes``, ``kv_bytes`` (``{"k", "v"}``
            for the ``kv_tokens = final_length - 1`` tokens cached at the end: the last new
            token is sampled, never fed back), ``final_length`` (prompt + new tokens).
        projected: ``{target: {...}}`` roofline projections (never measurements).
        work: bytes / ops per token of the graph (:func:`model_work`).
        host: the host's measured bandwidth / compute used for the projection.
        sweep: ``[{"context", "decode_step_ms", "decode_tok_s", "rss_bytes", "kv_bytes"}]``.
        gpu: ``{"available": bool, "reason": str}`` for GPU profiles.
        notes: caveats (noise, thread caps, emulation...).
        plot_path: PNG of the sweep when drawn.
    """

    folder: str
    profile: dict
    ran_on: str
    settings: dict
    measured: dict
    projected: dict = dataclasses.field(default_factory=dict)
    work: dict = dataclasses.field(default_factory=dict)
    host: dict = dataclasses.field(default_factory=dict)
    sweep: list = dataclasses.field(default_factory=list)
    gpu: Optional[dict] = None
    notes: list = dataclasses.field(default_factory=list)
    plot_path: Optional[str] = None

    def to_dict(self) -> dict:
        """JSON-friendly dict."""
        return dataclasses.asdict(self)

    def to_json(self, path: Union[str, Path, None] = None) -> str:
        """The report as JSON; also written atomically to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, default=float)
        if path is not None:
            atomic_write(Path(path), text)
        return text

    def to_markdown(self) -> str:
        """A Markdown table: measured column, then one labelled "projected" column per target."""
        m = self.measured
        targets = list(self.projected)
        head = ["metric", f"measured ({self.ran_on})"] + [f"projected: {t}" for t in targets]
        rows = []

        def proj(key, fmt):
            return [fmt(self.projected[t].get(key)) for t in targets]

        f1 = lambda v: _fmt(v, 1)  # noqa: E731
        mib = lambda v: "—" if v is None else _fmt(v / MiB, 1)  # noqa: E731
        rows.append(["time to first token (ms)", f1(m["ttft_ms"]["median"])] + proj("ttft_ms", f1))
        rows.append(["prefill tokens/s (median)", f1(m["prefill_tok_s"]["median"])] + proj("prefill_tok_s", f1))
        rows.append(["decode tokens/s (median)", f1(m["decode_tok_s"]["median"])] + proj("decode_tok_s", f1))
        rows.append(["decode tokens/s (p90 latency)", f1(m["decode_tok_s"]["p90"])] + proj("decode_tok_s_p90", f1))
        rows.append(["decode step ms (median / p90)",
                     f"{_fmt(m['decode_step_ms']['median'], 2)} / {_fmt(m['decode_step_ms']['p90'], 2)}"]
                    + proj("decode_step_ms", lambda v: _fmt(v, 2)))
        rows.append(["peak RSS (MiB)", mib(m["peak_rss_bytes"])]
                    + [f"{mib(self.projected[t].get('peak_memory_bytes'))} "
                       f"({'fits' if self.projected[t].get('fits_budget') else 'OVER'} "
                       f"{mib(self.projected[t].get('memory_budget_bytes'))})" for t in targets])
        rows.append(["weights (MiB)", mib(m["weights_bytes"])] + [mib(m["weights_bytes"])] * len(targets))
        kv = m["kv_bytes"]
        kvs = f"{mib(kv['k'])} / {mib(kv['v'])}"
        rows.append([f"KV cache K / V, {m['kv_tokens']} cached tokens (MiB)", kvs] + [kvs] * len(targets))
        rows.append(["bound (roofline)", "—"] + proj("bound", lambda v: v or "—"))
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        out = [f"### Profile of `{self.folder}` on `{self.profile['name']}`", "",
               f"prompt {self.settings['prompt_len']} tokens, {self.settings['gen_len']} new tokens, "
               f"{self.settings['repeat']} run{'s' if self.settings['repeat'] != 1 else ''}, batch 1.", ""] + lines
        if self.gpu is not None:
            why = str(self.gpu["reason"])
            for lead in ("not available here", "not available"):
                if why.lower().startswith(lead):
                    why = why[len(lead):].lstrip(" :—-")
                    break
            out += ["", f"GPU: {'available' if self.gpu['available'] else 'NOT available'} — {why}"]
        if self.sweep:
            out += ["", "Context sweep (measured):", "",
                    "| context (tokens) | decode step ms (median) | decode tok/s | RSS after the run (MiB) | KV K+V (MiB) |",
                    "|---|---|---|---|---|"]
            out += [f"| {s['context']} | {_fmt(s['decode_step_ms'], 2)} | {_fmt(s['decode_tok_s'], 1)} | "
                    f"{_fmt(s['rss_bytes'] / MiB, 1)} | {_fmt(s['kv_bytes'] / MiB, 2)} |" for s in self.sweep]
            sp = self.measured.get("sweep_peak_rss_bytes")
            if sp:
                out += ["", f"Peak RSS over the sweep: {sp / MiB:.1f} MiB (the table's peak RSS "
                            f"is the {self.measured['final_length']}-token setting's own)."]
            if self.plot_path:
                out += ["", f"Plot: `{self.plot_path}`"]
        if self.projected:
            h = self.host
            out += ["", f"Projected columns are roofline estimates (not measurements): "
                        f"t = max(bytes/bandwidth, ops/peak) on the target x (host measured / host roofline); "
                        f"host {h.get('bandwidth_gbs', 0):.1f} GB/s, {h.get('peak_fp32_gflops', 0):.0f} GFLOP/s fp32, "
                        f"{h.get('peak_int8_gops', 0):.0f} GOP/s int8; {self.work.get('weight_bytes_per_token', 0) / MiB:.1f} MiB "
                        f"and {self.work.get('weight_ops_per_token', 0) / 1e9:.3f} GOP of weights per token ({self.work.get('compute')}). "
                        "The targets' spec-sheet peaks are first scaled to what a measurement would sustain "
                        "(profile fields bandwidth_efficiency / compute_efficiency, defaults 0.6 / 0.5), as the "
                        "host's figures are measured; GPU targets are floored at graph nodes x kernel_launch_us "
                        "per run (bound \"launch\"). Projected memory: CPU targets carry the host's measured "
                        "peak RSS; GPU targets count device memory as weights + KV cache."]
        for n in self.notes:
            out.append(f"- {n}")
        return "\n".join(out) + "\n"

    def plot(self, path: Union[str, Path]) -> Optional[str]:
        """Draw decode latency and memory vs context (PNG, matplotlib Agg); returns the path."""
        if not self.sweep:
            return None
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ctx = [s["context"] for s in self.sweep]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        a1.plot(ctx, [s["decode_step_ms"] for s in self.sweep], "o-", label="measured (host)")
        for t, p in self.projected.items():
            sc = p.get("sweep_step_ms")
            if sc:
                a1.plot(ctx, sc, "x--", label=f"projected: {t}")
        a1.set_xlabel("context length (tokens)")
        a1.set_ylabel("decode step latency (ms)")
        a1.set_title("decode latency vs context")
        a1.grid(alpha=0.3)
        a1.legend(fontsize=7)
        a2.plot(ctx, [s["rss_bytes"] / MiB for s in self.sweep], "o-", label="process RSS (measured)")
        a2.plot(ctx, [s["kv_bytes"] / MiB for s in self.sweep], "s-", label="KV cache K+V at context")
        a2.axhline(self.measured["weights_bytes"] / MiB, color="gray", ls=":", label="weights")
        a2.set_xlabel("context length (tokens)")
        a2.set_ylabel("MiB")
        a2.set_title("memory vs context")
        a2.grid(alpha=0.3)
        a2.legend(fontsize=7)
        fig.suptitle(f"{Path(self.folder).name} on {self.ran_on}", fontsize=9)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        os.replace(tmp, path)
        self.plot_path = str(path)
        return self.plot_path



# ------------------------------------------------------------------------------------------
# the measuring worker (runs in a fresh process that imports only the runtime)
# ------------------------------------------------------------------------------------------

class _RSSWatch:
    """Samples this process's RSS every ``interval`` s against ``budget`` (bytes).

    In the isolated worker (``status_path`` given) an RSS over the budget writes the
    status file and ends the process at once (exit code ``_BUDGET_EXIT``), before the
    machine runs out of memory. In the caller's own process (``isolate=False``) it only
    records the excess: :meth:`check`, called between runs, raises ``DeviceError``
    (a run in progress is not interrupted)."""

    def __init__(self, budget: Optional[int], status_path: Optional[str], profile_name: str = "",
                 interval: float = 0.002):
        import psutil
        self._proc = psutil.Process()
        self.budget = budget
        self.status_path = status_path
        self.profile_name = profile_name
        self.interval = interval
        self.peak = self.rss()
        self.exceeded: Optional[int] = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def _run(self):
        while not self._stop.is_set():
            r = self.rss()
            self.peak = max(self.peak, r)
            if self.budget and r > self.budget:
                if self.status_path is None:
                    self.exceeded = max(self.exceeded or 0, r)
                else:
                    Path(self.status_path).write_text(json.dumps({"error": "memory_budget", "rss_bytes": r,
                                                                  "budget_bytes": self.budget}))
                    os._exit(_BUDGET_EXIT)
            self._stop.wait(self.interval)

    def check(self) -> None:
        """Raise ``DeviceError`` if the RSS has gone over the budget (in-process mode)."""
        r = max(self.exceeded or 0, self.rss() if self.budget else 0)
        if self.budget and r > self.budget:
            raise _budget_error(r, self.budget, self.profile_name)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def _budget_error(rss: int, budget: int, name: str) -> DeviceError:
    return DeviceError(
        f"peak RSS {rss / MiB:.1f} MiB exceeded the memory budget of profile "
        f"{name!r} ({budget / MiB:.1f} MiB); the run was stopped",
        "use a smaller export (int4), shorter --prompt-len/--gen-len/--sweep, or a profile with a larger budget")


def _vm_hwm() -> int:
    """The kernel's RSS high-water mark of this process (``VmHWM``, Linux), 0 elsewhere.

    Not ``getrusage().ru_maxrss``: Linux carries that over ``exec`` from the parent, so a
    worker spawned by a large process would report the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _prompt_ids(tokenizer, n: int, vocab: int) -> list[int]:
    ids = tokenizer.encode(_PROMPT_TEXT) if tokenizer is not None else []
    ids = [i for i in ids if 0 <= i < vocab]
    if not ids:
        ids = list(range(3, min(vocab, 200)))
    reps = n // len(ids) + 1
    return (ids * reps)[:n]


def _measure(cfg: dict) -> dict:
    """Run the measurements of one profile (called in the worker process)."""
    import runtime

    with _RSSWatch(cfg.get("budget_bytes"), cfg.get("status_path"), cfg.get("profile_name", "")) as watch:
        rss_start = watch.rss()
        sess = runtime.load(cfg["folder"], device=cfg["device"], threads=cfg["threads"],
                            max_length=cfg.get("max_length"))
        rss_loaded = watch.rss()
        watch.check()
        # Every run must produce exactly gen_len tokens: disable the end-of-sequence stop.
        if hasattr(sess, "eos_token_ids"):
            sess.eos_token_ids = []
        P, G = int(cfg["prompt_len"]), int(cfg["gen_len"])
        ids = _prompt_ids(sess.tokenizer, P, int(sess.vocab_size))
        sess.generate(ids[: max(1, min(P, 16))], max_new_tokens=min(4, G))  # warm-up
        ttft, prefill, steps, decode_runs = [], [], [], []
        for _ in range(int(cfg["repeat"])):
            r = sess.generate(ids, max_new_tokens=G)
            watch.check()
            ttft.append(r.ttft_ms)
            prefill.append(r.prefill_tok_s)
            steps.extend(r.step_ms)
            decode_runs.append(r.decode_tok_s)
        # the headline peak is this setting's own (the sweep's longer contexts come after)
        peak = max(watch.peak, _vm_hwm())
        sweep = []
        for c in cfg.get("sweep") or []:
            r = sess.generate(_prompt_ids(sess.tokenizer, int(c), int(sess.vocab_size)), max_new_tokens=SWEEP_NEW_TOKENS)
            watch.check()
            st = float(np.median(r.step_ms)) if r.step_ms else float("nan")
            kv = sess.kv_cache_bytes(int(c) + SWEEP_NEW_TOKENS - 1)
            sweep.append({"context": int(c), "decode_step_ms": st, "decode_tok_s": 1000.0 / st if st > 0 else 0.0,
                          "rss_bytes": watch.rss(), "ttft_ms": r.ttft_ms, "kv_bytes": int(kv["k"] + kv["v"])})
        kv = sess.kv_cache_bytes(P + G - 1)      # the last new token is never fed back
        weights = int(sess.weights_bytes)
        sess.close()
    sweep_peak = max(watch.peak, _vm_hwm()) if sweep else None
    med, p90 = float(np.median(steps)) if steps else float("nan"), _pct(steps, 90)
    return {
        "ttft_ms": {"median": float(np.median(ttft)), "p90": _pct(ttft, 90), "runs": ttft},
        "prefill_tok_s": {"median": float(np.median(prefill)), "p90": _pct(prefill, 10), "runs": prefill},
        "decode_step_ms": {"median": med, "p90": p90},
        "decode_tok_s": {"median": 1000.0 / med, "p90": 1000.0 / p90, "runs": decode_runs,
                         "basis": "median / p90: at the median / p90 latency of all decode steps "
                                  "of all runs; runs: each run's mean rate (new tokens - 1 over "
                                  "its decode time)"},
        "peak_rss_bytes": peak, "rss_start_bytes": rss_start, "rss_loaded_bytes": rss_loaded,
        "weights_bytes": weights, "kv_bytes": {"k": int(kv["k"]), "v": int(kv["v"])},
        "final_length": P + G, "kv_tokens": P + G - 1, "sweep": sweep, "budget_bytes": cfg.get("budget_bytes"),
        "sweep_peak_rss_bytes": sweep_peak,
    }


def _run_worker(cfg: dict, isolate: bool, timeout: float) -> dict:
    if not isolate:
        return _measure(cfg)
    with tempfile.TemporaryDirectory(prefix="edgeprune-profile-") as td:
        cfg = dict(cfg, status_path=str(Path(td) / "status.json"))
        cfg_path, out_path = Path(td) / "cfg.json", Path(td) / "out.json"
        cfg_path.write_text(json.dumps(cfg))
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            proc = subprocess.run([sys.executable, "-m", "runtime.profiler", "--worker", str(cfg_path), str(out_path)],
                                  capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise DeviceError(f"the profiling run did not finish within {timeout:.0f} s",
                              "lower --repeat / --gen-len / the sweep, or raise the timeout") from e
        if proc.returncode == _BUDGET_EXIT and Path(cfg["status_path"]).exists():
            st = json.loads(Path(cfg["status_path"]).read_text())
            raise _budget_error(st["rss_bytes"], st["budget_bytes"], cfg["profile_name"])
        if proc.returncode != 0 or not out_path.exists():
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-12:]
            err = json.loads(out_path.read_text()) if out_path.exists() else {}
            if err.get("error_class") in ("GenerationError", "RuntimeLoadError", "DeviceError"):
                cls = {"GenerationError": GenerationError, "RuntimeLoadError": RuntimeLoadError,
                       "DeviceError": DeviceError}[err["error_class"]]
                raise cls(err["message"], err.get("hint"))
            raise DeviceError("the profiling worker failed: " + " | ".join(tail)[-800:],
                              "run `python -m runtime.profiler --worker` by hand to see the full error")
        return json.loads(out_path.read_text())


def _worker_main(argv: list[str]) -> int:
    cfg_path, out_path = argv
    cfg = json.loads(Path(cfg_path).read_text())
    try:
        res = _measure(cfg)
    except (GenerationError, RuntimeLoadError, DeviceError) as e:
        Path(out_path).write_text(json.dumps({"error_class": type(e).__name__, "message": e.message, "hint": e.hint}))
        return 1
    Path(out_path).write_text(json.dumps(res))
    return 0


# ------------------------------------------------------------------------------------------
# the public entry point
# ------------------------------------------------------------------------------------------

def check_profile_args(prompt_len, gen_len, repeat, threads=None) -> None:
    """The counts :func:`profile` takes: ``prompt_len >= 1``, ``gen_len >= 2`` (a decode
    speed needs two new tokens), ``repeat >= 1``, ``threads >= 1`` (or ``None``), all
    integers. Cheap: callers run it before minutes of other work.

    Raises:
        GenerationError: naming the count and a value to pass.
    """
    counts = [("prompt_len", prompt_len, 1), ("gen_len", gen_len, 2), ("repeat", repeat, 1)]
    for name, v, lo in counts + ([("threads", threads, 1)] if threads is not None else []):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise GenerationError(f"{name} must be an integer >= {lo}, got {v!r}"
                                  + (" (decode speed needs at least two new tokens)" if lo == 2 else ""),
                                  f"pass e.g. --{name.replace('_', '-')} {({'repeat': 5, 'threads': 2}).get(name, 128)}")


def profile(folder: Union[str, Path], profile_name_or_obj: Any = "cpu-host", prompt_len: int = 128,
            gen_len: int = 128, repeat: int = 5, sweep: Union[None, bool, Sequence[int]] = None,
            targets: Optional[Sequence[str]] = None, out_dir: Union[str, Path, None] = None,
            isolate: bool = True, timeout: float = 1800.0, threads: Optional[int] = None) -> ProfileReport:
    """Measure ``folder`` on this host under a device profile and project to targets.

    Args:
        folder: an export folder (``model.onnx``, ``edgeprune.json``, tokenizer files).
        profile_name_or_obj: a profile name (``"raspberry-pi-5"``), a ``.toml`` path or a
            ``devices.DeviceProfile``. Its thread count (capped at this machine's cores)
            and memory budget apply to the measured run; GPU profiles run on
            ``CUDAExecutionProvider`` when available, else on the host CPU with
            ``report.gpu["reason"]`` saying why.
        prompt_len: prompt tokens (batch 1).
        gen_len: new tokens per run (end-of-sequence is ignored so every run makes ``gen_len``).
        repeat: timed runs (after one warm-up).
        sweep: context lengths for the latency/memory sweep (``True``: 128..2048 capped
            by the export's max length); ``None``/``False``: no sweep.
        targets: profile names to project to (default: the chosen profile when it is not
            the host, else every non-host profile).
        out_dir: where the sweep PNG goes (default ``runs/profile-<name>`` in the cwd).
        isolate: measure in a fresh subprocess importing only the runtime (True; False
            runs in this process: RSS then includes the caller's memory, and the memory
            budget is checked between runs, raising ``DeviceError``, where the isolated
            worker is stopped the moment it goes over).
        timeout: seconds before the worker is abandoned.
        threads: run with this many threads instead of the profile's (noted in the report).

    Returns:
        :class:`ProfileReport`.

    Raises:
        DeviceError: unknown profile, the run exceeding the profile's memory budget,
            a failed/timed-out worker.
        RuntimeLoadError: the folder is missing or incomplete.
        GenerationError: ``prompt_len + gen_len`` does not fit the export's context.
    """
    import devices

    t0 = time.perf_counter()
    folder = Path(folder)
    if not (folder / "model.onnx").is_file():
        raise RuntimeLoadError(f"{folder} has no model.onnx", "pass the folder written by `edgeprune export`")
    check_profile_args(prompt_len, gen_len, repeat, threads)
    if sweep not in (None, True, False) and (
            not isinstance(sweep, (list, tuple)) or not all(
                isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in sweep)):
        raise GenerationError(f"sweep must be True or a list of context lengths, got {sweep!r}",
                              "pass e.g. sweep=[128, 512, 1024] (CLI: --sweep for the default list)")
    prof = devices.load_profile(profile_name_or_obj, measure=False)
    # target profiles loaded now: a typo fails before the measurement, not after it
    if targets is None:     # the default targets too: a broken profile file fails now
        tgts = [prof] if not prof.is_host else [p for p in devices.list_profiles() if not p.is_host]
    else:
        tgts = [devices.load_profile(n, measure=False) for n in targets]
    try:
        meta = json.loads((folder / "edgeprune.json").read_text())
    except (OSError, ValueError):
        meta = {}
    export_max = int(meta.get("max_length") or 2048)
    notes: list[str] = ["Timings measured on a shared machine are noisy; compare runs made side by side."]
    cores = os.cpu_count() or 1
    gpu = None
    device = "cpu"
    asked = None if threads is None else int(threads)
    threads = int(prof.threads if asked is None else asked)
    if prof.execution_provider == "CUDAExecutionProvider":
        ok, reason = gpu_availability()
        gpu = {"available": ok, "reason": reason}
        if ok:
            device = "cuda"
        else:
            threads = cores if asked is None else asked   # the host CPU stands in for the GPU
            notes.append(f"{prof.name}: {reason}. Measured figures are from the host CPU; the GPU column is projected only.")
    if device == "cpu" and threads > cores:
        who = f"--threads {asked} asks for" if asked is not None else f"{prof.name} runs"
        notes.append(f"{who} {threads} threads; this host has {cores} cores, so {cores} were used.")
        threads = cores
    elif asked is not None and asked != int(prof.threads) and \
            prof.execution_provider != "CUDAExecutionProvider":      # (GPU profiles: no CPU threads)
        notes.append(f"threads set to {asked} (the profile {prof.name} says {prof.threads}).")
    if sweep is True:
        sweep_list = [c for c in DEFAULT_SWEEP if c + SWEEP_NEW_TOKENS <= export_max]
        if export_max - SWEEP_NEW_TOKENS > (sweep_list or [0])[-1]:
            sweep_list.append(export_max - SWEEP_NEW_TOKENS)      # up to the export's context
    elif sweep:
        sweep_list = sorted({int(c) for c in sweep})
        bad = [c for c in sweep_list if c < 1 or c + SWEEP_NEW_TOKENS > export_max]
        if bad:
            raise GenerationError(f"sweep contexts {bad} do not fit the export's max_length={export_max} "
                                  f"(+{SWEEP_NEW_TOKENS} decode tokens)", f"use contexts <= {export_max - SWEEP_NEW_TOKENS}")
    else:
        sweep_list = []
    # the last new token is sampled, never fed back: prompt + new - 1 tokens are cached
    need = max([prompt_len + gen_len - 1] + [c + SWEEP_NEW_TOKENS - 1 for c in sweep_list])
    if need > export_max:
        raise GenerationError(f"prompt_len + gen_len - 1 = {prompt_len + gen_len - 1} cached tokens exceed the "
                              f"export's max_length={export_max}",
                              f"lower --prompt-len/--gen-len to fit {export_max} tokens, or re-export with "
                              "`edgeprune export --max-length`")
    cfg = {"folder": str(folder), "device": device, "threads": threads, "prompt_len": int(prompt_len),
           "gen_len": int(gen_len), "repeat": int(repeat), "sweep": sweep_list, "max_length": need,
           "budget_bytes": int(prof.memory_budget_bytes), "profile_name": prof.name}
    measured = _run_worker(cfg, isolate, timeout)
    if measured["peak_rss_bytes"] > prof.memory_budget_bytes:
        raise DeviceError(f"peak RSS {measured['peak_rss_bytes'] / MiB:.1f} MiB exceeded the memory budget of profile "
                          f"{prof.name!r} ({prof.memory_budget_bytes / MiB:.1f} MiB)",
                          "use a smaller export (int4), shorter --prompt-len/--gen-len, or a profile with a larger budget")
    sweep_rows = measured.pop("sweep")
    ran_on = (f"{prof.name} GPU, CUDAExecutionProvider" if device == "cuda"
              else f"this host, {threads} thread{'s' if threads > 1 else ''}, CPUExecutionProvider")
    # ---- projection (roofline), labelled as such
    work = model_work(folder)
    host_fig = devices.measure_host(threads)
    host = dataclasses.replace(devices.load_profile("cpu-host", measure=False), threads=threads,
                               bandwidth_gbs=host_fig["bandwidth_gbs"], peak_fp32_gflops=host_fig["peak_fp32_gflops"],
                               peak_int8_gops=host_fig["peak_int8_gops"], measured=True)
    projected = {}
    if device == "cpu":
        for tgt in tgts:
            if tgt.is_host:
                if targets is not None:
                    notes.append(f"{tgt.name} is this machine: its figures are the measured column, not a projection.")
                continue
            projected[tgt.name] = _project_one(measured, sweep_rows, work, host, tgt, prompt_len, gen_len)
    elif targets is not None:
        notes.append("Ran on the GPU: no projected columns (the roofline scaling is calibrated on the host CPU); "
                     "profile on cpu-host to project to " + ", ".join(t.name for t in tgts) + ".")
    report = ProfileReport(folder=str(folder), profile=prof.to_dict(), ran_on=ran_on,
                           settings={"prompt_len": int(prompt_len), "gen_len": int(gen_len), "repeat": int(repeat),
                                     "threads": threads, "device": device, "isolated": bool(isolate),
                                     "seconds": round(time.perf_counter() - t0, 2)},
                           measured=measured, projected=projected, work=work,
                           host={k: host_fig[k] for k in ("bandwidth_gbs", "peak_fp32_gflops", "peak_int8_gops")},
                           sweep=sweep_rows, gpu=gpu, notes=notes)
    if sweep_rows:
        out = Path(out_dir) if out_dir is not None else Path.cwd() / "runs" / f"profile-{prof.name}"
        report.plot(out / f"sweep-{folder.name}-{prof.name}.png")
    return report


def _project_one(measured: dict, sweep_rows: list, work: dict, host, tgt, prompt_len: int, gen_len: int) -> dict:
    """One target's projected column. Decode and prefill times are the roofline scaling of
    :func:`devices.project`, floored on GPU targets at ``graph_nodes x kernel_launch_us``
    per run (a small model's decode is launch-bound there, far from the roofline). TTFT
    is the projected prefill of the prompt (as measured: the first token comes from the
    prefill's logits). Memory: CPU targets carry the host's measured peak RSS (same
    runtime, same files); GPU targets count device memory as weights + KV cache."""
    import devices

    comp = work["compute"]
    wb, wo, attn = work["weight_bytes_per_token"], work["weight_ops_per_token"], work["attn_ops_per_position"]
    kv = measured["kv_bytes"]
    kv_per_pos = (kv["k"] + kv["v"]) / max(1, measured["kv_tokens"])
    mean_ctx = prompt_len + gen_len / 2
    launch_s = tgt.kernel_launch_us * 1e-6 * int(work.get("graph_nodes") or 0)

    def step(measured_s, bytes_, ops, per_run=1):
        p = devices.project(measured_s, host, tgt, bytes_, ops, comp)
        t = max(p.seconds_per_token, launch_s / per_run)
        return t, ("launch" if t > p.seconds_per_token else p.bound), p.host_efficiency

    dec_t, dec_bound, dec_eff = step(measured["decode_step_ms"]["median"] / 1000.0, wb + kv_per_pos * mean_ctx,
                                     wo + attn * mean_ctx)
    dec90_t, _, _ = step(measured["decode_step_ms"]["p90"] / 1000.0, wb + kv_per_pos * mean_ctx, wo + attn * mean_ctx)
    pre_t, pre_bound, pre_eff = step(1.0 / measured["prefill_tok_s"]["median"], wb / prompt_len + kv_per_pos,
                                     wo + attn * prompt_len / 2, per_run=prompt_len)
    gpu = tgt.device_class == "gpu"
    peak = int(measured["weights_bytes"] + kv["k"] + kv["v"]) if gpu else measured["peak_rss_bytes"]
    out = {"decode_tok_s": 1.0 / dec_t, "decode_tok_s_p90": 1.0 / dec90_t,
           "decode_step_ms": dec_t * 1000.0, "prefill_tok_s": 1.0 / pre_t,
           "ttft_ms": prompt_len * pre_t * 1000.0,
           "bound": dec_bound, "prefill_bound": pre_bound, "host_efficiency_decode": dec_eff,
           "host_efficiency_prefill": pre_eff, "peak_memory_bytes": peak,
           "peak_memory_kind": "device memory: weights + KV cache" if gpu else "peak RSS as measured on the host",
           "memory_budget_bytes": tgt.memory_budget_bytes, "fits_budget": bool(peak <= tgt.memory_budget_bytes),
           "kind": "projected (roofline)"}
    if sweep_rows:
        out["sweep_step_ms"] = [step(s["decode_step_ms"] / 1000.0, wb + kv_per_pos * s["context"],
                                     wo + attn * s["context"])[0] * 1000.0 for s in sweep_rows]
    return out


if __name__ == "__main__":  # python -m runtime.profiler --worker CFG OUT
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2:]))
    print("usage: python -m runtime.profiler --worker CFG.json OUT.json  (use `edgeprune profile` instead)")
    sys.exit(2)
