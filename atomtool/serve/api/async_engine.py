"""An asyncio front for the synchronous :class:`LLMEngine`: the engine steps in its own thread.

Design (the shape of vLLM's AsyncLLMEngine, in one process): the engine is not thread safe, so only
the *engine thread* touches it. The event loop sends commands (add / abort) through a locked deque and
wakes the thread; the thread applies the commands between steps, runs ``engine.step()`` while work
remains, and hands each step's outputs back to the loop with one ``loop.call_soon_threadsafe`` per
step, which routes them to per-request :class:`asyncio.Queue` s. Many HTTP handlers therefore stream
concurrently while the engine batches their sequences.

Failure isolation: an exception from ``add_request`` fails that request only (the caller's ``await``
raises it). An exception from ``step()`` cannot be attributed to one request, so every request in
flight at that moment is aborted in the engine (freeing its KV blocks) and gets an
:class:`~atomtool.errors.EngineError`; the thread keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from atomtool.errors import EngineError

logger = logging.getLogger("atomtool.serve")


@dataclass
class EngineSnapshot:
    """Engine counters published by the engine thread after every step (read by /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    steps: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]."""
        if self.num_total_blocks <= 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


@dataclass
class _Failure:
    request_id: str
    error: BaseException


@dataclass
class _Cmd:
    kind: str  # "add" | "abort"
    request_id: str
    prompt: Any = None
    params: Any = None
    future: concurrent.futures.Future | None = None


@dataclass
class RequestGroup:
    """The outputs of the engine requests behind one HTTP request (``n`` choices x prompts).

    Iterate with ``async for out in group``: yields each :class:`RequestOutput` as it arrives (tagged
    by ``request_id``) until every request has finished; raises :class:`EngineError` if the engine
    failed one of them (the caller then calls ``abort()``). ``abort()`` aborts whatever has not
    finished (client gone, error elsewhere).
    """

    engine: AsyncEngine
    request_ids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.unfinished = set(self.request_ids)

    async def __aiter__(self) -> AsyncIterator[Any]:
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, _Failure):
                # The caller aborts the rest of the group (and accounts for it) on this error.
                raise EngineError(f"request {item.request_id} failed in the engine: {item.error}")
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item
        self.engine._release(self)

    def abort(self) -> None:
        """Abort the unfinished requests of this group (idempotent)."""
        for rid in list(self.unfinished):
            self.engine.abort(rid)
        self.unfinished.clear()
        self.engine._release(self)


class AsyncEngine:
    """Run ``engine`` (an :class:`LLMEngine`) in a background thread behind an asyncio API.

    Args:
        engine: an object with the LLMEngine API (``add_request``, ``step``, ``abort``,
            ``has_unfinished``, ``num_free_blocks``, ``num_total_blocks``, ``stats``).
        on_output: optional callback run on the event loop for every :class:`RequestOutput` (metrics).

    Call :meth:`start` from inside the running event loop (the app's lifespan) and :meth:`shutdown`
    when the server stops.
    """

    def __init__(self, engine: Any, on_output: Callable[[Any], None] | None = None) -> None:
        self.engine = engine
        self.on_output = on_output
        self.snapshot = EngineSnapshot()
        self._cmds: collections.deque[_Cmd] = collections.deque()
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._groups: dict[str, RequestGroup] = {}
        self._dead: BaseException | None = None
        self._publish_snapshot()

    # ---------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread; must be called with the serving event loop running."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="atomtool-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step (in-flight requests are aborted)."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------------------ loop-side API
    async def submit(self, requests: list[tuple[str, Any, Any]]) -> RequestGroup:
        """Add engine requests ``(request_id, prompt, SamplingParams)`` and return their group.

        Waits until the engine thread has accepted every request, so validation errors
        (:class:`InvalidRequestError` from ``add_request``) raise here, before any response starts;
        on such an error the requests already added are aborted.
        """
        if not self.is_alive:
            raise EngineError("the engine is not running")
        group = RequestGroup(self, [rid for rid, _, _ in requests])
        for rid in group.request_ids:
            self._groups[rid] = group
        futures = []
        for rid, prompt, params in requests:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._send(_Cmd("add", rid, prompt, params, fut))
            futures.append(fut)
        try:
            for fut in futures:
                await asyncio.wrap_future(fut)
        except BaseException:
            group.abort()
            raise
        return group

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort ``request_id`` (frees its KV blocks); no-op if finished."""
        self._groups.pop(request_id, None)
        self._send(_Cmd("abort", request_id))

    def _release(self, group: RequestGroup) -> None:
        for rid in group.request_ids:
            if self._groups.get(rid) is group:
                del self._groups[rid]

    def _send(self, cmd: _Cmd) -> None:
        with self._wake:
            if self._dead is not None:
                if cmd.future is not None:
                    cmd.future.set_exception(EngineError(f"the engine thread died: {self._dead}"))
                return
            self._cmds.append(cmd)
            self._wake.notify()

    def _dispatch(self, items: list[Any]) -> None:
        """Runs on the event loop: route one step's outputs to their request groups."""
        for item in items:
            group = self._groups.get(item.request_id)
            if group is None:
                continue  # aborted or unknown: drop
            if self.on_output is not None and not isinstance(item, _Failure):
                try:
                    self.on_output(item)
                except Exception:  # metrics must never break serving
                    logger.exception("on_output callback failed")
            group.queue.put_nowait(item)

    # ---------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        """Engine-thread entry: :meth:`_serve_loop`, and if that ever dies, fail everyone instead of hanging."""
        try:
            self._serve_loop()
        except BaseException as exc:  # noqa: B036 - last resort: report, fail waiters, stop
            logger.exception("the engine thread died")
            with self._wake:
                self._dead = exc
                pending = list(self._cmds)
                self._cmds.clear()
            for cmd in pending:
                if cmd.future is not None and not cmd.future.done():
                    cmd.future.set_exception(EngineError(f"the engine thread died: {exc}"))
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _fail_all(self, exc: BaseException) -> None:
        """Runs on the event loop: every open request group gets an error."""
        self._dispatch([_Failure(rid, exc) for rid in list(self._groups)])

    def _serve_loop(self) -> None:
        active: set[str] = set()
        while True:
            with self._wake:
                while not self._stop and not self._cmds and not active:
                    self._wake.wait()
                if self._stop:
                    break
                cmds = list(self._cmds)
                self._cmds.clear()
            failures: list[Any] = []
            for cmd in cmds:
                if cmd.kind == "add":
                    try:
                        self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
                    except BaseException as exc:  # noqa: B036 - handed to the awaiting request
                        cmd.future.set_exception(exc)
                    else:
                        active.add(cmd.request_id)
                        cmd.future.set_result(None)
                elif cmd.request_id in active:
                    active.discard(cmd.request_id)
                    self._abort_in_engine(cmd.request_id)
            outputs: list[Any] = []
            if active:
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    logger.exception("engine step failed; aborting the %d requests in flight", len(active))
                    for rid in active:
                        self._abort_in_engine(rid)
                        failures.append(_Failure(rid, exc))
                    active.clear()
                for out in outputs:
                    if out.finished:
                        active.discard(out.request_id)
                if active and not self.engine.has_unfinished():
                    # The engine dropped requests without a final output: fail them rather than spin.
                    for rid in active:
                        failures.append(_Failure(rid, EngineError("the engine dropped the request")))
                    active.clear()
                self.snapshot.steps += 1
            self._publish_snapshot(len(active))
            items = list(outputs) + failures
            if items and self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._dispatch, items)
                except RuntimeError:  # loop closed during shutdown
                    break
        for rid in active:
            self._abort_in_engine(rid)

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("engine.abort(%s) failed", request_id)

    def _publish_snapshot(self, num_active: int = 0) -> None:
        """Read the engine's counters (engine thread only) into :attr:`snapshot`.

        Running/waiting come from ``engine.stats()``; if it does not report them, every request in
        the engine counts as running.
        """
        snap = self.snapshot
        try:
            snap.num_free_blocks = int(self.engine.num_free_blocks())
            snap.num_total_blocks = int(self.engine.num_total_blocks())
            stats = self.engine.stats() or {}
        except Exception:
            logger.exception("reading engine counters failed")
            return
        snap.num_running = int(_first(stats, ("num_running", "running", "num_running_reqs"), num_active))
        snap.num_waiting = int(_first(stats, ("num_waiting", "waiting", "num_waiting_reqs"), 0))


def _first(stats: Any, keys: tuple[str, ...], default: Any) -> Any:
    for key in keys:
        if isinstance(stats, dict) and key in stats:
            return stats[key]
        if hasattr(stats, key):
            return getattr(stats, key)
    return default


def monotonic() -> float:
    """Seconds from a monotonic clock (one place, so tests could patch it)."""
    return time.monotonic()
