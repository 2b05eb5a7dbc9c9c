"""The HTTP application (Starlette) and its runners (uvicorn): OpenAI's routes over a slot pool.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON, or server-sent
events with ``"stream": true``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` (slots, their cached prefix and KV bytes, queue). Every error is OpenAI's
error JSON: 400 (bad field, ``context_length_exceeded``), 404, 405, 413 (body over
``max_request_bytes``), 503 (all slots busy and the queue full; ``Retry-After``), 500.

A client that disconnects stops its generation before the next token (streaming: when a
chunk cannot be sent; otherwise polled every 0.25 s) and its slot's KV buffers are freed;
the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from typing import Optional

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..errors import GenerationError
from ..streaming import CANCELLED
from .protocol import (Reply, RequestError, error_body, finish_reason, fit_max_tokens, parse_chat,
                       parse_completion)
from .slots import Generation, SlotPool, watch_disconnect

log = logging.getLogger("edgeprune_runtime.serve")

#: bodies over the limit but under this many bytes are read (and dropped) before the 413,
#: so that the client, still sending, reads the answer instead of a reset connection
DRAIN_MAX_BYTES = 64 << 20
#: on shutdown, running answers get this long to finish before they are cancelled
SHUTDOWN_GRACE_S = 5


class ServerState:
    """What the routes share: the slot pool and the limits.

    Args:
        sessions: one loaded session per slot.
        model_name: the name ``/v1/models`` reports and responses carry.
        queue_size: requests that may wait for a slot.
        max_request_bytes: largest request body (413 above it).
        max_tokens: cap on ``max_tokens`` when a request gives none (``None``: the rest
            of the context).
    """

    def __init__(self, sessions: list, model_name: str, queue_size: int,
                 max_request_bytes: int, max_tokens: Optional[int]):
        self.pool = SlotPool(sessions, queue_size)
        self.model_name = model_name
        self.max_request_bytes = int(max_request_bytes)
        self.max_tokens = max_tokens
        self.tokenizer = sessions[0].tokenizer
        self.max_length = int(sessions[0].max_length)
        self.created = int(time.time())
        self.active: set = set()        # running Generations
        self.tasks: set = set()         # their bookkeeping tasks (referenced until done)
        self.closing = False

    def check_open(self) -> None:
        """Raises a 503 once the server shuts down."""
        if self.closing:
            raise RequestError(503, "the server is shutting down", code="shutting_down",
                               kind="server_error")

    def cancel_all(self) -> None:
        """Shutting down: refuse new requests and cancel the running generations (each
        stops before its next token and frees its KV buffers)."""
        self.closing = True
        for gen in list(self.active):
            gen.cancel()


async def _read_json(request: Request, limit: int) -> dict:
    """The request's JSON object, read up to ``limit`` bytes.

    Raises:
        RequestError: 413 over the limit, 400 for a body that is not a JSON object.
    """
    def too_large(n):
        return RequestError(413, f"the request body ({n:,} bytes or more) exceeds the server's "
                                 f"limit of {limit:,} bytes (--max-request-bytes)",
                            code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max(limit, DRAIN_MAX_BYTES):
        raise too_large(int(declared))
    chunks, n = [], 0
    async for chunk in request.stream():       # over the limit: read on, keep nothing
        n += len(chunk)
        if n <= limit:
            chunks.append(chunk)
        elif n > DRAIN_MAX_BYTES:
            break
    if n > limit:
        raise too_large(n)
    try:
        body = json.loads(b"".join(chunks) or b"null")
    except ValueError as e:
        raise RequestError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events of one generation; the generation is cancelled however the
    response ends (a client gone away included)."""

    def __init__(self, content, gen: Generation):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._content, self._gen = content, gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass
        finally:
            self._gen.cancel()
            await self._content.aclose()


async def _events(gen: Generation, reply: Reply):
    """The chunks of a streamed answer, then ``[DONE]``."""
    try:
        if reply.chat:
            yield _sse(reply.chunk(first=True))
        async for piece in gen.pieces():
            yield _sse(reply.chunk(piece))
        if gen.stream.finish_reason == CANCELLED:
            yield _sse(_cancelled().body())
            return
        yield _sse(reply.chunk(finish=finish_reason(gen.stream.finish_reason)))
        if reply.req.include_usage:
            yield _sse(reply.usage_chunk(gen.stream.result))
    except GenerationError as e:
        yield _sse(error_body(str(e), code="generation_error"))
    except Exception as e:  # noqa: BLE001 -- the stream has started: report in-band
        log.exception("generation failed")
        yield _sse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))
    finally:
        gen.cancel()
    yield "data: [DONE]\n\n"


def _cancelled() -> RequestError:
    return RequestError(503, "the answer was cancelled: the server is shutting down",
                        code="cancelled", kind="server_error")


