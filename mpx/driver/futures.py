"""``RPCFuture``: the future of a non-blocking call, complete on its own, and awaitable."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Generator
from typing import Any, Callable


class _LoopDelivery:
    """Hands completed futures to one event loop in batches: one wake-up of the loop (one
    ``call_soon_threadsafe``) for all the futures that complete while the loop is busy,
    where ``asyncio.wrap_future`` wakes it once for each."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)  # the registry is keyed by the loop: no cycle
        self.lock = threading.Lock()
        self.batch: list[tuple[asyncio.Future, concurrent.futures.Future]] = []

    def add(self, target: asyncio.Future, done: concurrent.futures.Future) -> None:
        with self.lock:
            first = not self.batch
            self.batch.append((target, done))
        loop = self.loop()
        if first and loop is not None:
            try:
                loop.call_soon_threadsafe(self.deliver)
            except RuntimeError:
                pass  # the loop is closed: nobody awaits any more

    def deliver(self) -> None:
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


_deliveries: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopDelivery] = \
    weakref.WeakKeyDictionary()
_deliveries_lock = threading.Lock()


def _delivery(loop: asyncio.AbstractEventLoop) -> _LoopDelivery:
    found = _deliveries.get(loop)
    if found is None:
        with _deliveries_lock:
            found = _deliveries.setdefault(loop, _LoopDelivery(loop))
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

    def __init__(self, wait: Callable[[float | None], None]) -> None:
        super().__init__()
        self._wait = wait
        self.set_running_or_notify_cancel()

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
        if self.done():
            return self.result(0)
        loop = asyncio.get_running_loop()
        target = loop.create_future()
        delivery = _delivery(loop)
        self.add_done_callback(lambda f: delivery.add(target, f))
        return (yield from target)
