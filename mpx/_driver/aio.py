"""The awaitable forms of the Executor's blocking methods: ``shutdown_async``,
``check_health_async``, ``wait_for_failure`` (and ``failure_future``, its form for threads).

None of them blocks the event loop: a shutdown runs in a thread of its own (``mpx-shutdown``)
that the loop awaits; a health check sends its ping as a non-blocking call and awaits it;
the failure is a ``concurrent.futures.Future`` that a failure callback completes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpx import _debug
from mpx._driver import lockorder
from mpx.errors import ExecutorFailed
from mpx.protocol import wire

if TYPE_CHECKING:
    from mpx._driver.executor import Executor

# While a health check's ping is out, how often it looks for a stall report that came in
# meanwhile (the blocking check_health raises at once for those already read; here the
# ping's own replies bring them in): a stalled rank is reported within this, not at the
# ping's timeout. Each look is one loop timer.
STALL_POLL_S = 0.1


class Once:
    """One future, made and started (``start(fut)``) by the first caller of ``get`` only;
    the executor keeps one for its shutdown and one for its failure. The future runs from
    the start, so that a caller who wraps it (``asyncio.wrap_future``) and is cancelled
    cannot cancel it for the others."""

    def __init__(self) -> None:
        # (held to make the future only, never to start it)
        self._lock = lockorder.lock("aio.Once's lock", lockorder.LEAF)
        self._future: concurrent.futures.Future | None = None

    def get(self, start: Callable[[concurrent.futures.Future], None]
            ) -> concurrent.futures.Future:
        with self._lock:
            fut, first = self._future, False
            if fut is None:
                fut = self._future = concurrent.futures.Future()
                fut.set_running_or_notify_cancel()
                first = True
        if first:
            start(fut)
        return fut


def _run_into(fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
    try:
        result = fn()
    except BaseException as e:
        fut.set_exception(e)
    else:
        fut.set_result(result)


def _start_shutdown(ex: Executor, fut: concurrent.futures.Future) -> None:
    thread = threading.Thread(target=_debug.counted_thread(_run_into),
                              args=(ex.shutdown, fut), name="mpx-shutdown")
    thread.start()


async def shutdown(ex: Executor) -> None:
    """See ``Executor.shutdown_async``."""
    if not ex._finalizer.alive:
        return  # shut down already
    fut = ex._shutdown_once.get(lambda f: _start_shutdown(ex, f))
    await asyncio.wrap_future(fut)


async def check_health(ex: Executor, timeout: float) -> None:
    """See ``Executor.check_health_async``."""
    group = ex._group
    group.calls.check_usable()
    group.stalls.raise_reported()
    ping = ex.collective_rpc(wire.PING, timeout=timeout, non_block=True)
    while not ping.done():
        await asyncio.wait((ping,), timeout=STALL_POLL_S)
        if not ping.done():
            group.stalls.raise_reported()
    pids = ping.result()
    expected = group.pids
    if pids != expected:
        raise ExecutorFailed(f"workers answered with pids {pids}, expected {expected}")


def failure_future(ex: Executor) -> concurrent.futures.Future:
    """See ``Executor.failure_future``."""
    group = ex._group  # (the callback holds the group, never the executor: no cycle)

    def start(fut: concurrent.futures.Future) -> None:
        def failed() -> None:
            failure = group.calls.failure
            fut.set_result(failure if failure is not None else
                           ExecutorFailed("the executor failed"))

        group.add_failure_callback(failed)

    return ex._failure_once.get(start)


async def wait_for_failure(ex: Executor) -> ExecutorFailed:
    """See ``Executor.wait_for_failure``."""
    return await asyncio.wrap_future(failure_future(ex))
