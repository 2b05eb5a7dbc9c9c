"""Graph variants on the compress side: specs registered by name, saved and loaded.

A graph variant (LeanK key pruning, COUNTDOWN sparse MLP, ...) is one file per stage,
each registered under the variant's name (``docs/architecture.md``). Here, the compress
stage: a :class:`VariantSpec` subclass holds what calibration produced, its PyTorch
reference and its (de)serialisation, joined by :func:`register_variant`::

    @register_variant
    class MySpec(VariantSpec):
        name = "myvariant"
        ...

    spec = MySpec.calibrate(model, calib_ids, strength=0.5)
    save_spec(spec, "my.json")                   # edgeprune export CKPT OUT --variant my.json
    with load_spec("my.json").reference(model):  # the function the exported graph computes
        logits = model(ids).logits

The exporter's mixin of the same name (``exporters.variants``) builds the graph from
``spec.to_dict()`` (+ ``spec.arrays()``); the runtime's session of that name (if any)
runs it.

Files (:func:`save_spec` / :func:`load_spec`): a spec without arrays is JSON
(``{"edgeprune_variant": name, ...to_dict()}``); one with arrays is a safetensors file whose
``__metadata__`` holds ``edgeprune_variant`` (the name) and ``spec`` (the JSON of
``to_dict()``).
Never a pickle. Files written before this registry (LeanK mask JSON, COUNTDOWN spec
folders) are read through the variants' :meth:`VariantSpec.read_legacy`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, ClassVar, Optional

import numpy as np

from .errors import CheckpointError, ConfigError

#: variant name -> :class:`VariantSpec` subclass (filled by :func:`register_variant`)
VARIANTS: dict[str, type] = {}

#: the built-in variants' modules, imported when their name is first asked for
BUILTIN = {"leank": "edgeprune.leank", "countdown": "edgeprune.countdown",
           "igprune": "edgeprune.igprune", "kvcache": "edgeprune.kvcache"}

#: the key naming the variant in a spec file (a spec's own fields may use ``variant``)
NAME_KEY = "edgeprune_variant"


class VariantSpec:
    """Base of a graph variant's compress-side spec.

    Attributes:
        name: the variant's registered name (the exporter's mixin and the runtime's
            session use the same one).
        title: how errors name the spec (``"LeanK mask"``).
    """

    name: ClassVar[str] = ""
    title: ClassVar[str] = "variant spec"

    def to_dict(self) -> dict:
        """JSON-ready dict of everything but the large tensors (see :meth:`arrays`)."""
        raise NotImplementedError

    @classmethod
    def from_dict(cls, d: dict, arrays: Optional[dict] = None) -> "VariantSpec":
        """Inverse of :meth:`to_dict` + :meth:`arrays`.

        Raises:
            CheckpointError: a dict or arrays this class did not write.
        """
        raise NotImplementedError

    def arrays(self) -> dict[str, np.ndarray]:
        """Large tensors by name (none by default); saved as safetensors."""
        return {}

    @classmethod
    def calibrate(cls, model, calib_ids, **options) -> "VariantSpec":
        """Build the spec of ``model`` from calibration windows ``int64 [nsamples, seqlen]``."""
        raise NotImplementedError

    def reference(self, model):
        """Context manager: inside it ``model`` computes what the exported graph computes."""
        raise NotImplementedError

    @classmethod
    def read_legacy(cls, path: Path) -> Optional["VariantSpec"]:
        """The spec of a file or folder written before this registry in this variant's own
        format, or ``None`` when ``path`` is not one."""
        return None


def register_variant(cls: type) -> type:
    """Class decorator: register a :class:`VariantSpec` subclass under ``cls.name``.

    Raises:
        ValueError: no name, or the name is taken by another class.
    """
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__qualname__} needs a non-empty class attribute 'name'")
    prev = VARIANTS.get(name)
    if prev is not None and prev is not cls and prev.__qualname__ != cls.__qualname__:
        raise ValueError(f"variant {name!r} is already registered by {prev.__qualname__}")
    VARIANTS[name] = cls
    return cls


def _load_builtins() -> None:
    for module in BUILTIN.values():
        importlib.import_module(module)


def variant_class(name: str) -> type:
    """The registered :class:`VariantSpec` subclass of ``name`` (built-ins loaded on demand).

    Raises:
        ConfigError: no such variant (the registered ones are listed).
    """
    if name not in VARIANTS and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    if name not in VARIANTS:
        _load_builtins()
        raise ConfigError(f"variant {name!r} is unknown",
                          f"use one of {', '.join(sorted(VARIANTS))}, or register it with "
                          "edgeprune.variants.register_variant")
    return VARIANTS[name]


def save_spec(spec: VariantSpec, path) -> Path:
    """Write ``spec`` atomically: JSON when it holds no arrays (unless ``path`` ends in
    ``.safetensors``), else safetensors with the JSON in its ``__metadata__``.

    Raises:
        ConfigError: a spec with arrays and a ``.json`` path, or an unregistered spec.
    """
    from edgeprune_runtime.files import atomic_write

    path = Path(path)
    if VARIANTS.get(spec.name) is not type(spec):
        raise ConfigError(f"{type(spec).__name__} is not a registered variant spec",
                          "decorate it with @edgeprune.variants.register_variant")
    d, arrays = spec.to_dict(), {k: np.ascontiguousarray(v) for k, v in spec.arrays().items()}
    if arrays and path.suffix == ".json":
        raise ConfigError(f"the {spec.title} holds arrays, which a JSON file {path} cannot",
                          f"write it to {path.with_suffix('.safetensors')}")
    if arrays or path.suffix == ".safetensors":
        from safetensors.numpy import save
        meta = {NAME_KEY: spec.name, "spec": json.dumps(d)}
        return atomic_write(path, save(arrays, metadata=meta))
    return atomic_write(path, json.dumps({NAME_KEY: spec.name, **d}))


def _is_safetensors(path: Path) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON header."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:] == b"{" and \
        int.from_bytes(head[:8], "little") + 8 <= path.stat().st_size


def _read(path: Path) -> tuple[Optional[str], Any, dict]:
    """``(variant name or None, spec dict or None, arrays)`` of a spec file."""
    if not _is_safetensors(path):
        d = json.loads(path.read_text())
        if not isinstance(d, dict):
            return None, None, {}
        return d.pop(NAME_KEY, None), d, {}
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    spec = json.loads(meta["spec"]) if "spec" in meta else None
    return meta.get(NAME_KEY), spec, arrays


def load_spec(path, kind: Optional[type] = None) -> VariantSpec:
    """Read a spec written by :func:`save_spec` (or, through the variants'
    :meth:`VariantSpec.read_legacy`, a LeanK mask JSON or COUNTDOWN spec folder written
    before). The file names its variant; ``kind`` (a :class:`VariantSpec` subclass)
    requires that one.

    Raises:
        CheckpointError: a missing, unreadable or foreign file, or a spec of another
            variant than ``kind``.
        ConfigError: the file names a variant that is not registered (the registered ones
            are listed).
    """
    path = Path(path)
    what = kind.title if kind is not None else "variant spec"
    name, d, arrays = None, None, {}
    if not path.exists():
        raise CheckpointError(f"{what} {path} does not exist",
                              "write one with `edgeprune leank` or `edgeprune countdown`")
    try:
        if path.is_file():
            name, d, arrays = _read(path)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read {what} {path}: {e}",
                              "pass a file written by `edgeprune leank` / `edgeprune countdown` "
                              "(edgeprune.variants.save_spec)") from e
    if name is None:
        _load_builtins()
        for cls in ([kind] if kind is not None else list(VARIANTS.values())):
            spec = cls.read_legacy(path)
            if spec is not None:
                return spec
        raise CheckpointError(f"{path} is not an edgeprune {what} (it names no variant)",
                              "pass a file written by edgeprune.variants.save_spec "
                              "(`edgeprune leank` / `edgeprune countdown`)")
    cls = variant_class(str(name))
    if kind is not None and cls is not kind:
        raise CheckpointError(f"{path} holds a {cls.title}, not a {kind.title}",
                              f"pass a {kind.title} file")
    if not isinstance(d, dict):
        raise CheckpointError(f"{what} {path} has no spec", "re-write it with save_spec")
    return cls.from_dict(d, arrays)


__all__ = ["VariantSpec", "VARIANTS", "BUILTIN", "NAME_KEY", "register_variant",
           "variant_class", "save_spec", "load_spec"]
