"""Recipes: an ordered chain of method configs (:class:`Recipe`), read from a file or a dict.

Style follows torchao's ``quantize_(model, Int4WeightOnlyConfig(group_size=128))``: a
config object names a method and its settings; :func:`edgeprune.engine.compress` is the
one verb. Each method's config class lives in the method's own file
(``edgeprune/methods/gptq.py`` holds ``GPTQConfig``) and is found through the method
registry (:mod:`edgeprune.methods.registry`); this module re-exports them
(``edgeprune.recipe.GPTQConfig``). A :class:`Recipe` is an ordered list of stages, e.g.
SparseGPT 2:4 then GPTQ int4 ("2:4 + int4"), or AWQ then GPTQ. Recipes read from TOML or
YAML::

    # recipe.toml
    [[stages]]
    method = "sparsegpt"
    prune_n = 2
    prune_m = 4

    [[stages]]
    method = "gptq"
    bits = 4
    group_size = 64

Every config has ``targets`` and ``ignore`` patterns (see
:mod:`edgeprune.methods.config`: exact name, dotted suffix, glob, or ``re:`` regex).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from .errors import ConfigError
from .methods import CONFIGS, MethodConfig, config_class, config_classes, is_registered
from .methods.config import pattern_matches  # noqa: F401  (re-exported)


def method_config_from_name(name: str, **kwargs: Any) -> MethodConfig:
    """Build a method config from its registered name and settings, e.g. ``("gptq", bits=4)``.

    The name is matched without case, ``-`` or ``_``. Settings that are ``None`` are
    dropped (so a CLI can pass every option); settings the method does not have raise
    (:meth:`~edgeprune.methods.config.MethodConfig.from_options`).

    Raises:
        ConfigError: unknown method name (listing the registered ones), unknown setting
            for that method, or a bad value.
    """
    return config_class(name).from_options(**kwargs)


@dataclass
class Recipe:
    """An ordered chain of method configs applied block by block by :func:`compress`.

    Within each decoder block the stages run in order, each on the outputs of the
    previous one (statistics are re-captured per stage). Rules (checked per layer by the
    engine): pruning comes before quantization; a layer is quantized by at most one
    stage, except that a stage whose method ``may_precede_quantizer`` (``awq``) may be
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
            if not is_registered(s):
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
    if isinstance(s, MethodConfig):
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
    if isinstance(obj, MethodConfig):
        return Recipe(stages=[obj])
    if isinstance(obj, (list, tuple)):
        return Recipe(stages=list(obj))
    if isinstance(obj, dict):
        return Recipe.from_dict(obj)
    if isinstance(obj, (str, Path)):
        return Recipe.from_file(obj)
    raise ConfigError(f"cannot use {type(obj).__name__} as a recipe",
                      "pass a method config (e.g. GPTQConfig(bits=4)), a list of them, or a recipe file")


def __getattr__(name: str):
    """``edgeprune.recipe.GPTQConfig`` and every other registered config class by its name."""
    for cls in config_classes().values():
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Recipe", "MethodConfig", "method_config_from_name", "as_recipe", "pattern_matches",
           "CONFIGS"] + [c.__name__ for c in CONFIGS.values()]
