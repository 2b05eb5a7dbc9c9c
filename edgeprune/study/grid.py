"""The study's grid: which compressed models (cells) to build and what to measure on each.

A cell is one model under one compression setting (:class:`CellSpec`): ``dense``, a
quantizer at ``bits``, or a pruner at an unstructured ``sparsity`` or an N:M pattern.
:func:`expand_grid` builds the cells from the command line's cross product
(``--methods gptq,wanda --bits 4,8 --sparsity 0.5 --pattern 2:4``: each quantizer at each
bit width, each pruner at each sparsity and pattern), or :func:`parse_cells` from an
explicit list (``gptq:4,awq:4,sparsegpt:0.5,sparsegpt:2:4``). The dense model is always
the first cell: every other cell is measured against it.

``group_size="auto"`` is the study's rule (the paper's 128 where the layer widths allow,
64 otherwise): :func:`auto_group_size` picks the largest of (128, 64, 32) dividing the
input size of every linear layer of the decoder blocks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

from ..errors import ConfigError

#: Preferred group sizes of ``group_size="auto"``, largest first.
AUTO_GROUP_SIZES = (128, 64, 32)
#: Display names of the registered methods.
METHOD_NAMES = {"gptq": "GPTQ", "awq": "AWQ", "rtn": "RTN", "sparsegpt": "SparseGPT", "wanda": "Wanda",
                "magnitude": "Magnitude", "dense": "dense"}


@dataclass(frozen=True)
class CellSpec:
    """One compression setting of the grid.

    Attributes:
        method: registered method name, or ``"dense"``.
        bits: quantizers' bit width.
        group_size: quantizers' group size (``None`` with ``"auto"``: resolved per model).
        sparsity: pruners' unstructured sparsity in (0, 1).
        prune_n, prune_m: pruners' N:M pattern (``prune_n`` kept of every ``prune_m``).
    """

    method: str
    bits: Optional[int] = None
    group_size: Optional[int] = None
    sparsity: Optional[float] = None
    prune_n: Optional[int] = None
    prune_m: Optional[int] = None

    @property
    def is_dense(self) -> bool:
        return self.method == "dense"

    @property
    def label(self) -> str:
        """``GPTQ-4``, ``SparseGPT-50%``, ``SparseGPT-2:4``, ``dense`` (group size shown when set)."""
        name = METHOD_NAMES.get(self.method, self.method)
        if self.is_dense:
            return name
        if self.bits is not None:
            return f"{name}-{self.bits}" + (f" g{self.group_size}" if self.group_size else "")
        if self.prune_n:
            return f"{name}-{self.prune_n}:{self.prune_m}"
        return f"{name}-{round(100 * (self.sparsity or 0), 2):g}%"

    @property
    def family(self) -> str:
        """``"dense"``, ``"quant"`` or ``"prune"``."""
        return "dense" if self.is_dense else "quant" if self.bits is not None else "prune"

    def settings(self) -> dict[str, Any]:
        """The method's settings for :func:`edgeprune.recipe.method_config_from_name`."""
        return {k: v for k, v in asdict(self).items() if k != "method" and v is not None}

    def with_group_size(self, group_size: Optional[int]) -> "CellSpec":
        """This spec with ``group_size`` filled in (quantizers without one only)."""
        if self.bits is None or self.group_size is not None or group_size is None:
            return self
        return CellSpec(self.method, self.bits, group_size, self.sparsity, self.prune_n, self.prune_m)

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), label=self.label, family=self.family)


DENSE = CellSpec("dense")


def _method_kind(name: str) -> str:
    """``"quant"`` or ``"prune"`` from the method registry.

    Raises:
        ConfigError: an unknown method (listing the registered ones).
    """
    from ..methods import config_class

    cls = config_class(name)
    return "prune" if cls.is_pruner else "quant"


def parse_pattern(text: str) -> tuple[int, int]:
    """``"2:4"`` -> ``(2, 4)``.

    Raises:
        ConfigError: not N:M with 0 < N < M.
    """
    try:
        n, m = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise ConfigError(f"pattern {text!r} is not N:M", "use e.g. 2:4") from None
    if not 0 < n < m:
        raise ConfigError(f"pattern {text!r} needs 0 < N < M", "use e.g. 2:4")
    return n, m


def _sparsity(text: str) -> float:
    t = str(text).strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ConfigError(f"sparsity {text!r} is not a number", "use e.g. 0.5 or 50%") from None
    if not 0.0 < v < 1.0:
        raise ConfigError(f"sparsity {text!r} must lie in (0, 1)", "use e.g. 0.5 or 50%")
    return v


def _cell(method: str, value: str, group_size: Optional[int]) -> CellSpec:
    kind = _method_kind(method)
    if kind == "quant":
        try:
            bits = int(value)
        except ValueError:
            raise ConfigError(f"cell {method}:{value}: a quantizer takes a bit width", f"use e.g. {method}:4") from None
        return CellSpec(method, bits=bits, group_size=group_size)
    if ":" in value:
        n, m = parse_pattern(value)
        return CellSpec(method, prune_n=n, prune_m=m)
    return CellSpec(method, sparsity=_sparsity(value))


