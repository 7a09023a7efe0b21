"""``RPCFuture``: the future of a non-blocking call, complete on its own, and awaitable."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Callable, Generator
from typing import Any, Protocol


class ReplySource(Protocol):
    """What an event loop needs of the call table to read replies in its own thread."""

    def read_ready(self) -> int | None:
        """Read the replies already there: how many, or None if another thread reads."""

    def lease_to_loop(self) -> None:
        """Leave the reading to an event loop for a moment."""

    def wake_background(self) -> None:
        """The loop reads no more: the background reader waits for the next replies."""


class _LoopDelivery:
    """Completes the asyncio side of the futures awaited in one event loop, and reads their
    replies in the loop's own thread while they keep coming.

    A reply read in another thread wakes the loop once for every batch (where
    ``asyncio.wrap_future`` wakes it once for each future). While futures are awaited, the
    loop then reads the replies itself, a step per loop iteration, with no thread hand-off;
    when a step finds none, the background reader waits for the next one.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)  # the registry is keyed by the loop: no cycle
        self.thread = threading.get_ident()
        self.lock = threading.Lock()
        self.batch: list[tuple[asyncio.Future, concurrent.futures.Future]] = []
        self.awaiting: dict[ReplySource, int] = {}  # futures awaited in this loop, by source
        self.reading: set[ReplySource] = set()      # sources this loop reads now

    def expect(self, source: ReplySource) -> None:
        """A future of ``source`` is awaited (in the loop's thread)."""
        self.awaiting[source] = self.awaiting.get(source, 0) + 1
        self._read(source)

    def forget(self, source: ReplySource) -> None:
        """That await ended (done, or cancelled)."""
        left = self.awaiting[source] - 1
        if left:
            self.awaiting[source] = left
        else:
            del self.awaiting[source]

    def add(self, target: asyncio.Future, done: concurrent.futures.Future,
            source: ReplySource) -> None:
        with self.lock:
            first = not self.batch
            self.batch.append((target, done))
        loop = self.loop()
        if threading.get_ident() == self.thread:
            if first and loop is not None:
                loop.call_soon(self.deliver)  # (a step delivers before that)
            return
        source.lease_to_loop()
        if first and loop is not None:
            try:
                loop.call_soon_threadsafe(self.deliver)
            except RuntimeError:
                pass  # the loop is closed: nobody awaits any more

    def deliver(self) -> None:
        """Set the asyncio futures of the completed ones (in the loop's thread), then read
        on for the futures still awaited."""
        self._deliver_batch()
        for source in list(self.awaiting):
            self._read(source)

    def _deliver_batch(self) -> None:
        if not self.batch:
            return
        with self.lock:
            batch, self.batch = self.batch, []
        for target, done in batch:
            if target.cancelled():
                continue  # the awaiting task gave up (wait_for); the reply is dropped
            exc = done.exception(0)
            if exc is not None:
                target.set_exception(exc)
            else:
                target.set_result(done.result(0))

    def _read(self, source: ReplySource) -> None:
        loop = self.loop()
        if source in self.reading or loop is None:
            return
        self.reading.add(source)
        source.lease_to_loop()
        loop.call_soon(self._step, source)

    def _step(self, source: ReplySource) -> None:
        got = source.read_ready()
        self._deliver_batch()
        loop = self.loop()
        if got and self.awaiting.get(source) and loop is not None:
            source.lease_to_loop()
            loop.call_soon(self._step, source)  # replies keep coming: read on next round
            return
        self.reading.discard(source)
        if self.awaiting.get(source):
            source.wake_background()


_deliveries: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopDelivery] = \
    weakref.WeakKeyDictionary()
_deliveries_lock = threading.Lock()


# concurrent.futures' states (stable since Python 3.2): read without the future's lock on
# the await path, where each lock costs as much as the rest of the step.
_RUNNING = concurrent.futures._base.RUNNING  # type: ignore[attr-defined]
_FINISHED = concurrent.futures._base.FINISHED  # type: ignore[attr-defined]
_last = threading.local()  # this thread's loop and its delivery, the common case's lookup


def _delivery(loop: asyncio.AbstractEventLoop) -> _LoopDelivery:
    found = getattr(_last, "delivery", None)
    if found is not None and found.loop() is loop:
        return found
    found = _deliveries.get(loop)
    if found is None:
        with _deliveries_lock:
            found = _deliveries.setdefault(loop, _LoopDelivery(loop))
    _last.delivery = found
    return found


class RPCFuture(concurrent.futures.Future):
    """The future of one ``collective_rpc(..., non_block=True)`` call.

    It completes when the call's replies arrive, whether or not anyone calls ``result()``:
    done callbacks run, and ``concurrent.futures.wait``/``as_completed`` work. It is
    awaitable as it is (``await ex.collective_rpc(..., non_block=True)``), and works with
    ``asyncio.wrap_future``, ``asyncio.gather`` and ``asyncio.wait_for``.

    A call is running from the moment it is sent, so ``cancel()`` returns False, as it does
    for a running ``concurrent.futures`` call. Cancelling a task that awaits the future (or an
    ``asyncio.wait_for`` timeout) leaves the call to finish; its reply is then dropped.
    """

    def __init__(self, wait: Callable[[float | None], None], source: ReplySource) -> None:
        super().__init__()
        self._wait = wait
        self._source = source
        self._state = _RUNNING  # set_running_or_notify_cancel(), for a future none has seen

    def result(self, timeout: float | None = None) -> Any:
        """The call's result; ``TimeoutError`` after ``timeout`` seconds (the call goes on).
        The waiting thread reads the replies itself when no other thread does."""
        if not self.done():
            self._wait(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's exception, or None; waits as :meth:`result` does."""
        if not self.done():
            self._wait(timeout)
        return super().exception(timeout)

    def __await__(self) -> Generator[Any, None, Any]:
        if self._state == _FINISHED:
            return self.result(0)
        loop = asyncio.get_running_loop()
        target = loop.create_future()
        delivery = _delivery(loop)
        source = self._source
        self.add_done_callback(lambda f: delivery.add(target, f, source))
        delivery.expect(source)
        try:
            return (yield from target)
        finally:
            delivery.forget(source)
