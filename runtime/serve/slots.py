"""Generation slots: bounded concurrency with a bounded queue, and the thread that runs one
generation for the event loop.

A slot is one :class:`runtime.session.Session` (the first loaded, the others
``Session.fork()`` of it: one onnxruntime session, weights loaded once, one KV cache per
slot) with prefix reuse on. :class:`SlotPool` hands a free slot to a request, preferring
the slot whose cache holds the longest prefix of the request's prompt (the previous turn
of the same conversation), else the least recently used one; when every slot is busy the
request waits in a FIFO queue of at most ``queue_size`` requests, and beyond that it is
refused at once (:class:`ServerBusy`, a 503). :class:`Generation` runs a
``TextStream`` in its own thread and hands the pieces to the event loop; cancelling it
(a client that went away) stops the generation before its next token and frees its KV
buffers, and the slot is returned to the pool only once the session is free again.

Needs no web framework (asyncio only).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import AsyncIterator, Optional

from .protocol import RequestError


class ServerBusy(RequestError):
    """Every slot is busy and the queue is full: 503 with ``Retry-After``."""

    def __init__(self, running: int, waiting: int):
        super().__init__(503, f"the server is busy: {running} generation(s) running and {waiting} "
                              "waiting, the most it takes (--max-concurrency, --queue-size); "
                              "retry later", code="server_busy", kind="server_error",
                         headers={"Retry-After": "1"})


class SlotPool:
    """Sessions that generate concurrently, handed out one request at a time.

    Args:
        sessions: one session per slot (``reuse_prefix`` is turned on).
        queue_size: requests that may wait for a slot (0: refuse when all are busy).

    Attributes:
        sessions: the slots, in order.
    """

    def __init__(self, sessions: list, queue_size: int):
        if not sessions:
            raise ValueError("a slot pool needs at least one session")
        self.sessions = list(sessions)
        for s in self.sessions:
            s.reuse_prefix = True
        self.queue_size = int(queue_size)
        self._free = list(self.sessions)
        self._waiters: list[asyncio.Future] = []
        self._reserved = 0      # free slots promised to woken waiters not yet running
        self._clock = itertools.count()
        self._used = {id(s): 0 for s in self.sessions}

    @property
    def running(self) -> int:
        """Slots generating now."""
        return len(self.sessions) - len(self._free)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiters)

    def _pick(self, ids: list) -> object:
        """The free slot whose cache keeps the most of ``ids``, else the least recently used."""
        best = max(self._free, key=lambda s: (s.reusable_prefix_length(ids), -self._used[id(s)]))
        self._free.remove(best)
        self._used[id(best)] = next(self._clock)
        return best

    async def acquire(self, ids: list):
        """A free slot for a prompt of token ids ``ids`` (waits in the queue if needed).

        Raises:
            ServerBusy: all slots busy and ``queue_size`` requests already waiting.
        """
        if len(self._free) > self._reserved and not self._waiters:
            return self._pick(ids)
        if len(self._waiters) >= self.queue_size:
            raise ServerBusy(self.running, self.waiting)
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut in self._waiters:
                self._waiters.remove(fut)
            elif fut.done() and not fut.cancelled():
                self._reserved -= 1     # woken but gone (client left): pass the turn on
                self._wake()
            raise
        self._reserved -= 1
        return self._pick(ids)

    def release(self, slot) -> None:
        """Give ``slot`` back (event-loop thread); the first waiter gets it."""
        self._free.append(slot)
        self._wake()

    def _wake(self) -> None:
        """Promise the free slots not yet promised to the first waiters, in order."""
        while self._waiters and len(self._free) > self._reserved:
            fut = self._waiters.pop(0)
            if not fut.done():
                self._reserved += 1
                fut.set_result(None)

    def state(self) -> list[dict]:
        """Per slot: ``busy``, ``cached_tokens``, ``kv_bytes`` (for ``/health``)."""
        out = []
        for s in self.sessions:
            kv = s.kv_cache_state()
            out.append({"busy": s not in self._free, "cached_tokens": kv["cached_tokens"],
                        "kv_bytes": kv["allocated_bytes"]})
        return out


class Generation:
    """One generation on a slot, run in its own thread for the event loop.

    Args:
        pool: the pool the slot goes back to when the generation is over.
        slot: the session.
        stream: ``slot.stream(...)`` (arguments already checked).

    Attributes:
        stream: the ``TextStream`` (``finish_reason``, ``result`` once over).
    """

    def __init__(self, pool: SlotPool, slot, stream):
        self.pool, self.slot, self.stream = pool, slot, stream
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.done = asyncio.Event()
        threading.Thread(target=self._work, name="edgeprune-generation", daemon=True).start()

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:        # the event loop is gone (server shut down)
            pass

    def _work(self) -> None:
        try:
            for piece in self.stream:
                self._put(("piece", piece))
            self._put(("end", None))
        except BaseException as e:  # noqa: BLE001 -- handed to the request's coroutine
            self._put(("error", e))
        finally:
            self.stream.close()     # frees the KV buffers of an unfinished generation
            try:
                self._loop.call_soon_threadsafe(self._finish)
            except RuntimeError:
                pass

    def _finish(self) -> None:
        self.pool.release(self.slot)
        self.done.set()

    def cancel(self) -> None:
        """Stop before the next token (thread-safe; nothing if already over)."""
        self.stream.cancel()

    async def pieces(self) -> AsyncIterator[str]:
        """The text pieces as they come; raises what the generation raised."""
        while True:
            kind, value = await self._queue.get()
            if kind == "piece":
                yield value
            elif kind == "error":
                raise value
            else:
                return


async def watch_disconnect(request, gen: Generation, every_s: float = 0.25) -> None:
    """Cancel ``gen`` when the client of ``request`` (a Starlette request) disconnects."""
    while not gen.done.is_set():
        if await request.is_disconnected():
            gen.cancel()
            return
        try:
            await asyncio.wait_for(gen.done.wait(), every_s)
        except asyncio.TimeoutError:
            pass


__all__ = ["SlotPool", "Generation", "ServerBusy", "watch_disconnect"]
