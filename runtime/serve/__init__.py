"""An OpenAI-compatible HTTP server over an export: ``edgeprune serve EXPORT``.

>>> from edgeprune_runtime.serve import serve
>>> serve("out/smollm2-int4", port=8000, max_concurrency=2)     # blocks; Ctrl-C stops

Then any OpenAI client talks to it::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="smollm2-int4", messages=[...], stream=True)

Routes, limits and errors: :mod:`runtime.serve.app`; the wire format:
:mod:`runtime.serve.protocol`; concurrency (slots, queue, 503) and prefix reuse between the
turns of a conversation: :mod:`runtime.serve.slots`.

Built on Starlette and uvicorn, an optional extra (``pip install 'edgeprune[serve]'``):
``import edgeprune_runtime`` never loads this package, and it imports no torch and nothing of
edgeprune, exporters or devices.
"""

from __future__ import annotations

from typing import Optional

from ..errors import ConfigError

_MISSING = ("the server needs starlette and uvicorn, which are not installed",
            "pip install 'edgeprune[serve]'")


def _app_module():
    """:mod:`runtime.serve.app`, or the one clear error when the extra is missing."""
    try:
        from . import app
    except ImportError as e:
        if (e.name or "").split(".")[0] in ("starlette", "uvicorn", "anyio", "h11"):
            raise ConfigError(*_MISSING) from e
        raise
    return app


def create_app(sessions: list, model_name: str = "edgeprune", queue_size: int = 8,
               max_request_bytes: int = 1 << 20, max_tokens: Optional[int] = None):
    """The ASGI app over loaded sessions (:func:`runtime.serve.app.create_app`).

    Raises:
        ConfigError: starlette / uvicorn are not installed.
    """
    return _app_module().create_app(sessions, model_name, queue_size, max_request_bytes,
                                    max_tokens)


def load_slots(folder, max_concurrency: int = 1, threads: Optional[int] = None,
               max_length: Optional[int] = None) -> list:
    """``max_concurrency`` sessions over ``folder``: one loaded, the others forks of it (one
    onnxruntime session, weights loaded once; a KV cache each).

    Raises:
        ConfigError: ``max_concurrency`` below 1.
        RuntimeLoadError: as :func:`runtime.load`.
    """
    import edgeprune_runtime as runtime

    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ConfigError(f"max_concurrency must be a positive integer, got {max_concurrency!r}",
                          "pass e.g. --max-concurrency 2")
    first = runtime.load(folder, threads=threads, max_length=max_length)
    return [first] + [first.fork() for _ in range(max_concurrency - 1)]


def serve(folder, host: str = "127.0.0.1", port: int = 8000, max_concurrency: int = 1,
          queue_size: int = 8, max_request_bytes: int = 1 << 20, threads: Optional[int] = None,
          max_length: Optional[int] = None, model_name: Optional[str] = None,
          max_tokens: Optional[int] = None, log_level: str = "info") -> None:
    """Serve the export ``folder`` until interrupted.

    Args:
        folder: the export folder.
        host, port: where to listen (``127.0.0.1``: this machine only).
        max_concurrency: generations at once (one KV cache each).
        queue_size: requests that may wait for a slot; beyond them a 503.
        max_request_bytes: largest request body; beyond it a 413.
        threads: onnxruntime intra-op threads (shared by the slots).
        max_length: context length (default: the export's).
        model_name: the name clients use (default: the folder's name).
        max_tokens: cap on the tokens of a request that sets none (default: the context).
        log_level: uvicorn's (``info`` logs one line per request).

    Raises:
        ConfigError: the extra is missing, a limit is out of range, or the address cannot
            be listened on.
        RuntimeLoadError: the folder cannot be loaded.
    """
    from pathlib import Path

    mod = _app_module()
    for name, v, low in (("queue_size", queue_size, 0), ("max_request_bytes", max_request_bytes, 1),
                         ("port", port, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {v!r}",
                              f"pass e.g. --{name.replace('_', '-')} {max(low, 8)}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise ConfigError(f"max_tokens must be a positive integer, got {max_tokens!r}",
                          "pass e.g. --max-tokens 512")
    sessions = load_slots(folder, max_concurrency, threads, max_length)
    import logging

    log = logging.getLogger("edgeprune_runtime.serve")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
    log.setLevel(log_level.upper())
    try:
        name = model_name or Path(folder).resolve().name
        app = mod.create_app(sessions, name, queue_size, max_request_bytes, max_tokens)
        log.info("serving %s as '%s' at http://%s:%d/v1: %d slot(s), queue %d; Ctrl-C stops",
                 folder, name, host, port, len(sessions), queue_size)
        server = mod.UvicornServer(app, host=host, port=port, log_level=log_level)
        try:
            server.run()
        except KeyboardInterrupt:      # uvicorn re-raises the Ctrl-C it handled: a normal stop
            pass
        except SystemExit:             # uvicorn exits when it cannot bind
            if server.started:
                raise
        if not server.started:
            raise ConfigError(f"cannot listen on {host}:{port} (in use, or not an address of "
                              "this machine)", "pass a free --port, or another --host")
    finally:
        for s in sessions:
            s.close()


__all__ = ["serve", "create_app", "load_slots"]
