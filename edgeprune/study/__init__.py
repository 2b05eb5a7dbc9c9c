"""The pruning-vs-quantization study as one call: a grid of models x compression settings,
each measured on fidelity (perplexity, KL, top-1, activation SNR, greedy continuations),
zero-shot tasks (lm-eval) and per-language perplexity, with a content-hash cache
(a re-run computes only what changed), locally or on Ray, written as CSV / Markdown /
JSON tables and PNG plots. See ``docs/study.md``.

* :mod:`.grid`: cells and the study's settings;
* :mod:`.cache`: content-hash keys and the cache folder;
* :mod:`.cell`: planning keys and computing one cell;
* :mod:`.run`: the local loop, Ray tasks, :func:`run_study`;
* :mod:`.tables`, :mod:`.plots`: outputs.
"""

from __future__ import annotations

from .cache import Cache
from .grid import CellSpec, StudyConfig, expand_grid, parse_cells
from .run import run_local, run_ray, run_study
from .tables import StudyTable

__all__ = ["Cache", "CellSpec", "StudyConfig", "StudyTable", "expand_grid", "parse_cells", "run_study",
           "run_local", "run_ray"]
