"""The sender: every call gets the next sequence number and goes out on the broadcast queue
in that order, and no caller ever waits for ring room.

Rules (see mpx/_driver/calls.py for the whole model):

- ``order`` (a lock) is held to number, encode and register a call and then either to
  write it, when nothing is queued before it and the ring has room for all of it now (a
  write that cannot wait), or to queue it; when the call is a small message (a tuple of
  scalars: ``serde.encode_small``, no pickler). It is never held while waiting, nor while
  user code runs.
- A call that needs the pickler, which runs its arguments' ``__reduce__`` (user code), is
  encoded outside ``order``, holding ``numbering`` (a lock only the threads that send
  such calls take): under ``order`` it takes the next sequence number and sets
  ``encoding``, pickles with neither lock but ``numbering`` held, then under ``order``
  registers the call and clears ``encoding``. While ``encoding`` is set, every other call
  goes this way too, so waits on ``numbering``: calls are numbered in the order they go
  out, so a slow pickle delays the calls sent after it, which follow it anyway, and
  nothing else: the readers, the death watch, a regroup and shutdown take ``order``
  alone. A ``__reduce__`` that sends a call on the same executor gets a RuntimeError (it
  would wait for itself).
- A call is checked against the membership (``unique_reply_rank``) and sized under
  ``order``, so it goes to one membership; only ``send`` changes the sequence number,
  under ``order``.
- Queued calls go out in order. The threads that read replies flush the queue as they
  read (each reply means its rank has taken a call, so the ring has room again): writes
  that cannot wait, under ``order``. A call larger than the whole ring, which streams
  through it waiting for the readers part way, is written by the sender thread
  (``mpx-sender``, started on first use) when it reaches the head; meanwhile nothing else
  writes. A queued call whose deadline passes is settled with RPCTimeoutError and never
  sent; at shutdown or failure the queue is settled with the table's error.
- A blocking ``collective_rpc`` whose call was queued waits for its replies, reading them
  (and flushing) meanwhile.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from mpx import _debug
from mpx._driver import lockorder
from mpx._driver.futures import RPCFuture
from mpx._driver.pump import until_ns
from mpx._driver.registry import Call
from mpx.errors import (
    Cancelled,
    ExecutorFailed,
    PeerDiedError,
    QueueTimeout,
    RPCTimeoutError,
    WorkerDiedError,
)
from mpx.protocol import serde, wire
from mpx.queue import MessageQueue

if TYPE_CHECKING:
    from mpx._driver.pump import ReplyPump
    from mpx._driver.registry import CallRegistry


class PendingCalls(NamedTuple):
    """What an executor has not finished, for admission control (``Executor.pending_calls``):
    ``in_flight``, calls sent to the workers and not yet settled; ``queued``, calls waiting
    in the driver for room in the broadcast ring, in order."""

    in_flight: int
    queued: int


def _size(parts: tuple) -> int:
    n = 0
    for p in parts:
        n += len(p) if type(p) is bytes else memoryview(p).nbytes
    return n


class Sender:
    """The sending part of the call table (see the module docstring): it numbers calls
    into ``registry`` and writes them, or queues them in ``outbox``; ``pump`` is told of
    what it sends (a deadline to wait for, futures to read replies for)."""

    def __init__(self, registry: CallRegistry, pump: ReplyPump) -> None:
        self.registry, self.pump = registry, pump
        self.ledger, self.pending = registry.ledger, registry.pending
        # the calls waiting in the driver, in order (each entry: the call, its message's
        # kind and parts, whether it fits the ring); their seqs in the registry's `queued`
        self.outbox: collections.deque[tuple[Call, int, tuple, bool]] = collections.deque()
        self._queued_seqs = registry.queued
        # while the group is re-formed (mpx/_driver/regroup.py), every call is queued
        self.held = False
        self.numbering = lockorder.rlock("Sender.numbering", lockorder.NUMBERING)
        self.encoding = False  # a call is being pickled (numbering held; set under order)
        self.order = lockorder.lock("CallTable.order", lockorder.ORDER)
        self.queued_cv = threading.Condition(self.order)
        self._sender: threading.Thread | None = None
        self.writing_large = False  # the sender thread is writing the outbox's head
        self._out: Any = None  # the broadcast queue's writing end (use_broadcast)

    def use_broadcast(self, broadcast: MessageQueue) -> None:
        """Send the calls on ``broadcast`` from now on (at attach, and when the group was
        re-formed, ``order`` held)."""
        # the calls' channel (enqueue's work without its argument handling); a call is
        # encoded first, and written only when the ring has room for it now
        self._out = broadcast.writing_end()
        self._local = self._out.shares_memory
        # a message larger than the ring streams through it, waiting for the readers
        # part way: only the sender thread writes such a one
        self._ring_bytes = self._out.capacity()
        self._ring_fits = sys.maxsize if self._ring_bytes is None else self._ring_bytes

    def wake_workers(self) -> None:
        """A call follows: workers asleep after idling start waking now, so that their
        wake-up overlaps the making of it (MessageQueue.wake_readers); the executor calls
        this first, when nothing is under way, and send() again."""
        self._out.wake_readers()

    def pending_calls(self) -> PendingCalls:
        """Calls in flight and calls queued in the driver (see PendingCalls)."""
        with self.registry.lock:
            queued = len(self.outbox)
            return PendingCalls(len(self.pending) + len(self.registry.answered) - queued, queued)

    def send(self, method: Any, name: str, args: tuple, kwargs: dict | None,
             reply_rank: int | None, aggregator: Callable | None, timeout: float | None,
             non_block: bool, trace: dict[str, str] | None = None) -> Call:
        """Number, register and send (or queue) one call; ``name`` is the method's for
        messages. Never waits for ring room; waits while another thread's call is being
        encoded (``numbering``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        reg = self.registry
        msg = None
        with self.order:  # (`with`, not acquire(): an interrupt cannot come in between)
            if not self.encoding:
                seq = reg.next_seq
                msg = serde.encode_small(wire.call(seq, method, args, kwargs, reply_rank,
                                                   trace))
                if msg is not None:
                    call = self._register(seq, name, reply_rank, aggregator, deadline,
                                          non_block, *msg)
        if msg is None:
            call = self._send_pickled(method, name, args, kwargs, reply_rank, aggregator,
                                      deadline, non_block, trace)
        if self.outbox and not self.pump.baton.locked():
            self.pump.read_ready(0)  # the replies already there make room: it flushes after them
        if deadline is not None:
            self.pump.deadline_added(deadline)
        if reg.completed or reg.answered:
            reg.after_reading()
        if non_block:
            self.pump.read_for_futures()
        return call

    def _send_pickled(self, method: Any, name: str, args: tuple, kwargs: dict | None,
                      reply_rank: int | None, aggregator: Callable | None,
                      deadline: float | None, non_block: bool,
                      trace: dict[str, str] | None) -> Call:
        """send() of a call that needs the pickler (see the module docstring): numbered
        under ``order``, pickled with ``numbering`` alone held, registered under ``order``."""
        reg = self.registry
        with self.numbering:
            with self.order:
                if self.encoding:  # (set by this thread: the others wait on numbering)
                    raise RuntimeError(f"collective_rpc {name!r} was called while this "
                                       "thread pickles another call's arguments (from a "
                                       "__reduce__?): it would wait for itself")
                seq = reg.next_seq
                self.encoding = True
            try:
                kind, parts = serde.encode(wire.call(seq, method, args, kwargs, reply_rank,
                                                     trace), self._local)
            except BaseException as e:
                with self.order:
                    self.encoding = False
                raise self._send_error(e, name) from e
            with self.order:
                self.encoding = False
                return self._register(seq, name, reply_rank, aggregator, deadline,
                                      non_block, kind, parts)

    def _register(self, seq: int, name: str, reply_rank: int | None,
                  aggregator: Callable | None, deadline: float | None, non_block: bool,
                  kind: int, parts: tuple) -> Call:
        """(order held) Check, number and register the call encoded as
        ``kind, parts``; write it, or queue it."""
        reg = self.registry
        n_ranks = reg.n_ranks  # (the membership this call is checked against and sent to)
        if reply_rank is not None and reply_rank >= n_ranks:
            raise ValueError(f"unique_reply_rank must be in [0, {n_ranks}), got "
                             f"{reply_rank!r}: the group has {n_ranks} ranks now")
        call = Call(seq, name, n_ranks, reply_rank, aggregator, deadline, reg.settings)
        if non_block:
            call.future = RPCFuture(self.pump, call, reg.settings)
        reg.next_seq = seq + 1
        if not self.ledger.register(call, parts):
            reg.check_usable()  # (raises: the table stopped)
        self._out.wake_readers()  # (again: the workers that parked since the first)
        first = parts[0] if len(parts) == 1 else None
        if not self.outbox and not self.held and self._out.has_room(parts) and (
                type(first) is bytes and len(first) <= self._ring_fits or self._fits(parts)):
            try:  # (room for all of it on the ring: it cannot wait there)
                self._out.write(kind, parts, until_ns(deadline))
            except BaseException as e:
                reg.forget(call)
                raise self._send_error(e, name) from e
        else:
            self._queue(call, kind, parts)
        return call

    def _fits(self, parts: tuple) -> bool:
        """Whether the message of ``parts`` fits the ring whole (or there is no ring)."""
        cap = self._ring_bytes
        if cap is None:
            return True
        if len(parts) == 1 and type(parts[0]) is bytes:  # (most calls: one small piece)
            return len(parts[0]) <= cap
        return _size(parts) <= cap

    def _send_error(self, e: BaseException, name: str) -> BaseException:
        if isinstance(e, QueueTimeout):
            return RPCTimeoutError(f"collective_rpc {name!r} timed out before every worker "
                                   f"could take the call: {e}", list(range(self.registry.n_ranks)))
        lost = None
        if isinstance(e, PeerDiedError) and e.rank is not None:
            lost = self.registry.on_peer_gone(e.rank, e)  # the monitor may not have seen it yet
        if isinstance(e, (PeerDiedError, Cancelled)):
            if self.registry.failure is not None:
                return self.registry.failure
            if lost is not None:
                return lost
            if isinstance(e, PeerDiedError) and e.rank is not None:  # (restarted, or fails next)
                return WorkerDiedError(f"collective_rpc {name!r} could not be sent: worker rank "
                                       f"{e.rank} is gone: {e}", rank=e.rank, pid=e.pid)
            return ExecutorFailed(f"collective_rpc {name!r} could not be sent: {e}")
        return e

    # ------------------------------------------------------------------ the queue

    def _queue(self, call: Call, kind: int, parts: tuple) -> None:
        """(order held) Queue ``call`` behind the others: a reader sends it once the ring
        has room (flush), or the sender thread, if it is larger than the ring."""
        self.outbox.append((call, kind, parts, self._fits(parts)))
        self._queued_seqs.add(call.seq)
        if len(self.outbox) == 1 and self.pump.baton.locked():
            self.pump.nudge_reader()  # it reads every rank, and flushes, while calls are queued

    def flush(self) -> None:
        """Write the queued calls that the ring has room for now, in order (a reader calls
        this as replies come in: each reply means its rank has taken a call). Never
        waits for room, and runs no user code under ``order``."""
        with self.order:
            failed = self._flush_locked()
        for call, error in failed:
            self._unsent(call, error)

    def _flush_locked(self) -> list[tuple[Call, BaseException]]:
        """(order held) flush()'s writes; the calls that could not be written, with why."""
        outbox, failed = self.outbox, []
        while outbox and not self.writing_large and not self.held:
            call, kind, parts, fits = outbox[0]
            if not call.done:  # (settled while queued: expired, failed; dropped unsent)
                if not fits:
                    self._wake_sender()  # only a write that waits part way sends it
                    break
                if not self._out.has_room(parts):
                    break
                try:
                    self._out.write(kind, parts, until_ns(call.deadline))  # (cannot wait)
                except BaseException as e:
                    failed.append((call, e))
            outbox.popleft()
            self._queued_seqs.discard(call.seq)
        return failed

    def _wake_sender(self) -> None:
        """(order held) Start the sender thread, or tell it a call waits for it."""
        if self._sender is None:
            self._sender = threading.Thread(target=_debug.counted_thread(self._send_large),
                                            name="mpx-sender", daemon=True)
            self._sender.start()
        else:
            self.queued_cv.notify()

    def _send_large(self) -> None:
        """The sender thread: write each queued call larger than the ring when it reaches
        the head, waiting for the readers part way (up to its deadline); then flush."""
        while True:
            with self.order:
                while self.held or not (self.outbox and not self.outbox[0][3]):  # (too large)
                    if self.registry.closed or self.registry.stopping:
                        return
                    self.queued_cv.wait()
                call, kind, parts, _ = self.outbox[0]
                self.writing_large = True
            try:
                if not call.done:
                    self._out.write(kind, parts, until_ns(call.deadline))
            except BaseException as e:
                self._unsent(call, e)  # (still queued: a timeout says so)
            finally:
                with self.order:
                    self.writing_large = False
                    self.queued_cv.notify_all()  # (a regroup may wait for this write)
                    self.outbox.popleft()
                    self._queued_seqs.discard(call.seq)
            self.flush()

    def _unsent(self, call: Call, error: BaseException) -> None:
        """A queued call could not be written: it fails alone (its deadline passed, it
        could not be sent), or with the table (shutdown, a dead worker)."""
        if isinstance(error, QueueTimeout):
            if not call.done:
                self.registry.expire(call, time.monotonic())
        else:
            self.registry.settle(call, error=self._send_error(error, call.method))
        self.registry.after_reading()

    def stop_sending(self) -> None:
        """Shutdown or failure (the queued calls were settled): the sender thread ends, its
        write in progress cancelled (which shuts the broadcast writer down)."""
        with self.order:
            sender = self._sender
            self.queued_cv.notify_all()
            writing = self.writing_large
        if sender is None:
            return
        if writing:
            self._out.shutdown()
        if sender is not threading.current_thread():
            sender.join(5)
