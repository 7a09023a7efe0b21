"""The registry of one executor's calls: every call in flight by sequence number, what
each rank has answered, and how each call ends (settled with its outcome, or expired).

Rules (see mpx/_driver/calls.py for the whole model):

- Every change to the registry's fields holds ``lock`` (a call is registered by the sender,
  mpx/_driver/sender.py, inside the section that numbers it). It is held for dict and
  counter updates only: never while reading or writing a queue, never while user code
  runs. The calls in flight and their counters are the ``ledger``'s
  (mpx/_driver/ledger.py), whose hot changes (register, settle, forget, a batch's
  settle_ok) take and release ``lock`` in C where compiled; the others are made here, in
  ``with lock``. ``ledger.open`` is False once ``stopping`` is set (``_stop``): no call
  registers after a failure or shutdown began.
- A call moves ``pending`` -> (``answered``, when every rank replied but its outcome needs
  user code: an aggregator, or an error to build) -> done. A done call's future is set by
  ``complete_futures`` outside the registry's lock; its done callbacks run on the callback
  thread, in the order the calls were settled: ``completing`` makes taking a batch of
  settled calls and queuing its callbacks one step, so that two threads completing at once
  (a caller after its send, the reader after its reads) cannot queue a later batch first.
  No user code runs under it.
- One path records a reply: the ledger's ``in_turn`` (a call's reply, the one its rank
  owes next, advances that rank) then ``Call.add``, reached from ``Call.take`` (the
  pump, for the call it waits for), ``record_each`` (a batch) and ``record`` (this
  registry's one entry for what the ledger leaves: a stall report, a reply after a gap, an
  undecodable one's stand-in; it accounts for those, then records as the ledger does).
- The futures core is told what it must know of the rest of mpx (the wire's OK and ERR,
  NotOwnerError, the event loops' deliveries) by ``settings``, one ``CoreSettings`` built
  here for the executor, which the sender gives each ``Call`` and ``RPCFuture`` it makes.
- The ledger's counters (``outstanding``, ``with_deadline``) are derived from ``pending``
  and can be rebuilt from it (``repair``), which an interrupt arriving mid-update relies on.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from mpx._driver import lockorder
from mpx._driver.callbacks import CallbackThread
from mpx._driver.core_settings import CoreSettings
from mpx._driver.future_core import complete_each
from mpx._driver.futures import loop_delivery
from mpx._driver.ledger import Call, Ledger, record_each
from mpx._driver.meter import Meter
from mpx._driver.stalls import StallDiagnosis
from mpx.errors import (
    ExecutorFailed,
    NotOwnerError,
    PeerDiedError,
    ReplyLostError,
    RPCError,
    RPCTimeoutError,
    WorkerStalledError,
)
from mpx.protocol.wire import ERR, OK, STALL


def _min(*limits: float | None) -> float | None:
    present = [t for t in limits if t is not None]
    return min(present) if present else None


class CallRegistry:
    """The calls in flight and their bookkeeping (see the module docstring)."""

    def __init__(self, n_ranks: int, stalls: StallDiagnosis,
                 on_peer_gone: Callable[[int, PeerDiedError], ExecutorFailed | None]) -> None:
        self.n_ranks = n_ranks
        self.stalls = stalls
        self.on_peer_gone = on_peer_gone
        # what the futures core is told: the statuses of a call's reply that it records, the
        # error of a future used outside its process, the event loops' deliveries
        self.settings = CoreSettings(OK, ERR, NotOwnerError.of, loop_delivery)
        # the calls in flight and their counters; its lock guards them and the end state
        # (and what they measure: mpx/_driver/stats.py reads it)
        self.meter = Meter(n_ranks, RPCTimeoutError)
        self.ledger = Ledger(self.meter)
        self.lock = self.ledger.lock
        # a call done, or the baton free: sleep on `turn` holding `turn_lock`, entered with
        # `with turn_lock` (a Condition's own __enter__ is Python: an interrupt can leave
        # its lock held, see mpx/_driver/pump.py)
        self.turn_lock = lockorder.lock("CallTable.turn_lock", lockorder.TURN)
        self.turn = threading.Condition(self.turn_lock)
        self.waiting = 0                    # threads sleeping on `turn` for their call
        self.pending: dict[int, Call] = self.ledger.pending  # sent or queued to send
        self.next_seq = 0
        self.next_reply = [0] * n_ranks     # per rank: the seq its next reply answers
        self.failure: ExecutorFailed | None = None
        self.stopping = False  # a failure or shutdown is under way: nobody takes the baton
        # the group is being re-formed (mpx/_driver/regroup.py): nobody takes the baton but
        # the thread that re-forms it; calls still register, and wait for it to end
        self.paused = False
        self.closed = False
        self.completed: collections.deque[Call] = self.ledger.completed  # futures to set
        self.completing = lockorder.lock("CallRegistry.completing", lockorder.COMPLETING)
        self.answered: collections.deque[Call] = collections.deque()   # outcomes to make
        # the seqs of the calls waiting in the driver, unsent (the sender's, under its
        # `order`: mpx/_driver/sender.py)
        self.queued: set[int] = set()
        self.callbacks = CallbackThread()

    # ------------------------------------------------------------------ registering

    def check_usable(self) -> None:
        """Raise the failure, or ExecutorFailed after shutdown."""
        if self.failure is not None:
            raise self.failure
        if self.closed or self.stopping:
            raise ExecutorFailed("the executor was shut down")

    def stop(self) -> None:
        """(holding ``lock``) A failure or shutdown is under way: nobody takes the baton,
        and no call registers, from now on."""
        self.stopping = True
        self.ledger.open = False

    def forget(self, call: Call) -> None:
        """Unregister a call that was never sent."""
        self.ledger.forget(call)

    def repair(self) -> None:
        """Make the registry consistent again after an interrupt (KeyboardInterrupt,
        SystemExit...) cut an update short: done calls leave ``pending``, calls every rank
        answered move on to ``answered``, and the counters are counted again."""
        with self.lock:
            for seq, call in list(self.pending.items()):
                if call.done:
                    del self.pending[seq]
                elif not call.missing():
                    del self.pending[seq]
                    if call not in self.answered:
                        self.answered.append(call)
            ledger = self.ledger
            ledger.with_deadline = sum(c.deadline is not None for c in self.pending.values()) + \
                sum(c.deadline is not None for c in self.answered if not c.done)
            ledger.outstanding = sum(c.future is not None for c in self.pending.values()) + \
                sum(c.future is not None for c in self.answered if not c.done)
        self.notify_waiters()

    # ------------------------------------------------------------------ recording replies

    def record(self, rank: int, seq: int, status: int, payload: Any) -> None:
        """Record one reply of ``rank`` (the thread holding the baton): the one entry for
        what the ledger's ``in_turn`` leaves to the table (a stall report, a reply after a
        gap, an undecodable one's stand-in). Once the gap is accounted for, the reply of a call is
        recorded as every one is (``record_each``, through ``in_turn``)."""
        if status == STALL:
            self.stalls.report(rank, payload, self.next_reply[rank])
            return
        if self.stalls.reports:
            self.stalls.answered(rank, seq)
        if seq != self.next_reply[rank]:
            self._replies_lost(rank, seq)
            self.next_reply[rank] = seq  # (the lost ones failed: this one is owed now)
        answered: list[Call] = []
        if not record_each([(seq, status, payload)], 0, rank, self.next_reply,
                           self.pending, answered, self.settings):
            self.next_reply[rank] = seq + 1  # (no status a worker sends: dropped)
        if answered:
            self.settle_answered(answered)

    def record_batch(self, rank: int, replies: list) -> None:
        """_record each of ``rank``'s ``replies`` in order; the replies of calls, while no
        stall is reported, in compiled loops (record_each, settle_ok)."""
        start, n = 0, len(replies)
        while start < n:
            if self.stalls.reports:  # (their bookkeeping is _record's, reply by reply)
                stop = start
            else:
                answered: list[Call] = []
                stop = record_each(replies, start, rank, self.next_reply, self.pending,
                                   answered, self.settings)
                if answered:
                    self.settle_answered(answered)
            if stop == n:
                return
            reply = replies[stop]
            if type(reply) is tuple:
                self.record(rank, *reply)
            else:
                self.record(rank, self.next_reply[rank], ERR, reply)  # undecodable
            start = stop + 1

    def settle_answered(self, calls: list[Call]) -> None:
        """Settle, in order, calls that every rank answered (as _record would)."""
        i, n = 0, len(calls)
        while i < n:
            i = self.ledger.settle_ok(calls, i)
            if i < n:
                self.answer(calls[i])
                i += 1
        if self.waiting:
            self.notify_waiters()

    def _replies_lost(self, rank: int, seq: int) -> None:
        """``rank`` answered ``seq`` while older calls still miss its reply: every rank
        answers every call in order, so those replies were read and lost (an interrupt
        came between the read and the record). Those calls fail; the others go on."""
        for lost in range(self.next_reply[rank], seq):
            call = self.pending.get(lost)
            if call is not None and rank in call.missing():
                self.settle(call, error=ReplyLostError(
                    f"collective_rpc {call.method!r}: the reply of rank {rank} was lost "
                    "(an interrupt came while the driver read it)", rank=rank))

    def answer(self, call: Call) -> None:
        """Every rank answered ``call``, but its outcome needs user code (an aggregator) or
        an error to build: it leaves ``pending`` for ``answered``, which ``finish_answered``
        ends outside the baton."""
        with self.lock:
            if self.pending.pop(call.seq, None) is not None:
                self.answered.append(call)

    # ------------------------------------------------------------------ settling

    def finish_answered(self) -> None:
        """Make the outcome of every answered call (aggregators run here, in this thread,
        outside every lock) and settle it. Whatever an aggregator raises, an interrupt
        (KeyboardInterrupt, SystemExit) too, is its own call's error: that call's caller
        gets it, and no other call is touched."""
        answered = self.answered
        while answered:
            try:
                call = answered.popleft()
            except IndexError:
                return  # another thread took the last one
            self._finish(call)

    def _finish(self, call: Call) -> None:
        if call.errors:
            ranks = sorted(call.errors)
            etype, msg, tb = call.errors[ranks[0]]
            self.settle(call, error=RPCError(ranks, etype, msg, tb, method=call.method))
        elif call.reply_rank is not None:
            self.settle(call, call.results[call.reply_rank])
        elif call.aggregator is None:
            self.settle(call, [call.results[r] for r in range(call.n_ranks)])
        else:
            try:
                value = call.aggregator([call.results[r] for r in range(call.n_ranks)])
            except BaseException as e:  # (KeyboardInterrupt too: its caller gets it)
                self.settle(call, error=e)
            else:
                self.settle(call, value)

    def settle(self, call: Call, value: Any = None, error: BaseException | None = None) -> None:
        if self.ledger.settle(call, value, error) and self.waiting:
            self.notify_waiters()

    def notify_waiters(self) -> None:
        with self.turn_lock:
            self.turn.notify_all()

    def complete_futures(self) -> None:
        """Set the futures of the settled calls, in order, and wake the event loops that
        await them (outside every lock); their done callbacks go to the callback thread."""
        due: list = []
        queued = True
        with self.completing:
            try:
                complete_each(self.completed, due)  # (hands the callbacks to `due`)
            finally:
                if due:
                    queued = self.callbacks.queue(due)
        if not queued:  # (closed)
            self.callbacks.run_here(due)

    def after_reading(self) -> None:
        """What a thread does once it has let go of the baton: the outcomes of the calls it
        answered (aggregators), then their futures."""
        try:
            if self.answered:
                self.finish_answered()
        finally:
            if self.completed:
                self.complete_futures()

    # ------------------------------------------------------------------ expiring

    def expire_due(self) -> None:
        if not self.ledger.with_deadline:
            return
        now = time.monotonic()
        for call in list(self.pending.values()):
            if call.deadline is not None and now >= call.deadline:
                self.expire(call, now)

    def expire(self, call: Call, now: float) -> None:
        missing = call.missing()
        if self.is_queued(call):
            message = (f"collective_rpc {call.method!r} timed out before every worker could "
                       f"take the call (after {now - call.started:.1f} s, still queued in "
                       "the driver: the broadcast ring stayed full)")
            self.settle(call, error=RPCTimeoutError(message, missing))
            return
        text, stalled = self.stalls.describe_missing(missing, call.started)
        message = (f"collective_rpc {call.method!r} timed out after {now - call.started:.1f} s; "
                   f"ranks {missing} have not answered: {text}")
        self.settle(call, error=WorkerStalledError(message, missing, stalled) if stalled else
                     RPCTimeoutError(message, missing))

    def is_queued(self, call: Call) -> bool:
        """Whether ``call`` waits in the driver, unsent (the sender's queue)."""
        return call.seq in self.queued

    def read_limit(self, wait_until: float | None) -> float | None:
        """The earliest of ``wait_until`` and the pending deadlines."""
        if not self.ledger.with_deadline:
            return wait_until
        return _min(wait_until, *[c.deadline for c in list(self.pending.values())
                                  if c.deadline is not None])

    def settle_all(self, err: BaseException) -> None:
        with self.lock:
            calls = list(self.pending.values())
        for call in calls:
            self.settle(call, error=err)
        self.notify_waiters()
