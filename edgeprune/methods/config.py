"""The base of every method's config (:class:`MethodConfig`) and the option groups and
checks the methods share.

A method's config is a dataclass deriving :class:`MethodConfig` that lives in the method's
own file beside its :class:`~edgeprune.methods.base.Method` (``methods/gptq.py`` holds
``GPTQConfig`` and ``GPTQ``), joined to it by
:func:`~edgeprune.methods.registry.register_method`. It holds the method's options under
the field's names and checks them (:meth:`MethodConfig.validate`); its class attributes
tell the engine what the method does to a layer (:attr:`~MethodConfig.is_pruner`,
:attr:`~MethodConfig.is_quantizer`, :attr:`~MethodConfig.may_precede_quantizer`), so that
the engine never asks for a method's name.

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
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from ..errors import ConfigError
from ..quantize import SUPPORTED_BITS


def _default_ignore() -> list[str]:
    return ["lm_head"]


def pattern_matches(pattern: str, name: str) -> bool:
    """True when ``pattern`` selects module ``name`` (exact, dotted suffix, glob, or ``re:``)."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    if name == pattern or name.endswith("." + pattern):
        return True
    return fnmatch.fnmatchcase(name, pattern)


def check_sparsity(cfg) -> None:
    """``sparsity`` in ``[0, 1)``, or a valid N:M pattern ``0 < prune_n < prune_m``.

    Raises:
        ConfigError: naming the bad value and a valid example.
    """
    if cfg.prune_n or cfg.prune_m:
        if cfg.prune_n <= 0 or cfg.prune_m <= 0 or cfg.prune_n >= cfg.prune_m:
            raise ConfigError(
                f"N:M sparsity {cfg.prune_n}:{cfg.prune_m} is invalid",
                "use 0 < prune_n < prune_m, e.g. prune_n=2 prune_m=4 (2:4) or 4:8")
        return
    if not isinstance(cfg.sparsity, (int, float)) or not 0.0 <= float(cfg.sparsity) < 1.0:
        raise ConfigError(f"sparsity={cfg.sparsity} is outside [0, 1)",
                          "use a fraction of weights to remove, e.g. 0.5")


def check_bits(bits, group_size, sym) -> None:
    """A quantization grid: ``bits`` in :data:`~edgeprune.quantize.SUPPORTED_BITS`,
    ``group_size`` -1 or positive, ``sym`` a bool (layer shapes are checked per layer by
    :meth:`~edgeprune.methods.base.Method.check_layer`).

    Raises:
        ConfigError: naming the bad value and a valid one.
    """
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"bits={bits} is not supported",
                          f"use one of {', '.join(map(str, SUPPORTED_BITS))}")
    if not isinstance(group_size, int) or (group_size != -1 and group_size <= 0):
        raise ConfigError(f"group_size={group_size} must be -1 (per row) or a positive integer",
                          "use e.g. group_size=64 (or -1 for one group per row)")
    if not isinstance(sym, bool):
        raise ConfigError(f"sym={sym!r} must be true or false", "use sym=true or sym=false")


#: The group sizes a hint may name: the ones the ONNX export stores as ``MatMulNBits``
#: blocks (a multiple of 16; ``exporters.int4.MATMULNBITS_BLOCKS``).
GROUP_SIZES = (16, 32, 64, 128, 256)


def _fitting(sizes: list[int]) -> list[str]:
    """The :data:`GROUP_SIZES` dividing every one of ``sizes``; 16 (twice the scale bytes
    of 32) only when no larger one does."""
    fit = [g for g in GROUP_SIZES if all(k % g == 0 for k in sizes)]
    return [str(g) for g in (fit[1:] or fit)]


