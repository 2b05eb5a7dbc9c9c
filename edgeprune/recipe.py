"""Compression configs (one dataclass per method) and :class:`Recipe`, which chains them.

Style follows torchao's ``quantize_(model, Int4WeightOnlyConfig(group_size=128))``: a
config object names a method and its settings; :func:`edgeprune.engine.compress` is the
one verb. A :class:`Recipe` is an ordered list of stages, e.g. SparseGPT 2:4 then GPTQ
int4 ("2:4 + int4"), or AWQ then GPTQ. Recipes read from TOML or YAML::

    # recipe.toml
    [[stages]]
    method = "sparsegpt"
    prune_n = 2
    prune_m = 4

    [[stages]]
    method = "gptq"
    bits = 4
    group_size = 64

Every config has ``targets`` (``None``: every ``nn.Linear`` inside the decoder blocks)
and ``ignore`` (default ``["lm_head"]``). A pattern matches a module name when it is
equal to it, is a dotted suffix of it (``"q_proj"``, ``"mlp.down_proj"``), matches it
as a shell glob (``"model.layers.1*.mlp.*"``), or, with the prefix ``"re:"``, as a
regular expression searched in the name (llm-compressor's convention).

N:M convention: ``prune_n:prune_m`` keeps at most ``prune_n`` nonzero weights in every
``prune_m`` consecutive input weights of a row (NVIDIA's 2:4 keeps 2 of 4). For 2:4
and 4:8 this is also the Wanda/SparseGPT reference code's "prune n of m".
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .errors import ConfigError
from .quantize import SUPPORTED_BITS


def _default_ignore() -> list[str]:
    return ["lm_head"]


def pattern_matches(pattern: str, name: str) -> bool:
    """True when ``pattern`` selects module ``name`` (exact, dotted suffix, glob, or ``re:``)."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    if name == pattern or name.endswith("." + pattern):
        return True
    return fnmatch.fnmatchcase(name, pattern)


def _check_sparsity(cfg) -> None:
    if cfg.prune_n or cfg.prune_m:
        if cfg.prune_n <= 0 or cfg.prune_m <= 0 or cfg.prune_n >= cfg.prune_m:
            raise ConfigError(
                f"N:M sparsity {cfg.prune_n}:{cfg.prune_m} is invalid",
                "use 0 < prune_n < prune_m, e.g. prune_n=2 prune_m=4 (2:4) or 4:8")
        return
    if not isinstance(cfg.sparsity, (int, float)) or not 0.0 <= float(cfg.sparsity) < 1.0:
        raise ConfigError(f"sparsity={cfg.sparsity} is outside [0, 1)",
                          "use a fraction of weights to remove, e.g. 0.5")


def _check_bits(bits, group_size, sym) -> None:
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"bits={bits} is not supported",
                          f"use one of {', '.join(map(str, SUPPORTED_BITS))}")
    if not isinstance(group_size, int) or (group_size != -1 and group_size <= 0):
        raise ConfigError(f"group_size={group_size} must be -1 (per row) or a positive integer",
                          "use e.g. group_size=64 (or -1 for one group per row)")
    if not isinstance(sym, bool):
        raise ConfigError(f"sym={sym!r} must be true or false", "use sym=true or sym=false")


def _check_targets(cfg) -> None:
    for attr in ("targets", "ignore"):
        v = getattr(cfg, attr)
        if v is None and attr == "targets":
            continue
        if isinstance(v, str) or not all(isinstance(p, str) for p in (v or [])):
            raise ConfigError(f"{attr}={v!r} must be a list of module-name patterns",
                              f'write e.g. {attr} = ["q_proj", "re:.*mlp.*"]')
        for p in v or []:
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as e:
                    raise ConfigError(f"{cfg.method} stage: {attr} pattern {p!r} is not a valid "
                                      f"regular expression ({e})",
                                      "fix the expression after 're:' (Python re syntax), "
                                      'e.g. "re:self_attn\\.(q|k)_proj$"') from None


@dataclass(kw_only=True)
class _Base:
    targets: Optional[list[str]] = None
    ignore: list[str] = field(default_factory=_default_ignore)

    method = ""  # overridden per class
    kind = ""    # "prune" | "quant"

    def selects(self, name: str) -> bool:
        """True when the module ``name`` is a target of this stage (and not ignored)."""
        if any(pattern_matches(p, name) for p in self.ignore or []):
            return False
        if self.targets is None:
            return True
        return any(pattern_matches(p, name) for p in self.targets)

    def to_dict(self) -> dict:
        d = {"method": self.method}
        d.update(dataclasses.asdict(self))
        return d

    def validate(self) -> None:  # pragma: no cover - overridden
        _check_targets(self)