async def _complete(request: Request, parse) -> object:
    """A chat or completion request: parse, queue for a slot, generate, answer."""
    st: ServerState = request.app.state.edgeprune
    body = await _read_json(request, st.max_request_bytes)
    req = parse(body, st.tokenizer)
    n = fit_max_tokens(req, st.max_length, st.max_tokens)
    st.check_open()
    slot = await st.pool.acquire(req.prompt_ids)
    try:
        st.check_open()
        stream = slot.stream(req.prompt_ids, max_new_tokens=n, **req.sampling)
    except BaseException:
        st.pool.release(slot)
        raise
    gen = Generation(st.pool, slot, stream)
    reply = Reply(req, st.model_name)
    st.active.add(gen)
    task = asyncio.get_running_loop().create_task(_track(st, gen, req.kind))
    st.tasks.add(task)
    task.add_done_callback(st.tasks.discard)
    if req.stream:
        return _EventStream(_events(gen, reply), gen)
    watcher = asyncio.create_task(watch_disconnect(request, gen))
    try:
        text = "".join([p async for p in gen.pieces()])
    finally:
        gen.cancel()
        watcher.cancel()
    if gen.stream.finish_reason == CANCELLED:
        raise _cancelled()
    return JSONResponse(reply.response(text, finish_reason(gen.stream.finish_reason),
                                       gen.stream.result))


async def _track(st: ServerState, gen: Generation, kind: str) -> None:
    """Forget ``gen`` once over, and log it."""
    await gen.done.wait()
    st.active.discard(gen)
    r, why = gen.stream.result, gen.stream.finish_reason
    if r is None:
        log.info("%s: ended before the first token (%s)", kind, why)
        return
    log.info("%s: %d prompt tokens (%d cached), %d generated, %s; first token %.0f ms, "
             "%.1f tok/s", kind, r.prompt_tokens[0], r.cached_tokens, len(r.token_ids[0]), why,
             r.ttft_ms, r.decode_tok_s)


async def chat_completions(request: Request):
    """``POST /v1/chat/completions``."""
    return await _complete(request, parse_chat)


async def completions(request: Request):
    """``POST /v1/completions``."""
    return await _complete(request, parse_completion)


def _model_card(st: ServerState) -> dict:
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "edgeprune",
            "max_model_len": st.max_length}


async def models(request: Request):
    """``GET /v1/models``."""
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state.edgeprune)]})


async def model(request: Request):
    """``GET /v1/models/{id}``."""
    st = request.app.state.edgeprune
    if request.path_params["model_id"] != st.model_name:
        raise RequestError(404, f"the model '{request.path_params['model_id']}' does not exist; "
                                f"this server serves '{st.model_name}'", code="model_not_found")
    return JSONResponse(_model_card(st))


async def health(request: Request):
    """``GET /health``: the slots (busy, cached prefix tokens, KV bytes) and the queue."""
    st = request.app.state.edgeprune
    return JSONResponse({"status": "ok", "model": st.model_name, "running": st.pool.running,
                         "waiting": st.pool.waiting, "queue_size": st.pool.queue_size,
                         "slots": st.pool.state()})


async def _request_error(request: Request, exc: RequestError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _generation_error(request: Request, exc: GenerationError):
    return JSONResponse(error_body(str(exc)), status_code=400)


async def _http_error(request: Request, exc: HTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", kind),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception):
    log.exception("request failed")
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                        status_code=500)


def create_app(sessions: list, model_name: str = "edgeprune", queue_size: int = 8,
               max_request_bytes: int = 1 << 20, max_tokens: Optional[int] = None) -> Starlette:
    """The ASGI application over loaded sessions (one per concurrent generation; make the
    extra ones with ``Session.fork()``). Prefix reuse is turned on for each.

    Raises:
        ValueError: no session, or a limit that is not positive.
    """
    if int(max_request_bytes) < 1 or int(queue_size) < 0:
        raise ValueError("max_request_bytes must be >= 1 and queue_size >= 0")
    app = Starlette(
        routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", model, methods=["GET"]),
                Route("/health", health, methods=["GET"])],
        exception_handlers={RequestError: _request_error, GenerationError: _generation_error,
                            HTTPException: _http_error, Exception: _internal_error})
    app.state.edgeprune = ServerState(sessions, model_name, queue_size, max_request_bytes,
                                      max_tokens)
    return app


class UvicornServer(uvicorn.Server):
    """``uvicorn.Server`` that cancels the running generations when it shuts down (so that
    their connections end at once, with an error event, instead of running to the end).

    Args:
        app: the app of :func:`create_app`.
        **config: ``uvicorn.Config`` arguments (``host``, ``port``, ``log_level``...).
    """

    def __init__(self, app, **config):
        config.setdefault("timeout_graceful_shutdown", SHUTDOWN_GRACE_S)
        config.setdefault("lifespan", "off")        # the app has no startup/shutdown events
        super().__init__(uvicorn.Config(app, **config))
        self.state: ServerState = app.state.edgeprune

    async def shutdown(self, sockets=None) -> None:  # noqa: D102
        self.state.cancel_all()
        await super().shutdown(sockets=sockets)


class ServerThread:
    """uvicorn serving an app in a background thread (an app embedding the server, tests).

    >>> with ServerThread(create_app([session])) as srv:
    ...     print(srv.url)        # http://127.0.0.1:<port>

    Args:
        app: the ASGI app (:func:`create_app`).
        host, port: where to listen (port 0: a free one; :attr:`port` tells which).
        log_level: uvicorn's.

    Raises:
        RuntimeError: the server did not start within 30 s.
        OSError: the address is taken.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = UvicornServer(app, log_level=log_level)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="edgeprune-server", daemon=True)

    def start(self) -> "ServerThread":
        """Start serving; returns once the server accepts connections."""
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() - t0 > 30:
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving (running generations are cancelled with their connections)."""
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["create_app", "ServerState", "ServerThread", "UvicornServer", "DRAIN_MAX_BYTES",
           "SHUTDOWN_GRACE_S"]
