"""The study's results as one row per cell (model x compression setting), written as CSV,
Markdown and JSON.

Columns (:meth:`StudyTable.rows`): the cell (``model``, ``cell``, ``method``, ``bits``,
``group_size``, ``sparsity``, ``pattern``), ``status`` (``ok`` or ``failed: <message>``),
the fidelity text's ``ppl``, ``kl`` (nats/token), ``top1`` (agreement), ``snr_db`` (mean
layer activation SNR), ``cont_change`` (share of changed greedy continuations), per task
``acc:<task>`` and their mean ``acc_mean``, per language ``ppl:<code>`` and
``change:<code>`` (relative perplexity change vs the same model's dense cell) and their
geometric mean ``lang_change_mean`` (``exp(mean(log(ppl / dense ppl))) - 1``), ``avg_bits`` and ``compress_s``.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, Optional

from edgeprune_runtime.files import atomic_write, write_json

from .cell import CellOutcome
from .grid import StudyConfig


def _num(v) -> Optional[float]:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, str):
        try:
            return float(v)     # "inf" / "nan" as JSON wrote them
        except ValueError:
            return None
    return float(v) if isinstance(v, (int, float)) else None


def _mean(values) -> Optional[float]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


class StudyTable:
    """The outcomes of a study run and their tables.

    Args:
        config: the study.
        outcomes: one :class:`~edgeprune.study.cell.CellOutcome` per cell, in grid order.
        seconds: the run's wall time.
    """

    def __init__(self, config: StudyConfig, outcomes: list[CellOutcome], seconds: float = 0.0):
        self.config = config
        self.outcomes = outcomes
        self.seconds = seconds
        self.plots: list = []

    @property
    def tasks(self) -> list[str]:
        return list(self.config.tasks or [])

    @property
    def languages(self) -> list[str]:
        seen: list[str] = []
        for o in self.outcomes:
            for u in o.units:
                if u.startswith("lang:") and u[5:] not in seen:
                    seen.append(u[5:])
        return seen

    def computed(self) -> list[tuple[str, str, list]]:
        """``[(model, cell label, units computed by this run)]`` for cells this run touched."""
        return [(o.model, o.spec.label, list(o.computed)) for o in self.outcomes if o.computed]

    def rows(self) -> list[dict[str, Any]]:
        """One flat row per cell (see the module docstring)."""
        dense_lang = {}
        for o in self.outcomes:
            if o.spec.is_dense:
                dense_lang[o.model] = {u[5:]: _num((v or {}).get("ppl")) for u, v in o.units.items()
                                       if u.startswith("lang:")}
        rows = []
        for o in self.outcomes:
            s = o.spec
            text = o.units.get("text") or {}
            r: dict[str, Any] = dict(
                model=o.model, cell=s.label, method=s.method, bits=s.bits, group_size=s.group_size,
                sparsity=s.sparsity if s.sparsity is not None else (1 - s.prune_n / s.prune_m if s.prune_n else None),
                pattern=f"{s.prune_n}:{s.prune_m}" if s.prune_n else None,
                status="ok" if o.status != "failed" else f"failed: {o.error}",
                ppl=_num(text.get("ppl")), kl=_num(text.get("kl", 0.0 if s.is_dense and text else None)),
                top1=_num(text.get("top1_agree", 1.0 if s.is_dense and text else None)),
                snr_db=_num(text.get("snr_db")), cont_change=_num(text.get("continuation_change",
                                                                             0.0 if s.is_dense and text else None)))
            accs = []
            for t in self.tasks:
                a = _num((o.units.get(f"task:{t}") or {}).get("acc"))
                r[f"acc:{t}"] = a
                accs.append(a)
            r["acc_mean"] = _mean(accs) if accs and all(a is not None for a in accs) else None
            changes = []
            for code in self.languages:
                p = _num((o.units.get(f"lang:{code}") or {}).get("ppl"))
                base = dense_lang.get(o.model, {}).get(code)
                ch = (p - base) / base if p is not None and base else None
                r[f"ppl:{code}"], r[f"change:{code}"] = p, ch
                changes.append(ch)
            ok = changes and all(c is not None and c > -1 for c in changes)
            # geometric mean of the ppl ratios: one collapsed language does not swamp the others
            r["lang_change_mean"] = math.exp(_mean([math.log1p(c) for c in changes])) - 1 if ok else None
            r["avg_bits"] = _num(o.record.get("avg_bits_per_weight"))
            r["compress_s"] = _num(o.record.get("seconds"))
            rows.append(r)
        return rows

    # ------------------------------------------------------------------ writers
    def to_csv(self) -> str:
        rows = self.rows()
        buf = io.StringIO()
        if rows:
            w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
            w.writeheader()
            for r in rows:
                w.writerow({k: ("" if v is None else v) for k, v in r.items()})
        return buf.getvalue()

    def to_markdown(self) -> str:
        """Per model: the summary table, task accuracy (%), language perplexity (change vs dense)."""
        rows = self.rows()
        c = self.config
        lines = [f"# edgeprune study ({len(rows)} cells, {self.seconds / 60:.1f} min)", "",
                 f"Calibration: {c.calib or 'embedded default text'}, {c.nsamples} x {c.seqlen} tokens, seed {c.seed}. "
                 f"Fidelity text: {c.text or 'embedded held-out text'}, {c.nwindows or 'all'} windows x {c.eval_seqlen} "
                 f"tokens; {c.continuations} greedy continuations of {c.new_tokens} tokens after {c.prompt_len}-token "
                 f"prompts. Tasks: {', '.join(self.tasks) or 'none'} (lm-eval, zero-shot, "
                 f"{'first ' + str(c.limit) if c.limit else 'all'} documents, accuracy %). Languages: "
                 f"{c.langs or 'none'} (first {c.lang_lines} lines).", ""]
        for model in dict.fromkeys(r["model"] for r in rows):
            mr = [r for r in rows if r["model"] == model]
            lines += [f"## {model}", ""]
            lines += _md(["cell", "ppl", "KL", "top-1", "SNR dB", "cont. changed", "mean acc %",
                          "mean lang change", "bits/w", "status"],
                         [[r["cell"], _f(r["ppl"], 2), _f(r["kl"], 4), _pct(r["top1"]), _f(r["snr_db"], 2),
                           _pct(r["cont_change"]), _pct(r["acc_mean"], sign=False), _pct(r["lang_change_mean"], True),
                           _f(r["avg_bits"], 2), r["status"]] for r in mr])
            if self.tasks:
                lines += ["", "Task accuracy (%):", ""]
                lines += _md(["cell"] + self.tasks + ["mean"],
                             [[r["cell"]] + [_pct(r[f"acc:{t}"], sign=False) for t in self.tasks]
                              + [_pct(r["acc_mean"], sign=False)] for r in mr])
            if self.languages:
                lines += ["", "Perplexity per language (change vs dense):", ""]
                lines += _md(["cell"] + self.languages,
                             [[r["cell"]] + [_lang(r[f"ppl:{c_}"], r[f"change:{c_}"]) for c_ in self.languages]
                              for r in mr])
            lines.append("")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return dict(config=self.config.to_dict(), seconds=self.seconds, rows=self.rows(),
                    cells=[o.to_dict() for o in self.outcomes])

    def write(self, out: Path) -> None:
        """``results.csv``, ``results.md``, ``results.json`` into ``out`` (atomically each)."""
        out = Path(out)
        atomic_write(out / "results.csv", self.to_csv())
        atomic_write(out / "results.md", self.to_markdown())
        write_json(out / "results.json", self.to_dict())


def _f(v, digits: int) -> str:
    if v is None:
        return "—"
    if math.isinf(v):
        return "∞" if v > 0 else "-∞"
    return f"{v:.{digits}f}"


def _pct(v, sign: bool = False) -> str:
    if v is None:
        return "—"
    return f"{100 * v:+.1f}" if sign else f"{100 * v:.1f}"


def _lang(ppl, change) -> str:
    if ppl is None:
        return "—"
    return f"{ppl:.2f}" + (f" ({100 * change:+.0f} %)" if change is not None and change != 0 else "")


def _md(cols: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(x).replace("|", "\\|") for x in r) + " |" for r in rows]
    return out


__all__ = ["StudyTable"]
