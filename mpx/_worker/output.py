"""How a worker's replies leave it: inline, or from a background thread (``async_output``).

A reply ``(seq, status, payload)`` goes on the worker's response queue. A result with a
``get_output()`` method (e.g. one that waits on a CUDA event after a non-blocking copy to
the host) is resolved first, in whichever thread sends it; an exception there fails that
call only. With ``Config.async_output`` a single thread sends, so the RPC loop can start
the next call at once and replies keep their order.
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Any

from mpx import _debug
from mpx.errors import SerializationError
from mpx.queue import deadline_of
from mpx.serde import encode
from mpx.wire import ERR, OK, error_payload

# Calls whose replies may wait in the async output thread's queue: 2 lets call N's output
# be resolved while call N+1 computes, and bounds what waits in memory.
ASYNC_DEPTH = 2
# How often a put into the full output queue checks that the output thread still runs.
_PUT_POLL_S = 0.1


class Replies:
    """The response queue, shared by the sender of replies and the watchdog. It needs no
    lock of its own: each thread pickles with its own pickler, and the queue's one writer
    end writes a message whole under its lock, so replies and stall reports never mix."""

    def __init__(self, resp: Any) -> None:
        end = resp.writing_end()  # (enqueue's work without its frame: one per call)
        self._wake, self._write, self._local = end.wake_readers, end.write, end.shares_memory

    def send(self, seq: int, status: int, payload: Any, timeout: float | None = None) -> None:
        self._wake()  # a parked driver wakes while the reply is pickled
        try:
            kind, parts = encode((seq, status, payload), self._local)
        except SerializationError as e:
            kind, parts = encode((seq, ERR, error_payload(e)), self._local)
        self._write(kind, parts, deadline_of(timeout))


def _bind_device(worker: Any) -> None:
    """Make the worker's torch device current in this thread, when it has one."""
    device = getattr(worker, "device", None)
    torch = sys.modules.get("torch")
    if torch is None or device is None or getattr(device, "type", None) != "cuda":
        return
    torch.cuda.set_device(device)


def resolve(status: int, payload: Any, keep: bool) -> tuple[int, Any]:
    """The reply's (status, payload) once ``get_output()`` (if any) ran; the result itself
    only if ``keep`` (this rank was asked to reply)."""
    if status == OK:
        get_output = getattr(payload, "get_output", None)
        if callable(get_output):
            try:
                payload = get_output()
            except Exception as e:
                return ERR, error_payload(e)
        if not keep:
            payload = None
    return status, payload


class InlineOutput:
    """Sends each reply from the RPC loop itself."""

    def __init__(self, replies: Replies, worker: Any) -> None:
        self.replies = replies
        _bind_device(worker)

    def put(self, seq: int, status: int, payload: Any, keep: bool) -> None:
        if status != OK or not keep or payload is not None and hasattr(payload, "get_output"):
            status, payload = resolve(status, payload, keep)
        self.replies.send(seq, status, payload)

    def close(self) -> None:
        pass


class AsyncOutput:
    """Sends replies from one background thread, in order."""

    def __init__(self, replies: Replies, worker: Any) -> None:
        self.replies = replies
        self.worker = worker
        self.q: queue.Queue = queue.Queue(maxsize=ASYNC_DEPTH)
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=_debug.counted_thread(self._run), name="mpx-output",
                                       daemon=True)
        self.thread.start()

    def put(self, seq: int, status: int, payload: Any, keep: bool) -> None:
        self._put((seq, status, payload, keep))

    def _put(self, item: tuple | None) -> None:
        """Queue ``item``, unless the thread stopped (the driver is gone): then raise why."""
        while True:
            if self.failed is not None:
                raise self.failed
            try:
                self.q.put(item, timeout=_PUT_POLL_S)
                return
            except queue.Full:
                if not self.thread.is_alive() and self.failed is None:
                    raise RuntimeError("mpx: the output thread stopped") from None

    def _run(self) -> None:
        _bind_device(self.worker)
        while True:
            item = self.q.get()
            if item is None:
                return
            seq, status, payload, keep = item
            del item
            status, payload = resolve(status, payload, keep)
            try:
                self.replies.send(seq, status, payload)
            except Exception as e:  # e.g. the driver is gone: the RPC loop stops at its next put
                self.failed = e
                return
            del payload

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        if self.thread.is_alive():
            self._put(None)
            self.thread.join()
