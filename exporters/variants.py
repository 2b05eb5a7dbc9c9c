"""Graph variants as decoder-builder mixins, registered by name (the exporter's plug-in point).

A graph variant (LeanK key pruning, COUNTDOWN sparse MLP, compact 2:4, ...) is a mixin class
over :class:`~exporters.decoder.DecoderBuilder` that overrides only the hooks it changes
(``build_inputs``, ``key_head_dim``, ``build_attention``, ``build_mlp``, ``build_lm_head``,
``build_extra_outputs``, ``float_matmul``, ``io_metadata``...; the list is in
``DecoderBuilder``'s docstring), the way onnxruntime-genai's builders subclass a base
``Model`` and override ``make_attention`` / ``make_mlp``::

    from edgeprune_exporters.variants import VariantMixin, register_export_variant

    @register_export_variant("myvariant")
    class MyVariantMixin(VariantMixin):
        def __init__(self, model, spec, opts):
            super().__init__(model, spec, opts)
            self.my = check(opts.variants["myvariant"])       # its spec, a plain dict

        def build_mlp(self, i, layer, h):
            ...

        def variant_record(self) -> dict:                       # edgeprune.json "variants"
            return {...}

:func:`exporters.export_onnx` composes ``BUILDERS[model_type]`` with the requested mixins
(``variants=[...]``, applied in order: the first one listed sits next to the base class)
and writes every mixin's :meth:`VariantMixin.variant_record` into ``edgeprune.json`` as
``"variants": {name: record}``, which ``runtime.load`` reads to pick the variant's session.
This package never imports ``edgeprune``: a spec arrives as a plain dict (a compress-side
``edgeprune.variants.VariantSpec`` is turned into ``to_dict()`` plus, under ``"arrays"``,
its ``arrays()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

from edgeprune_runtime.errors import ExportError, RuntimeLoadError

#: variant name -> builder mixin class (filled by :func:`register_export_variant`)
EXPORT_VARIANTS: dict[str, type] = {}


class VariantMixin:
    """Base of the builder mixins: the contract :func:`exporters.export_onnx` relies on.

    A mixin reads its spec dict from ``self.opts.variants[name]`` in ``__init__`` (after
    ``super().__init__``), validates it (raising :class:`ExportError` naming the fix) and
    overrides builder hooks; :meth:`variant_record` describes what it built.
    """

    variant_name: str = ""

    def variant_record(self) -> dict:
        """The variant's non-empty ``edgeprune.json`` record (called after ``build()``)."""
        raise NotImplementedError


def register_export_variant(name: str) -> Callable[[type], type]:
    """Class decorator: register a builder mixin as the graph variant ``name``.

    Raises:
        ValueError: ``name`` is empty or taken by another class, or the class defines no
            ``variant_record``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("an export variant needs a non-empty name")

    def deco(cls: type) -> type:
        taken = EXPORT_VARIANTS.get(name, cls)       # the same class again (a re-imported module) is fine
        if taken.__qualname__ != cls.__qualname__:
            raise ValueError(f"export variant {name!r} is already registered by {taken.__qualname__}")
        if getattr(cls, "variant_record", None) in (None, VariantMixin.variant_record):
            raise ValueError(f"export variant {name!r}: {cls.__qualname__} defines no variant_record()")
        cls.variant_name = name
        EXPORT_VARIANTS[name] = cls
        return cls

    return deco


def _one_entry(v) -> tuple[str, dict]:
    opts: Mapping = {}
    if isinstance(v, tuple):
        if len(v) != 2 or not isinstance(v[1], Mapping):
            raise ExportError(f"variant entry {v!r} is not (variant, options dict)",
                              "pass e.g. (spec, {'graph_mode': 'sparse'}) or ('leank', mask_dict)")
        v, opts = v
    if isinstance(v, str):
        name, d = v, {}
    elif isinstance(v, Mapping):
        raise ExportError("a spec dict does not name its variant",
                          "pass (name, dict), e.g. ('leank', mask.to_dict()), or the spec object")
    elif callable(getattr(v, "to_dict", None)) and isinstance(getattr(v, "name", None), str):
        name, d = v.name, dict(v.to_dict())
        arrays = v.arrays() if callable(getattr(v, "arrays", None)) else {}
        if arrays:
            d["arrays"] = dict(arrays)
    else:
        raise ExportError(f"variant {type(v).__name__} is neither a name, a spec dict nor a "
                          "variant spec", "pass e.g. 'compact24' or a spec from edgeprune.variants.load_spec")
    d.update(opts)
    return str(name), d


def variant_entries(variants) -> list[tuple[str, dict]]:
    """``[(name, spec dict)]`` from :func:`exporters.export_onnx`'s ``variants``: each item a
    registered name (``"compact24"``), an object with ``name`` / ``to_dict()`` / ``arrays()``
    (``edgeprune.variants.VariantSpec``), or a tuple ``(item, options)`` whose options dict
    updates the spec dict (``(spec, {"graph_mode": "sparse"})``, ``("leank", mask_dict)``).

    Raises:
        ExportError: an unknown name (the registered ones listed), a variant given twice,
            or two variants that each need their own runtime session.
    """
    out: list[tuple[str, dict]] = []
    for v in variants or ():
        name, d = _one_entry(v)
        if name not in EXPORT_VARIANTS:
            raise ExportError(f"graph variant {name!r} is unknown",
                              f"use one of {', '.join(sorted(EXPORT_VARIANTS))}, or register it "
                              "with exporters.variants.register_export_variant")
        if any(n == name for n, _ in out):
            raise ExportError(f"graph variant {name!r} is given twice", "pass each variant once")
        out.append((name, d))
    from edgeprune_runtime.variants import session_class
    try:       # an export the runtime could not load is refused before any work
        session_class({"variants": {n: {"requested": True} for n, _ in out}}, object)
    except RuntimeLoadError as e:
        raise ExportError(e.message, e.hint) from None
    return out


def compose_builder(base: type, names: list[str]) -> type:
    """The builder class ``base`` with the mixins of ``names`` applied in order (the first
    name's mixin next to ``base``, the last one's outermost)."""
    if not names:
        return base
    mixins = [EXPORT_VARIANTS[n] for n in reversed(names)]
    label = "".join(m.__name__.removesuffix("Mixin") for m in mixins)
    return type(label + base.__name__, (*mixins, base), {})


__all__ = ["EXPORT_VARIANTS", "VariantMixin", "register_export_variant", "variant_entries",
           "compose_builder"]
