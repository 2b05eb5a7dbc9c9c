"""The study's plots (matplotlib, Agg backend, PNG), one set per model:

* ``<model>-perplexity.png``: fidelity-text perplexity against bits (quantizers) and
  against sparsity (pruners; N:M patterns marked apart), one line per method, the dense
  model as a dashed line;
* ``<model>-languages.png``: heatmap of the relative perplexity change (%) per language
  and cell (coloured by ``log10(ppl / dense ppl)``);
* ``<model>-tasks.png``: task accuracy bars, one group per task, one bar per cell;
* ``<model>-disagreement.png``: perplexity (x, log) against mean task accuracy (y) per
  cell, with the rank correlation (Kendall's tau) of the orders the two metrics give:
  where the points do not fall monotonically, perplexity and accuracy rank methods
  differently.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from edgeprune_runtime.files import atomic_write


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(text)).name or str(text)).strip("-") or "model"


def kendall_tau(a: list[float], b: list[float]) -> float | None:
    """Kendall's tau-a of two score lists (None for fewer than two pairs)."""
    n = len(a)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    if not pairs:
        return None
    s = 0
    for i, j in pairs:
        d = (a[i] - a[j]) * (b[i] - b[j])
        s += (d > 0) - (d < 0)
    return s / len(pairs)


def _save(fig, path: Path) -> Path:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    atomic_write(path, buf.getvalue())
    return path


def _perplexity(rows, dense, path: Path, model: str):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, fam, xlabel in ((axes[0], "quant", "bits"), (axes[1], "prune", "sparsity")):
        methods = dict.fromkeys(r["method"] for r in rows if _family(r) == fam)
        for m in methods:
            pts = sorted((r["bits"] if fam == "quant" else r["sparsity"], r["ppl"]) for r in rows
                         if r["method"] == m and _family(r) == fam and not r["pattern"] and r["ppl"] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
            for r in rows:
                if r["method"] == m and r["pattern"] and r["ppl"] is not None:
                    ax.scatter([r["sparsity"]], [r["ppl"]], marker="x", s=60, label=f"{m} {r['pattern']}")
        if dense is not None:
            ax.axhline(dense, ls="--", c="gray", label="dense")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("perplexity")
        ax.set_yscale("log")
        ax.set_title(("quantization" if fam == "quant" else "pruning") + f": {model}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return _save(fig, path)


def _family(r) -> str:
    return "dense" if r["method"] == "dense" else "quant" if r["bits"] is not None else "prune"


def _languages(rows, codes, path: Path, model: str):
    import matplotlib.pyplot as plt

    cells = [r for r in rows if r["method"] != "dense"]
    data = [[(100 * r[f"change:{c}"]) if r[f"change:{c}"] is not None else float("nan") for c in codes]
            for r in cells]
    fig, ax = plt.subplots(figsize=(1.2 * len(codes) + 3, 0.5 * len(cells) + 1.5))
    # colour by log10(ppl / dense ppl): one collapsed cell does not wash the others out
    shade = [[math.log10(1 + v / 100) if not math.isnan(v) and v > -100 else float("nan") for v in row]
             for row in data]
    im = ax.imshow(shade, cmap="Reds", aspect="auto", vmin=0)
    ax.set_xticks(range(len(codes)), codes)
    ax.set_yticks(range(len(cells)), [r["cell"] for r in cells])
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            if not math.isnan(v):
                ax.text(j, i, f"{v:+.0f}%", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="log10(perplexity / dense perplexity)")
    ax.set_title(f"per-language degradation: {model}")
    return _save(fig, path)


def _tasks(rows, tasks, path: Path, model: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.4 * len(tasks) + 3, 4))
    width = 0.8 / max(len(rows), 1)
    for k, r in enumerate(rows):
        vals = [100 * (r[f"acc:{t}"] or 0.0) for t in tasks]
        ax.bar([i + k * width for i in range(len(tasks))], vals, width, label=r["cell"])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks, rotation=20)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"task accuracy: {model}")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def _disagreement(rows, path: Path, model: str):
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r["ppl"] is not None and r["acc_mean"] is not None and math.isfinite(r["ppl"])]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for r in pts:
        ax.scatter(r["ppl"], 100 * r["acc_mean"])
        ax.annotate(r["cell"], (r["ppl"], 100 * r["acc_mean"]), fontsize=8, xytext=(4, 2), textcoords="offset points")
    tau = kendall_tau([-r["ppl"] for r in pts], [r["acc_mean"] for r in pts])
    ax.set_xscale("log")
    ax.set_xlabel("perplexity (lower is better)")
    ax.set_ylabel("mean task accuracy (%)")
    ax.set_title(f"perplexity vs accuracy: {model}" + (f" (Kendall tau of the rankings {tau:+.2f})"
                                                         if tau is not None else ""), fontsize=10)
    return _save(fig, path)


def write_plots(table, folder) -> list[Path]:
    """Write every plot of every model of ``table`` into ``folder``; returns the paths.
    A plot whose data is missing (no tasks, no languages) is not written."""
    import matplotlib

    matplotlib.use("Agg")
    folder = Path(folder)
    rows = [r for r in table.rows() if not r["status"].startswith("failed")]
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mr = [r for r in rows if r["model"] == model]
        slug = _slug(model)
        dense = next((r["ppl"] for r in mr if r["method"] == "dense"), None)
        if any(r["ppl"] is not None for r in mr):
            out.append(_perplexity(mr, dense, folder / f"{slug}-perplexity.png", model))
        if table.languages and any(r["method"] != "dense" for r in mr):
            out.append(_languages(mr, table.languages, folder / f"{slug}-languages.png", model))
        if table.tasks:
            out.append(_tasks(mr, table.tasks, folder / f"{slug}-tasks.png", model))
            out.append(_disagreement(mr, folder / f"{slug}-disagreement.png", model))
    return out


__all__ = ["write_plots", "kendall_tau"]