@dataclass
class MagnitudeConfig(_Base):
    """Magnitude pruning (baseline): remove the smallest ``|W|`` in each layer (or N:M)."""

    sparsity: float = 0.5
    prune_n: int = 0
    prune_m: int = 0
    method = "magnitude"
    kind = "prune"

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a bad sparsity / N:M / target list."""
        _check_targets(self)
        _check_sparsity(self)


@dataclass
class WandaConfig(_Base):
    """Wanda (Sun et al. 2024): prune by ``|W_ij| * ||X_j||_2`` within each output row."""

    sparsity: float = 0.5
    prune_n: int = 0
    prune_m: int = 0
    method = "wanda"
    kind = "prune"

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a bad sparsity / N:M / target list."""
        _check_targets(self)
        _check_sparsity(self)


@dataclass
class SparseGPTConfig(_Base):
    """SparseGPT (Frantar & Alistarh 2023): OBS pruning with optional joint quantization.

    ``true_sequential`` (default on): within a block the linears are pruned in forward
    order, group by group (``[q,k,v]``, ``[o]``, ``[gate,up]``, ``[down]``), each group's
    Hessian gathered from the outputs of the already-pruned groups before it (as GPTQ's
    reference code does); off: every linear of the block from one pass of dense inputs
    (the SparseGPT reference code and llm-compressor).
    """

    sparsity: float = 0.5
    prune_n: int = 0
    prune_m: int = 0
    blocksize: int = 128
    percdamp: float = 0.01
    bits: Optional[int] = None
    group_size: int = 64
    sym: bool = False
    true_sequential: bool = True
    method = "sparsegpt"
    kind = "prune"

    def validate(self) -> None:
        """Raises :class:`ConfigError` on bad sparsity, damping, block size or grid."""
        _check_targets(self)
        _check_sparsity(self)
        if not 0 <= self.percdamp:
            raise ConfigError(f"percdamp={self.percdamp} must be >= 0", "use e.g. 0.01")
        if self.blocksize <= 0:
            raise ConfigError(f"blocksize={self.blocksize} must be positive", "use 128")
        if self.bits is not None:
            _check_bits(self.bits, self.group_size, self.sym)

    @property
    def quantizes(self) -> bool:
        return self.bits is not None


@dataclass
class RTNConfig(_Base):
    """Round-to-nearest group-wise quantization (baseline)."""

    bits: int = 4
    group_size: int = 64
    sym: bool = False
    method = "rtn"
    kind = "quant"

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a bad grid."""
        _check_targets(self)
        _check_bits(self.bits, self.group_size, self.sym)


@dataclass
class GPTQConfig(_Base):
    """GPTQ (Frantar et al. 2023): second-order weight quantization with error feedback.

    ``true_sequential`` (default on, the reference code's ``--true-sequential``): within a
    block the linears are quantized in forward order, group by group (``[q,k,v]``, ``[o]``,
    ``[gate,up]``, ``[down]``), each group's Hessian gathered from the outputs of the
    already-quantized groups before it; off: every linear of the block from one pass over
    the block's inputs (llm-compressor's behaviour).
    """

    bits: int = 4
    group_size: int = 64
    sym: bool = False
    act_order: bool = False
    static_groups: bool = False
    damp_percent: float = 0.01
    blocksize: int = 128
    true_sequential: bool = True
    method = "gptq"
    kind = "quant"

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a bad grid, damping or block size."""
        _check_targets(self)
        _check_bits(self.bits, self.group_size, self.sym)
        if not 0 <= self.damp_percent:
            raise ConfigError(f"damp_percent={self.damp_percent} must be >= 0", "use e.g. 0.01")
        if self.blocksize <= 0:
            raise ConfigError(f"blocksize={self.blocksize} must be positive", "use 128")


