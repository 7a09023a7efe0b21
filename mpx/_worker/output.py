"""How a worker's replies leave it: inline, or from a background thread (``async_output``).

A reply ``(seq, status, payload)`` goes on the worker's response queue. A result with a
``get_output()`` method (e.g. one that waits on a CUDA event after a non-blocking copy to
the host) is resolved first, in whichever thread sends it. Whatever ``get_output()`` or the
pickling of the result raises fails that call only, unless it ends the worker
(:data:`ENDS_THE_WORKER`, the rule of :mod:`mpx._worker.main`). Looking for ``get_output``
runs the result's ``__getattr__``, if it has one: anything that raises means "none".

With ``Config.async_output`` a single thread sends, so the RPC loop can start the next call
at once and replies keep their order. If that thread fails (not because the driver is
gone), the worker exits at once, with the error logged: the driver reports its death
instead of waiting for a reply that will never come.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from typing import Any

from mpx import _debug
from mpx.errors import Cancelled, PeerDiedError, QueueTimeout
from mpx.protocol.wire import ERR, OK, error_payload
from mpx.queue import deadline_of

# Calls whose replies may wait in the async output thread's queue: 2 lets call N's output
# be resolved while call N+1 computes, and bounds what waits in memory.
ASYNC_DEPTH = 2
# How often a put into the full output queue checks that the output thread still runs.
_PUT_POLL_S = 0.1
# What a call may raise that ends the worker instead of failing the call: requests to stop
# the process (asyncio's rule for its callbacks).
ENDS_THE_WORKER = (SystemExit, KeyboardInterrupt)
# What a reply's send raises that is not about encoding the reply: the worker's ends, and
# the channel's own errors (nothing was written; an error reply would fail the same way).
_NOT_ENCODING = ENDS_THE_WORKER + (Cancelled, PeerDiedError, QueueTimeout)

logger = logging.getLogger("mpx")


class Replies:
    """The response queue, shared by the sender of replies and the watchdog. It needs no
    lock of its own: each thread pickles with its own pickler, and the queue's one writer
    end writes a message whole under its lock, so replies and stall reports never mix."""

    def __init__(self, resp: Any) -> None:
        self._resp = resp
        self._out = resp.writing_end()  # the replies' channel: enqueue's work, one per call

    def close(self) -> None:
        self._resp.close()

    def send(self, seq: int, status: int, payload: Any, timeout: float | None = None) -> None:
        """Send one reply; a result that cannot be encoded is sent as its error."""
        out = self._out
        out.wake_readers()  # a parked driver wakes while the reply is pickled
        deadline = deadline_of(timeout)
        try:
            out.send((seq, status, payload), deadline)
        except _NOT_ENCODING:  # (the channel's own: the driver is gone, or too slow)
            raise
        except BaseException as e:  # SerializationError, or what a __reduce__ raised
            out.send((seq, ERR, error_payload(e)), deadline)


def _bind_device(worker: Any) -> None:
    """Make the worker's torch device current in this thread, when it has one."""
    device = getattr(worker, "device", None)
    torch = sys.modules.get("torch")
    if torch is None or device is None or getattr(device, "type", None) != "cuda":
        return
    torch.cuda.set_device(device)


def _get_output(payload: Any) -> Any:
    """``payload.get_output`` if it is callable, else None; a ``__getattr__`` that raises
    (``KeyError`` from a dict with its keys as attributes, say) means there is none."""
    try:
        get_output = getattr(payload, "get_output", None)
    except Exception:
        return None
    return get_output if callable(get_output) else None


def resolve(status: int, payload: Any, keep: bool) -> tuple[int, Any]:
    """The reply's (status, payload) once ``get_output()`` (if any) ran; the result itself
    only if ``keep`` (this rank was asked to reply)."""
    if status == OK:
        get_output = _get_output(payload)
        if get_output is not None:
            try:
                payload = get_output()
            except ENDS_THE_WORKER:
                raise
            except BaseException as e:
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
        try:  # (the common reply, a result without get_output, skips resolve)
            plain = status == OK and keep and (payload is None or
                                               not hasattr(payload, "get_output"))
        except Exception:  # its __getattr__ raised: no get_output (see _get_output)
            plain = True
        if not plain:
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
        try:
            _bind_device(self.worker)
            while True:
                item = self.q.get()
                if item is None:
                    return
                seq, status, payload, keep = item
                del item
                status, payload = resolve(status, payload, keep)
                self.replies.send(seq, status, payload)
                del payload
        except (Cancelled, PeerDiedError) as e:  # the driver is gone
            self.failed = e  # (the RPC loop stops at its next put)
        except BaseException as e:
            _end_the_worker(e, self.replies)

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        if self.thread.is_alive():
            self._put(None)
            self.thread.join()


def _end_the_worker(e: BaseException, replies: Replies) -> None:
    """End this worker from the failed output thread, with the exit code a SystemExit asks
    for (else 1). Left to the RPC loop, the end would wait for a next call, which may never
    come: the driver waits for the reply that was lost."""
    logger.critical("the output thread failed, so this worker (pid %d) exits: %r",
                    os.getpid(), e, exc_info=e)
    code = e.code if isinstance(e, SystemExit) else 1
    try:
        replies.close()  # what was written leaves first (over ZeroMQ it may still be queued)
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # closed, or a broken pipe: nothing to keep
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)
