"""``RPCFuture``: a ``concurrent.futures.Future`` whose ``result()`` drives the replies.

Replies are read by whichever thread waits for one (no extra thread, no hand-off in the
hot path); reading for one call completes every earlier call on the way.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable


class RPCFuture(concurrent.futures.Future):
    """The future of one ``collective_rpc(..., non_block=True)`` call."""

    def __init__(self, drive: Callable[[float | None], None]) -> None:
        super().__init__()
        self._drive = drive

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._drive(timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._drive(timeout)
        return super().exception(timeout=0)
