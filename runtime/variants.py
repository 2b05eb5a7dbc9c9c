"""The runtime's plug-in point for graph variants: session classes registered by name.

A graph variant (LeanK key pruning, COUNTDOWN sparse MLP, compact 2:4, ...) is written by
the exporter under its name into ``edgeprune.json``::

    "variants": {"leank": {...the variant's record...}}

A variant whose graph needs its own generation loop or caches registers a
:class:`~runtime.session.Session` subclass under that name; :func:`runtime.load` looks it
up here. A variant that runs in the plain loop (compact 2:4) registers nothing::

    from edgeprune_runtime.session import Session
    from edgeprune_runtime.variants import register_session

    @register_session("myvariant")
    class MyVariantSession(Session):
        ...

Exports written before the registry recorded LeanK and COUNTDOWN under top-level
``leank`` / ``countdown`` keys (and ``compact_24: true``); :func:`variant_records` reads
both forms. Third-party packages can add sessions through the ``edgeprune.sessions``
entry-point group (``name = "module:Class"``), loaded when an unknown name is met.
"""

from __future__ import annotations

from typing import Callable, Optional

from .errors import RuntimeLoadError

#: variant name -> Session subclass (filled by ``register_session``)
SESSIONS: dict = {}

#: top-level ``edgeprune.json`` keys of exports written before the ``variants`` record
LEGACY_KEYS = ("leank", "countdown")

ENTRY_POINT_GROUP = "edgeprune.sessions"


def register_session(name: str) -> Callable[[type], type]:
    """Class decorator: run exports whose ``edgeprune.json`` records the variant ``name``
    with this :class:`~runtime.session.Session` subclass.

    Raises:
        ValueError: ``name`` is empty or already taken by another class.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("a session variant needs a non-empty name")

    def deco(cls: type) -> type:
        prev = SESSIONS.get(name)
        if prev is not None and prev is not cls and prev.__qualname__ != cls.__qualname__:
            raise ValueError(f"session variant {name!r} is already registered by {prev.__qualname__}")
        SESSIONS[name] = cls
        cls.variant_name = name
        return cls

    return deco


def variant_records(meta: dict) -> dict:
    """``{variant name: record}`` of an export's ``edgeprune.json`` (``meta``), in the
    order the exporter applied them; legacy top-level keys included."""
    out = {}
    recs = meta.get("variants") if isinstance(meta, dict) else None
    if isinstance(recs, dict):
        out.update({str(k): v for k, v in recs.items() if v})
    if isinstance(meta, dict):
        for k in LEGACY_KEYS:
            if meta.get(k) and k not in out:
                out[k] = meta[k]
        if meta.get("compact_24") is True and "compact24" not in out:
            out["compact24"] = {"compact_24": True}
    return out


def _from_entry_points(name: str) -> Optional[type]:
    try:
        from importlib.metadata import entry_points
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == name:
                return ep.load()
    except Exception:  # noqa: BLE001 -- a broken third-party plug-in must not break loading
        return None
    return None


def session_class(meta: dict, default: type) -> type:
    """The session class for an export's ``edgeprune.json`` content ``meta``: the one
    registered for its variant, or ``default`` when no recorded variant has one.

    Raises:
        RuntimeLoadError: two recorded variants each need their own session class.
    """
    found = []
    for name in variant_records(meta):
        cls = SESSIONS.get(name) or _from_entry_points(name)
        if cls is not None:
            SESSIONS.setdefault(name, cls)
            found.append((name, cls))
    if len(found) > 1:
        raise RuntimeLoadError(f"the export combines the variants {', '.join(n for n, _ in found)}, "
                               "each of which needs its own session",
                               "export them separately")
    return found[0][1] if found else default


__all__ = ["SESSIONS", "register_session", "variant_records", "session_class"]
