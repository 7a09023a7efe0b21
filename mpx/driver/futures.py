"""``RPCFuture``: the future of a non-blocking call, complete on its own, and awaitable."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Generator
from typing import Any, Callable


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
        return asyncio.wrap_future(self).__await__()