def check_group_size(cfg, layers: list[tuple[str, int]]) -> None:
    """A quantizing stage's ``group_size`` divides the input size of every layer it
    targets; otherwise one error whose fix names a value that divides them all (the
    hint is computed over every targeted layer, not only the first that failed).

    Args:
        cfg: the stage's config (anything with ``quantizes``, ``group_size``).
        layers: ``[(module name, in_features)]`` of every layer the stage targets.

    Raises:
        ConfigError: naming the first layer ``group_size`` does not divide, how many
            others fail, and the fix: the group sizes of :data:`GROUP_SIZES` (and ``-1``,
            one group per row, when every input size is a multiple of 16) that divide
            every targeted input size, or, when none does, the layers to leave out.
    """
    gs = getattr(cfg, "group_size", None)
    if not getattr(cfg, "quantizes", False) or not isinstance(gs, int) or isinstance(gs, bool) \
            or gs <= 0:
        return
    bad = [(n, k) for n, k in layers if k % gs]
    if not bad:
        return
    sizes = sorted({k for _, k in layers})
    ok = _fitting(sizes)
    if ok:
        per_row = all(k % 16 == 0 for k in sizes)
        hint = (f"use group_size {' or '.join(ok + (['-1'] if per_row else []))}"
                + (" (-1 = one group per row)" if per_row else "")
                + f": it divides every targeted input size ({', '.join(map(str, sizes))})")
    else:
        odd = sorted({k for k in sizes if k % 16})
        rest = [k for k in sizes if k % 16 == 0]
        ok_rest = _fitting(rest)
        names = sorted({n.rsplit(".", 1)[-1] for n, k in layers if k in odd})
        hint = (f"no group size the ONNX export can store (a multiple of 16) divides the input "
                f"size {' or '.join(map(str, odd))} of {', '.join(names)}: leave "
                f"{'it' if len(names) == 1 else 'them'} out (ignore = {names} in a recipe file)"
                + (f" and use group_size {' or '.join(ok_rest)} for the other layers" if ok_rest and rest else ""))
    more = f" (and of {len(bad) - 1} other targeted layer{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
    name, k = bad[0]
    raise ConfigError(f"group_size={gs} does not divide the input size {k} of {name}{more}", hint)


def check_sweep(cfg, damping: str) -> None:
    """The settings of the OBS column sweep (GPTQ, SparseGPT): the relative Hessian
    damping named ``damping`` (``damp_percent``, ``percdamp``) is >= 0 and ``blocksize``
    is positive.

    Raises:
        ConfigError: naming the setting and a valid value.
    """
    v = getattr(cfg, damping)
    if not 0 <= v:
        raise ConfigError(f"{damping}={v} must be >= 0", "use e.g. 0.01")
    if cfg.blocksize <= 0:
        raise ConfigError(f"blocksize={cfg.blocksize} must be positive", "use 128")


def check_clip_grid(cfg) -> None:
    """The clipping search's settings (AWQ, GPTQ's ``clip_search``): ``n_grid >= 1`` and
    ``max_shrink`` in ``[0, 1)``; the fix names the config's own default.

    Raises:
        ConfigError: naming the setting and a valid value.
    """
    default = {f.name: f.default for f in dataclasses.fields(cfg)}
    if cfg.n_grid < 1:
        raise ConfigError(f"n_grid={cfg.n_grid} must be >= 1", f"use {default['n_grid']}")
    if not 0 <= cfg.max_shrink < 1:
        raise ConfigError(f"max_shrink={cfg.max_shrink} must be in [0, 1)", f"use {default['max_shrink']}")


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


_SCALAR_TYPES = {"int": ((numbers.Integral,), "an integer"), "float": ((numbers.Real,), "a number"),
                 "bool": ((bool,), "true or false")}


def _scalar_type(annotation) -> tuple[Optional[str], bool]:
    """``("int", optional)`` for a field annotated ``int`` / ``Optional[int]`` / ``int | None``
    (as a string, the ``from __future__ import annotations`` form, or as the type itself);
    ``(None, ...)`` for anything that is not a scalar setting."""
    t = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    t = t.replace("typing.", "").replace(" ", "")
    optional = t.startswith("Optional[") or t.endswith("|None")
    if t.startswith("Optional["):
        t = t[len("Optional["):-1]
    elif t.endswith("|None"):
        t = t[:-len("|None")]
    return (t if t in _SCALAR_TYPES else None), optional


def _check_setting_types(cfg) -> None:
    """A recipe file's ``blocksize: "128"`` is a one-line error, not a TypeError deep in
    a method."""
    for f in dataclasses.fields(cfg):
        base, optional = _scalar_type(f.type)
        if base is None:
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