def _group_size(group_size: Union[str, int, None]) -> Optional[int]:
    if group_size in (None, "auto"):
        return None
    try:
        return int(group_size)
    except (TypeError, ValueError):
        raise ConfigError(f"group size {group_size!r} is neither 'auto' nor an integer",
                          "use --group-size auto, 128, 64 or -1 (per row)") from None


def parse_cells(text, group_size: Union[str, int, None] = "auto") -> list[CellSpec]:
    """Cells from ``"gptq:4,awq:4,sparsegpt:0.5,wanda:50%,sparsegpt:2:4,dense"``, dense first.

    Raises:
        ConfigError: an unknown method, a malformed item, a setting the method does not take.
    """
    gs = _group_size(group_size)
    cells = [DENSE]
    for item in (s.strip() for s in (text.split(",") if isinstance(text, str) else text)):
        if not item or item == "dense":
            continue
        method, sep, value = item.partition(":")
        if not sep or not value:
            raise ConfigError(f"cell {item!r} is not METHOD:SETTING",
                              "use e.g. gptq:4 (bits), wanda:0.5 (sparsity) or sparsegpt:2:4 (pattern)")
        c = _cell(method.strip().lower(), value.strip(), gs)
        if c not in cells:
            cells.append(c)
    return cells


def expand_grid(methods, bits=(), sparsity=(), patterns=(), group_size: Union[str, int, None] = "auto"
                ) -> list[CellSpec]:
    """The cross product of the command line: each quantizer at each of ``bits``, each
    pruner at each of ``sparsity`` and each of ``patterns``; dense first.

    Raises:
        ConfigError: an unknown method; a quantizer without ``bits`` or a pruner without a
            sparsity or pattern.
    """
    gs = _group_size(group_size)
    cells = [DENSE]
    for method in methods:
        kind = _method_kind(method)
        values = [str(b) for b in bits] if kind == "quant" else [str(s) for s in sparsity] + list(patterns)
        if not values:
            raise ConfigError(f"method {method} needs " + ("--bits" if kind == "quant" else "--sparsity or --pattern"),
                              "add e.g. --bits 4,8" if kind == "quant" else "add e.g. --sparsity 0.5 or --pattern 2:4")
        for v in values:
            c = _cell(method, v, gs)
            if c not in cells:
                cells.append(c)
    return cells


def linear_in_features(model) -> list[int]:
    """Input sizes of the linear layers of the decoder blocks (what a group must divide)."""
    import torch

    from ..models import decoder_layers

    return sorted({m.in_features for m in decoder_layers(model).modules() if isinstance(m, torch.nn.Linear)})


def auto_group_size(in_features: list[int]) -> int:
    """The largest of :data:`AUTO_GROUP_SIZES` dividing every input size; -1 (one group per
    row) when none does."""
    for g in AUTO_GROUP_SIZES:
        if all(f % g == 0 for f in in_features):
            return g
    return -1


@dataclass
class StudyConfig:
    """Everything that defines a study run (JSON-able; the cache keys are built from it).

    Models and cells; calibration (``calib`` source, ``nsamples`` x ``seqlen``, ``seed``);
    the fidelity text (``text``, ``eval_seqlen``, ``nwindows``; ``continuations`` prompts of
    ``prompt_len`` tokens, ``new_tokens`` compared); tasks (``tasks``, ``limit``,
    ``task_data``, ``num_fewshot``); languages (``langs``, ``lang_lines``); ``dtype`` of
    task and language scoring (``"float32"`` or ``"bfloat16"``; the fidelity text is always
    scored in float32); ``calib_dtype`` of the compressions' calibration forward passes
    (``"bfloat16"``: see :func:`edgeprune.engine.compress`'s ``forward_dtype``; weights and
    Hessians stay float32); ``device``, ``threads``; ``cache`` folder.
    """

    models: list = field(default_factory=lambda: ["smollm2-135m"])
    cells: list = field(default_factory=lambda: [DENSE])
    group_size: Union[str, int] = "auto"
    calib: Optional[str] = None
    nsamples: int = 128
    seqlen: int = 512
    text: Optional[str] = None
    eval_seqlen: int = 512
    nwindows: Optional[int] = 40
    seed: int = 0
    continuations: int = 32
    prompt_len: int = 32
    new_tokens: int = 32
    tasks: list = field(default_factory=list)
    limit: Optional[int] = None
    task_data: Optional[str] = None
    num_fewshot: Optional[int] = None
    langs: Optional[str] = None
    lang_lines: Optional[int] = 200
    dtype: str = "float32"
    calib_dtype: str = "float32"
    device: str = "cpu"
    threads: Optional[int] = None
    cache: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cells"] = [c.to_dict() for c in self.cells]
        return d


__all__ = ["CellSpec", "DENSE", "StudyConfig", "config_from_dict", "parse_cells", "expand_grid", "parse_pattern",
           "auto_group_size", "linear_in_features", "AUTO_GROUP_SIZES", "METHOD_NAMES"]


def config_from_dict(d: dict) -> StudyConfig:
    """A :class:`StudyConfig` back from :meth:`StudyConfig.to_dict` (Ray workers get it so)."""
    d = dict(d)
    d["cells"] = [CellSpec(**{k: c.get(k) for k in ("method", "bits", "group_size", "sparsity",
                                                   "prune_n", "prune_m")}) for c in d.get("cells", [])]
    return StudyConfig(**d)