@dataclass
class AWQConfig(_Base):
    """AWQ (Lin et al. 2024): activation-aware per-channel scaling, clipping, then quantization.

    ``duo_scaling`` (AutoAWQ / llm-compressor default) uses ``s = mean|x|^a / mean|w|^(1-a)``;
    set it to ``False`` for the paper's ``s = mean|x|^a``. ``max_shrink`` bounds the clipping
    search (clip ratios ``1, 1-1/n_grid, ..., 1-max_shrink``).
    """

    bits: int = 4
    group_size: int = 64
    sym: bool = False
    n_grid: int = 20
    clip_search: bool = True
    duo_scaling: bool = True
    max_shrink: float = 0.5
    method = "awq"
    kind = "quant"

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a bad grid or search setting."""
        _check_targets(self)
        _check_bits(self.bits, self.group_size, self.sym)
        if self.n_grid < 1:
            raise ConfigError(f"n_grid={self.n_grid} must be >= 1", "use 20")
        if not 0 <= self.max_shrink < 1:
            raise ConfigError(f"max_shrink={self.max_shrink} must be in [0, 1)", "use 0.5")


MethodConfig = Union[MagnitudeConfig, WandaConfig, SparseGPTConfig, RTNConfig, GPTQConfig, AWQConfig]

CONFIGS: dict[str, type] = {c.method: c for c in
                            (MagnitudeConfig, WandaConfig, SparseGPTConfig, RTNConfig, GPTQConfig, AWQConfig)}


_SCALAR_TYPES = {"int": ((numbers.Integral,), "an integer"), "float": ((numbers.Real,), "a number"),
                 "bool": ((bool,), "true or false")}


def _check_setting_types(cfg) -> None:
    """A recipe file's ``blocksize: "128"`` is a one-line error, not a TypeError deep in
    a method."""
    for f in dataclasses.fields(cfg):
        t = str(f.type)
        optional = t.startswith("Optional[")
        base = t[len("Optional["):-1] if optional else t
        if base not in _SCALAR_TYPES:
            continue
        v = getattr(cfg, f.name)
        if v is None and optional:
            continue
        types, what = _SCALAR_TYPES[base]
        if not isinstance(v, types) or (base != "bool" and isinstance(v, bool)):
            example = f.default if f.default is not dataclasses.MISSING and f.default is not None \
                else {"int": 128, "float": 0.5, "bool": True}[base]
            shown = str(example).lower() if base == "bool" else example
            hint = f"write it unquoted, e.g. {f.name}: {shown} (YAML) or {f.name} = {shown} (TOML)"
            if isinstance(v, str) and base == "float":
                try:
                    float(v)
                    hint += "; YAML reads exponents like 1e-2 as text, write 0.01"
                except ValueError:
                    pass
            raise ConfigError(f"{cfg.method} setting {f.name}={v!r} must be {what}", hint)


def method_config_from_name(name: str, **kwargs: Any) -> MethodConfig:
    """Build a method config from its name and settings, e.g. ``("gptq", bits=4)``.

    Settings that are ``None`` are dropped (so a CLI can pass every option); settings the
    method does not have raise.

    Raises:
        ConfigError: unknown method name or unknown setting for that method.
    """
    key = (name or "").strip().lower().replace("-", "").replace("_", "")
    if key not in CONFIGS:
        raise ConfigError(f"unknown compression method {name!r}",
                          f"use one of {', '.join(sorted(CONFIGS))}")
    cls = CONFIGS[key]
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in kwargs.items() if v is not None}
    if key == "sparsegpt" and "bits" in kwargs and kwargs["bits"] is None:
        kw.pop("bits", None)
    bad = sorted(set(kw) - fields)
    if bad:
        raise ConfigError(f"method {key!r} has no setting {', '.join(bad)}",
                          f"its settings are {', '.join(sorted(fields))}")
    cfg = cls(**kw)
    _check_setting_types(cfg)
    cfg.validate()
    return cfg


@dataclass
class Recipe:
    """An ordered chain of method configs applied block by block by :func:`compress`.

    Within each decoder block the stages run in order, each on the outputs of the
    previous one (statistics are re-captured per stage). Rules (checked per layer by the
    engine, and here where the recipe alone decides): pruning comes before quantization;
    a layer is quantized by at most one stage, except that an ``awq`` stage may be
    followed by another quantization stage (AWQ then only folds its scales and clips,
    and the later stage produces the integer codes).
    """

    stages: list = field(default_factory=list)
    name: str = ""

    def __post_init__(self) -> None:
        self.stages = [s if not isinstance(s, dict) else _config_from_dict(s) for s in self.stages]

    def validate(self) -> None:
        """Validate every stage and their order.

        Raises:
            ConfigError: empty recipe, a bad stage, or pruning after a quantization stage
                that covers every layer.
        """
        if not self.stages:
            raise ConfigError("the recipe has no stages", "add at least one method, e.g. gptq")
        for s in self.stages:
            if not hasattr(s, "validate") or getattr(s, "method", "") not in CONFIGS:
                raise ConfigError(f"recipe stage {s!r} is not a method config",
                                  f"use one of {', '.join(sorted(CONFIGS))}")
            s.validate()

    def to_dict(self) -> dict:
        """JSON/TOML-able ``{"name": ..., "stages": [{"method": ..., ...}, ...]}``."""
        return {"name": self.name, "stages": [s.to_dict() for s in self.stages]}

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        """Inverse of :meth:`to_dict`; also accepts ``{"method": ...}`` for one stage.

        Raises:
            ConfigError: malformed structure, unknown method or setting.
        """
        if not isinstance(d, dict):
            raise ConfigError("a recipe must be a mapping with a 'stages' list",
                              "write [[stages]] tables (TOML) or a 'stages:' list (YAML)")
        if "stages" not in d and "method" in d:
            d = {"stages": [d]}
        stages = d.get("stages")
        extra = sorted(set(d) - {"stages", "name"}) if "stages" in d else []
        if extra:
            raise ConfigError(f"unknown recipe key(s) {', '.join(map(repr, extra))} (a recipe holds "
                              "'name' and 'stages')",
                              "move settings such as targets/ignore into each stage, or remove them")
        if not isinstance(stages, list):
            raise ConfigError("the recipe has no 'stages' list",
                              "write [[stages]] tables (TOML) or a 'stages:' list (YAML)")
        r = cls(stages=[_config_from_dict(s) for s in stages], name=str(d.get("name", "")))
        r.validate()
        return r

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "Recipe":
        """Read a recipe from ``.toml``, ``.yaml``/``.yml`` or ``.json``.

        Raises:
            ConfigError: missing file, parse error, or invalid content.
        """
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe file {p} does not exist", "pass the path of a .toml or .yaml recipe")
        text = p.read_text(encoding="utf-8")
        try:
            if p.suffix.lower() == ".toml":
                import tomllib
                data = tomllib.loads(text)
            elif p.suffix.lower() in (".yaml", ".yml"):
                import yaml
                data = yaml.safe_load(text)
            elif p.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                raise ConfigError(f"recipe {p} has an unknown extension {p.suffix!r}",
                                  "name it .toml, .yaml or .json")
        except ConfigError:
            raise
        except Exception as e:  # parse errors of any of the three formats
            mark = getattr(e, "problem_mark", None)           # YAML: line/column of the problem
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            msg = " ".join(str(getattr(e, "problem", None) or e).split())   # one line
            raise ConfigError(f"cannot parse recipe {p}{where}: {msg}",
                              "fix the syntax error there")
        r = cls.from_dict(data)
        if not r.name:
            r.name = p.stem
        return r


def _config_from_dict(s: Any) -> MethodConfig:
    if isinstance(s, _Base):
        return s
    if not isinstance(s, dict) or "method" not in s:
        raise ConfigError(f"recipe stage {s!r} has no 'method'",
                          f"add method = one of {', '.join(sorted(CONFIGS))}")
    s = dict(s)
    return method_config_from_name(s.pop("method"), **s)


def as_recipe(obj: Any) -> Recipe:
    """Coerce a config, a list of configs, a dict, a path or a :class:`Recipe` to a Recipe."""
    if isinstance(obj, Recipe):
        return obj
    if isinstance(obj, _Base):
        return Recipe(stages=[obj])
    if isinstance(obj, (list, tuple)):
        return Recipe(stages=list(obj))
    if isinstance(obj, dict):
        return Recipe.from_dict(obj)
    if isinstance(obj, (str, Path)):
        return Recipe.from_file(obj)
    raise ConfigError(f"cannot use {type(obj).__name__} as a recipe",
                      "pass a method config (e.g. GPTQConfig(bits=4)), a list of them, or a recipe file")


__all__ = ["MagnitudeConfig", "WandaConfig", "SparseGPTConfig", "RTNConfig", "GPTQConfig",
           "AWQConfig", "Recipe", "MethodConfig", "method_config_from_name", "as_recipe",
           "pattern_matches", "CONFIGS"]