@dataclass(kw_only=True)
class MethodConfig:
    """Base of the method configs: which layers a recipe stage compresses, and how.

    Subclasses are dataclasses that set the class attributes below and add the method's
    options as fields (with defaults), checked by :meth:`validate`.

    Class attributes:
        method: the registered name (``"gptq"``): ``method: gptq`` in a recipe file,
            ``--method gptq`` on the command line.
        is_pruner: the method removes weights (returns keep-masks). A pruner's config has
            ``sparsity``, ``prune_n``, ``prune_m`` (:class:`PruneOptions`): the engine's
            data-free fallback (magnitude) reads them.
        is_quantizer: the method rounds weights to an integer grid. A quantizer's config has
            ``bits``, ``group_size``, ``sym`` (:class:`QuantOptions`): the engine's
            data-free fallback (RTN) reads them.
        may_precede_quantizer: the method may run on a layer that a later stage quantizes
            (AWQ: it then only folds its scales and clips; that stage rounds).

    Attributes:
        targets: module-name patterns of the layers to compress (``None``: every linear
            of the decoder blocks).
        ignore: patterns of layers left alone (default ``["lm_head"]``).
    """

    targets: Optional[list[str]] = None
    ignore: list[str] = field(default_factory=_default_ignore)

    method: ClassVar[str] = ""
    is_pruner: ClassVar[bool] = False
    is_quantizer: ClassVar[bool] = False
    may_precede_quantizer: ClassVar[bool] = False

    @property
    def quantizes(self) -> bool:
        """Whether this stage leaves integer codes on its layers (what the engine's
        ordering rule and fallback ask); :attr:`is_quantizer` unless a config says
        otherwise (SparseGPT quantizes only with ``bits`` set)."""
        return self.is_quantizer

    @property
    def kind(self) -> str:
        """``"prune"`` for pruners (SparseGPT with ``bits`` too), ``"quant"`` for quantizers:
        the earlier spelling of :attr:`is_pruner` / :attr:`is_quantizer`."""
        return "prune" if self.is_pruner else "quant" if self.is_quantizer else ""

    def selects(self, name: str) -> bool:
        """True when the module ``name`` is a target of this stage (and not ignored)."""
        if any(pattern_matches(p, name) for p in self.ignore or []):
            return False
        if self.targets is None:
            return True
        return any(pattern_matches(p, name) for p in self.targets)

    def to_dict(self) -> dict:
        """``{"method": name, **fields}`` (JSON/TOML-able; :meth:`from_options` reads it back)."""
        d = {"method": self.method}
        d.update(dataclasses.asdict(self))
        return d

    def validate(self) -> None:
        """Check the settings (subclasses extend it, calling ``super().validate()``).

        Raises:
            ConfigError: a bad target/ignore list.
        """
        _check_targets(self)

    @classmethod
    def from_options(cls, **options: Any) -> "MethodConfig":
        """The config from settings as a recipe file or the CLI gives them: ``None``
        values are dropped (so a CLI can pass every option), the types are checked (a
        quoted number is refused), then :meth:`validate`.

        Raises:
            ConfigError: a setting the method does not have, of the wrong type, or out
                of range.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in options.items() if v is not None}
        bad = sorted(set(kw) - fields)
        if bad:
            raise ConfigError(f"method {cls.method!r} has no setting {', '.join(bad)}",
                              f"its settings are {', '.join(sorted(fields))}")
        cfg = cls(**kw)
        _check_setting_types(cfg)
        cfg.validate()
        return cfg


@dataclass
class PruneOptions(MethodConfig):
    """The options every pruner shares: unstructured ``sparsity``, or N:M (``prune_n`` of
    every ``prune_m`` consecutive inputs kept; ``sparsity`` is then ignored)."""

    sparsity: float = 0.5
    prune_n: int = 0
    prune_m: int = 0
    is_pruner = True

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a bad sparsity / N:M / target list."""
        super().validate()
        check_sparsity(self)


@dataclass
class QuantOptions(MethodConfig):
    """The options every quantizer shares: the grid (``bits``, ``group_size`` -1 = one
    group per row, ``sym``; see :mod:`edgeprune.quantize`)."""

    bits: int = 4
    group_size: int = 64
    sym: bool = False
    is_quantizer = True

    def validate(self) -> None:
        """Raises :class:`ConfigError` on a bad grid or target list."""
        super().validate()
        check_bits(self.bits, self.group_size, self.sym)


__all__ = ["MethodConfig", "PruneOptions", "QuantOptions", "pattern_matches", "check_sparsity",
           "check_bits", "check_sweep", "check_group_size", "GROUP_SIZES"]
