"""The profiler's report: :class:`ProfileReport` as JSON, a Markdown table and a sweep plot.

The plot is drawn with ``matplotlib`` (Agg), imported only when :meth:`ProfileReport.plot`
runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional, Union

from edgeprune_runtime.files import atomic_write

MiB = 1024 * 1024


def _table(head: list, rows: list) -> list[str]:
    """Markdown table lines."""
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def format_ops(breakdown: dict, top: int = 12) -> list[str]:
    """Markdown table lines of :func:`~devices.profiler.ops.op_breakdown`'s decode steps: the ``top`` operator
    types by time, then the rest and the time outside any node, per step."""
    d = breakdown["decode"]
    rows = [["op type", "µs per step", "share", "nodes per step"]]
    for o in d["ops"][:top]:
        rows.append([o["op"], f"{o['us_per_run']:,.0f}", f"{o['share']:.1%}", f"{o['nodes_per_run']:.0f}"])
    rest = d["ops"][top:]
    if rest:
        us = sum(o["us_per_run"] for o in rest)
        rows.append([f"{len(rest)} other types", f"{us:,.0f}", f"{us / d['run_us_mean']:.1%}" if d["run_us_mean"] else "—",
                     f"{sum(o['nodes_per_run'] for o in rest):.0f}"])
    out = d["outside_nodes_us_per_run"]
    rows.append(["(outside nodes: session)", f"{out:,.0f}", f"{out / d['run_us_mean']:.1%}" if d["run_us_mean"] else "—", ""])
    return _table(rows[0], rows[1:])


def model_name(meta: dict, folder: Union[str, Path]) -> str:
    """The model an export was made from, for titles: the source the user named (an
    alias such as ``smollm2-135m``, a file or folder name) from ``edgeprune.json``'s
    provenance, with the export's precision; the folder's name when none is recorded."""
    prov = meta.get("provenance") or {}
    comp = prov.get("compression") if isinstance(prov.get("compression"), dict) else {}
    name = None
    for src in ((comp.get("provenance") or {}).get("source"), comp.get("source"), prov.get("source")):
        if isinstance(src, dict):
            src = src.get("spec") or src.get("path")
        if isinstance(src, str) and src.strip():
            name = Path(src.rstrip("/")).name or src
            break
    name = name or Path(folder).name
    precision = meta.get("precision")
    return f"{name} ({precision})" if precision else name


def _fmt(v: Optional[float], decimals: int) -> str:
    """A table cell: ``decimals`` places (thousands separated) from 1 up, two significant
    digits below (a tiny model's 0.004 MiB KV cache is not "0.0"), "—" for ``None``."""
    if v is None:
        return "—"
    return f"{v:,.{decimals}f}" if v == 0 or abs(v) >= 1 else f"{v:.2g}"


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
            token is sampled, never fed back), ``final_length`` (prompt + new tokens);
            ``ops`` when asked for (:func:`devices.profiler.ops.op_breakdown`: a decode
            step and the prefill by operator type, from a separate traced generation);
            for an IG-Pruning export ``route`` and ``masks`` (per-mask decode rate, time to
            first token and KV bytes: :func:`devices.profiler.measure._per_mask`).
        projected: ``{target: {...}}`` roofline projections (never measurements).
        work: bytes / ops per token of the graph (:func:`model_work`).
        host: the host's measured bandwidth / compute used for the projection.
        sweep: ``[{"context", "decode_step_ms", "decode_tok_s", "rss_bytes", "kv_bytes"}]``.
        gpu: ``{"available": bool, "reason": str}`` for GPU profiles.
        notes: caveats (noise, thread caps, emulation...).
        plot_path: PNG of the sweep when drawn.
        model: the model's name and precision (:func:`model_name`), for titles.
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
    model: str = ""

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
        """Markdown: the measured table, then (only with projections) a separate table
        headed "Projected, not measured", one column per target, then the sweep."""
        m = self.measured
        targets = list(self.projected)
        rows = []          # [metric, measured cell, [projected cells]]

        def proj(key, fmt):
            return [fmt(self.projected[t].get(key)) for t in targets]

        f1 = lambda v: _fmt(v, 1)  # noqa: E731
        mib = lambda v: "—" if v is None else _fmt(v / MiB, 1)  # noqa: E731
        rows.append(["time to first token (ms)", f1(m["ttft_ms"]["median"]), proj("ttft_ms", f1)])
        rows.append(["prefill tokens/s (median)", f1(m["prefill_tok_s"]["median"]), proj("prefill_tok_s", f1)])
        rows.append(["decode tokens/s (median)", f1(m["decode_tok_s"]["median"]), proj("decode_tok_s", f1)])
        rows.append(["decode tokens/s (p90 latency)", f1(m["decode_tok_s"]["p90"]), proj("decode_tok_s_p90", f1)])
        rows.append(["decode step ms (median / p90)",
                     f"{_fmt(m['decode_step_ms']['median'], 2)} / {_fmt(m['decode_step_ms']['p90'], 2)}",
                     proj("decode_step_ms", lambda v: _fmt(v, 2))])
        rows.append(["peak RSS (MiB)", mib(m["peak_rss_bytes"]),
                     [f"{mib(self.projected[t].get('peak_memory_bytes'))} "
                      f"({'fits' if self.projected[t].get('fits_budget') else 'OVER'} "
                      f"{mib(self.projected[t].get('memory_budget_bytes'))})" for t in targets]])
        rows.append(["weights (MiB)", mib(m["weights_bytes"]), [mib(m["weights_bytes"])] * len(targets)])
        kv = m["kv_bytes"]
        kvs = f"{mib(kv['k'])} / {mib(kv['v'])}"
        rows.append([f"KV cache K / V, {m['kv_tokens']} cached tokens (MiB)", kvs, [kvs] * len(targets)])
        title = f"`{self.folder}`" + (f" ({self.model})" if self.model else "")
        out = [f"### Profile of {title} on `{self.profile['name']}`", "",
               f"prompt {self.settings['prompt_len']} tokens, {self.settings['gen_len']} new tokens, "
               f"{self.settings['repeat']} run{'s' if self.settings['repeat'] != 1 else ''}, batch 1.", ""]
        out += _table(["metric", f"measured ({self.ran_on})"], [r[:2] for r in rows])
        if targets:
            rows.append(["bound (roofline)", "—", proj("bound", lambda v: v or "—")])
            out += ["", "#### Projected, not measured (roofline estimates for profiles not at hand)", ""]
            out += _table(["metric"] + [f"projected: {t}" for t in targets], [[r[0]] + r[2] for r in rows])
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
        if m.get("masks"):
            r = m.get("route") or {}
            routed = (f"the profile's prompt routed to mask {r['cluster']} (router pass "
                      f"{_fmt(r.get('router_ms'), 1)} ms, inside the time to first token above)"
                      if r.get("cluster") is not None else "the export has one mask: no router pass")
            out += ["", f"Per mask (IG-Pruning export; each mask forced, no routing, {self.settings['repeat']} "
                        f"run{'s' if self.settings['repeat'] != 1 else ''} each; {routed}):", "",
                    "| mask | attention / MLP sub-blocks kept | decode tok/s (median) | decode step ms | "
                    "time to first token (ms) | KV K+V, " f"{m['kv_tokens']} tokens (MiB) |",
                    "|---|---|---|---|---|---|"]
            out += [f"| {x['mask']} | {x['kept_attention']} / {x['kept_mlp']} of {x['sub_blocks'] // 2} | "
                    f"{_fmt(x['decode_tok_s'], 1)} | {_fmt(x['decode_step_ms'], 2)} | {_fmt(x['ttft_ms'], 1)} | "
                    f"{_fmt(x['kv_bytes'] / MiB, 2)} |" for x in m["masks"]]
        if m.get("ops"):
            d = m["ops"]["decode"]
            out += ["", f"Decode step by operator type (onnxruntime's profiler, {d['runs']} steps of one "
                        f"more generation; traced steps take {d['run_us_median'] / 1000:.2f} ms, slower than "
                        "the timed ones: read the shares):", ""]
            out += format_ops(m["ops"])
        for n in self.notes:
            out.append(f"- {n}")
        return "\n".join(out) + "\n"

    def plot(self, path: Union[str, Path]) -> Optional[str]:
        """Draw decode latency and memory vs context (PNG, matplotlib Agg; :meth:`figure`)
        to ``path`` atomically; returns the path (``None`` without a sweep)."""
        if not self.sweep:
            return None
        import matplotlib.pyplot as plt

        fig = self.figure()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        os.replace(tmp, path)
        self.plot_path = str(path)
        return self.plot_path

    def figure(self):
        """The sweep's matplotlib figure: decode step latency (measured, and projected
        targets dashed) and memory (RSS, KV cache, weights) against the context length on
        a log2 axis, titled with the model's name and where it was measured."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ctx = [s["context"] for s in self.sweep]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for ax in (a1, a2):       # contexts double: a log axis spaces them evenly
            ax.set_xscale("log", base=2)
            ax.set_xticks(ctx, [str(c) for c in ctx])
            ax.minorticks_off()
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
        fig.suptitle(f"{self.model or Path(self.folder).name}: measured on {self.ran_on}", fontsize=9)
        fig.tight_layout()
        return fig


__all__ = ["ProfileReport", "model_name"]
