"""The method registry: each compression method's config class joined to its implementation.

The way torchao keys its handlers by config type: a method's file declares its config (a
dataclass deriving :class:`~edgeprune.methods.config.MethodConfig`) and its
:class:`~edgeprune.methods.base.Method`, and joins them once::

    @dataclass
    class GPTQConfig(QuantOptions):
        method = "gptq"
        damp_percent: float = 0.01
        ...

    @register_method(GPTQConfig)
    class GPTQ(Method):
        ...

Everything else reads the registry: :func:`get_method` (the engine), :func:`config_class`
(recipe parsing: ``method: gptq``), :func:`method_names` (the CLI's ``--method``
choices), :func:`config_classes` (``edgeprune.GPTQConfig``).

Names are matched without case, ``-`` or ``_`` (``"GPTQ"``, ``"sparse-gpt"``).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Callable, TypeVar

from ..errors import ConfigError
from .base import Method
from .config import MethodConfig

_M = TypeVar("_M", bound=type)

#: registered name -> config class, in registration order
_CONFIGS: dict[str, type[MethodConfig]] = {}
#: registered name -> method class
_METHODS: dict[str, type[Method]] = {}

#: Read-only live views: ``name -> config class`` and ``name -> Method class``.
CONFIGS = MappingProxyType(_CONFIGS)
METHODS = MappingProxyType(_METHODS)


def _key(name: str) -> str:
    return str(name or "").strip().lower().replace("-", "").replace("_", "")


def register_method(config_cls: type[MethodConfig]) -> Callable[[_M], _M]:
    """Class decorator joining a :class:`Method` subclass to its config class.

    Sets ``method_cls.name`` and ``method_cls.config_class``, and ``config_cls.method_class``.

    Args:
        config_cls: a dataclass deriving :class:`MethodConfig` whose ``method`` class
            attribute is the name to register (unique regardless of case, ``-``, ``_``).

    Raises:
        ConfigError: the config is not a :class:`MethodConfig` dataclass, it has no
            ``method`` name, the name is taken, or the decorated class is not a
            :class:`Method`.
    """
    name = getattr(config_cls, "method", "")
    if not (isinstance(config_cls, type) and issubclass(config_cls, MethodConfig)
            and dataclasses.is_dataclass(config_cls)):
        raise ConfigError(f"cannot register {config_cls!r}: not a MethodConfig dataclass",
                          "derive the config from edgeprune.methods.MethodConfig and decorate it with @dataclass")
    if not isinstance(name, str) or not _key(name):
        raise ConfigError(f"cannot register {config_cls.__name__}: it has no method name",
                          f'set method = "<name>" in the class body of {config_cls.__name__}')
    taken = next((n for n in _CONFIGS if _key(n) == _key(name)), None)
    if taken is not None:
        raise ConfigError(f"cannot register {config_cls.__name__}: the method name {name!r} is taken "
                          f"by {_CONFIGS[taken].__name__}", "choose another name, or unregister_method() first")

    def join(method_cls: _M) -> _M:
        if not (isinstance(method_cls, type) and issubclass(method_cls, Method)):
            raise ConfigError(f"cannot register {method_cls!r} for {name!r}: not a Method subclass",
                              "derive the implementation from edgeprune.methods.Method")
        method_cls.name = name
        method_cls.config_class = config_cls
        config_cls.method_class = method_cls
        _CONFIGS[name] = config_cls
        _METHODS[name] = method_cls
        return method_cls

    return join


def unregister_method(name: str) -> None:
    """Remove a registered method (tests; a plugin replacing one). Unknown names are ignored."""
    for n in [n for n in _CONFIGS if _key(n) == _key(name)]:
        del _CONFIGS[n], _METHODS[n]


def method_names() -> list[str]:
    """The registered method names, in registration order (the CLI's ``--method`` choices)."""
    return list(_CONFIGS)


def config_classes() -> dict[str, type[MethodConfig]]:
    """``{name: config class}`` of every registered method, in registration order."""
    return dict(_CONFIGS)


def config_class(name: str) -> type[MethodConfig]:
    """The config class registered under ``name`` (case, ``-`` and ``_`` ignored).

    Raises:
        ConfigError: no method of that name, listing the registered ones.
    """
    for n, cls in _CONFIGS.items():
        if _key(n) == _key(name):
            return cls
    raise ConfigError(f"unknown compression method {name!r}", f"use one of {', '.join(sorted(_CONFIGS))}")


def is_registered(config) -> bool:
    """Whether ``config`` is an instance of a registered config class (or a subclass of one)."""
    return _method_class(type(config)) is not None


def _method_class(config_type: type):
    for t in config_type.__mro__:
        for n, cls in _CONFIGS.items():
            if cls is t:
                return _METHODS[n]
    return None


def get_method(config) -> Method:
    """The :class:`Method` instance for a config object, looked up by the config's type
    (a subclass of a registered config class finds its parent's method).

    Raises:
        ConfigError: no method is registered for the config's type.
    """
    cls = _method_class(type(config))
    if cls is None:
        raise ConfigError(f"no compression method is registered for {type(config).__name__} "
                          f"(method {getattr(config, 'method', None)!r})",
                          f"use a config of one of {', '.join(sorted(_CONFIGS))}")
    return cls(config)


__all__ = ["register_method", "unregister_method", "get_method", "method_names", "config_class",
           "config_classes", "is_registered", "CONFIGS", "METHODS"]
