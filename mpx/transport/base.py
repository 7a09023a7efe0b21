"""The transport interface: a writer side that broadcasts framed messages, and a reader
side that receives them. The queue above never knows which transport it talks to.

A message is ``(kind, parts)`` from :mod:`mpx.serde`. Deadlines are absolute
``time.monotonic_ns()`` values, ``-1`` for none.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol


class TransportWriter(Protocol):
    def wait_ready(self, deadline_ns: int, cancel: threading.Event | None = None) -> None:
        """Return once every reader of this transport is attached; QueueTimeout names the
        missing ones, Cancelled on shutdown() or ``cancel``."""

    def write(self, kind: int, parts: tuple, deadline_ns: int) -> None:
        """Deliver one message to every reader, or raise (QueueTimeout, Cancelled,
        PeerDiedError) leaving the transport usable."""

    def shutdown(self) -> None:
        """Wake this process's waiters (Cancelled). Readers are not told (vLLM's meaning);
        close() tells them."""

    def close(self) -> None:
        """Release every resource; idempotent."""

    def handle_info(self) -> dict[str, Any]:
        """What a reader needs to attach (picklable)."""


class TransportReader(Protocol):
    def wait_ready(self, deadline_ns: int, cancel: threading.Event | None = None) -> None:
        """Return once the writer side is ready for this reader; every exit of a wait
        (deadline, shutdown, ``cancel``, close, a dead writer) raises."""

    def read(self, deadline_ns: int, cancel: threading.Event | None, warn: bool) -> tuple[int, Any]:
        """The next message as ``(kind, data)``, or raise (QueueTimeout, Cancelled,
        PeerDiedError)."""

    def shutdown(self) -> None:
        """Wake this process's waiters with Cancelled."""

    def close(self) -> None:
        """Detach; idempotent."""
