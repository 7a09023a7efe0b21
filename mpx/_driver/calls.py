"""The call table of one executor: its calls go out in order, and their replies come back
to whichever thread reads them.

Who runs what::

    caller threads          collective_rpc -> Sender.send: number, encode, register, then
    (any number)            write (room now) or queue; a blocking call then waits:
                            ReplyPump.wait reads its own replies while no one else does
    (whoever reads)         also writes the queued calls, in order, as replies show room
    mpx-sender              writes a queued call larger than the whole ring
    mpx-reply-reader        reads replies while futures are outstanding and no caller
                            waits (an event loop reads its own in its thread, for a lease)
    mpx-callbacks           runs the futures' done callbacks, in completion order
    mpx monitor threads     fail the table when a worker dies, and run failure callbacks;
                            or fail the calls a dead rank did not answer (``lose``)
    mpx-restarter           pauses it while a rank restarts (mpx/_driver/regroup.py, which
                            a resize runs in its caller's thread)

The rules, which hold by construction:

1. User code (done callbacks, aggregators, failure callbacks, event-loop wake-ups) never
   runs while mpx holds a lock or the baton: readers only read and record; outcomes are
   made and futures set after the baton is let go; done callbacks run on mpx-callbacks.
2. ``collective_rpc(non_block=True)`` never waits for ring room: what does not fit is
   queued in the driver and sent in order as the workers make room (``pending_calls()``
   counts it).
3. No wait outlasts a deadline: a reader waits to the earliest one it knows, and a new
   call with an earlier one nudges it; a half-read message never extends a wait.
4. A timeout, a cancel or an interrupt never consumes part of a message (the transports
   keep a half-read one for the next read).
5. An interrupt (any BaseException) in the pump fails at most the call it was settling;
   the registry is repaired and the table stays usable.
6. While the group is re-formed (``pause`` to ``resume``) the thread re-forming it holds
   the baton, every new call is queued (it goes out on the new broadcast queue, in order),
   and no other thread reads; a call already sent that a dead rank did not answer fails
   with its WorkerDiedError when the death is found (``lose``), not when the restart
   ends, and the other ranks' replies to it are dropped.
7. A call is checked against, sized for and sent to one membership: ``send`` numbers it
   and checks its ``unique_reply_rank`` under ``order``, and ``regrouped`` swaps the
   membership under ``order`` too. Locks nest ``order`` -> ``lock`` (-> ``completing``),
   under the membership's (mpx/_driver/membership.py); the baton is never waited for
   while one of them is held.

The jobs live apart, in parts composed here, each with its own constructor: the registry,
the ledger of calls (``CallRegistry``, mpx/_driver/registry.py); the reply pump and the
background reader (``ReplyPump``, mpx/_driver/pump.py); the sender and its queue of unsent
calls (``Sender``, mpx/_driver/sender.py); and the callback thread
(mpx/_driver/callbacks.py). ``CallTable`` joins them, and does what spans them: failing,
pausing for a regroup, closing. The locks and their order: mpx/_driver/lockorder.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

from mpx._driver.pump import ReplyPump, until_ns
from mpx._driver.registry import CallRegistry
from mpx._driver.sender import PendingCalls, Sender
from mpx._driver.stalls import StallDiagnosis
from mpx.errors import Cancelled, ExecutorFailed, PeerDiedError, QueueTimeout
from mpx.queue import MessageQueue

__all__ = ["CallTable", "PendingCalls"]

# How long fail() waits for the thread reading replies to hand the baton over (its queue
# was woken), so that the replies already written are read first. Part of the 1 s bound on
# reporting a death.
FAIL_HANDOVER_S = 0.5
# How long fail() waits at most for the replies that were on their way when a worker died
# (over ZeroMQ: the rest of a worker's last reply; over shared memory nothing is on its
# way). A 16 MiB reply takes ~20 ms.
FAIL_DRAIN_S = 0.5


class CallTable:
    """Sends calls and reads their replies (see the module docstring), composed of three
    parts, each with one job: ``registry``, the ledger of calls (what each rank answered,
    how each call ends); ``pump``, reading replies (the baton, the background reader);
    ``sender``, numbering and sending calls, and the queue of unsent ones. This object
    joins them, and owns what spans them: failing, pausing for a regroup, closing.

    ``stalls`` keeps the workers' stall reports; ``on_peer_gone(rank, error)`` is told when
    a reader finds that rank's response queue dead (a monitor then fails the group).
    """

    def __init__(self, n_ranks: int, stalls: StallDiagnosis,
                 on_peer_gone: Callable[[int, PeerDiedError], ExecutorFailed | None]) -> None:
        self.registry = CallRegistry(n_ranks, stalls, on_peer_gone)
        self.pump = ReplyPump(self.registry, self.fail)
        self.sender = Sender(self.registry, self.pump)
        self.pump.attach_sender(self.sender)
        # (the parts' own objects, for the callers: the same ones, looked up once)
        self.pending, self.meter, self.lock = \
            self.registry.pending, self.registry.meter, self.registry.lock
        self.baton = self.pump.baton

    def attach(self, broadcast: MessageQueue, resp: list[MessageQueue]) -> None:
        """The broadcast queue and every rank's response queue, once all are up."""
        self.sender.use_broadcast(broadcast)
        self.pump.attach_replies(resp)

    # ------------------------------------------------------------------ for the executor

    @property
    def failure(self) -> ExecutorFailed | None:
        """The failure that ended the table, if it failed."""
        return self.registry.failure

    @property
    def closed(self) -> bool:
        return self.registry.closed

    @property
    def next_seq(self) -> int:
        return self.registry.next_seq

    @property
    def resp(self) -> list[MessageQueue]:
        return self.pump.resp

    def check_usable(self) -> None:
        """Raise the failure, or ExecutorFailed after shutdown."""
        self.registry.check_usable()

    def wake_workers(self) -> None:
        """See Sender.wake_workers."""
        self.sender.wake_workers()

    def pending_calls(self) -> PendingCalls:
        """Calls in flight and calls queued in the driver (see PendingCalls)."""
        return self.sender.pending_calls()

    def read_available(self, timeout: float) -> None:
        """See ReplyPump.read_available."""
        self.pump.read_available(timeout)

    def bytes_received(self) -> int:
        """See ReplyPump.bytes_received."""
        return self.pump.bytes_received()

    def fail(self, err: ExecutorFailed) -> bool:
        """The group failed: read every reply already written, by every rank; the calls
        all ranks answered get their results, the others fail with ``err``. False if the
        table already failed or is shutting down."""
        with self.registry.lock:
            if self.registry.failure is not None or self.registry.closed:
                return False
            self.registry.failure = err
            self.registry.stop()
        for q in self.pump.resp:
            q.shutdown()  # wakes the reader; what was written can still be read
        outer = self.pump.baton.held()  # (fail() from a reading thread: it hands over itself)
        try:
            if not outer and self.pump.baton.take(FAIL_HANDOVER_S):
                self._read_rest(time.monotonic() + FAIL_DRAIN_S)
        finally:
            self.registry.settle_all(err)
            if not outer and self.pump.baton.let_go():
                self.pump.handed_over()
            self.sender.stop_sending()
            self.registry.after_reading()
        return True

    def _read_rest(self, until: float) -> None:
        """Read what every rank wrote before its queue was shut down, waiting until
        ``until`` at most for what is still on its way (Reader.drain)."""
        for end in self.pump.ends:
            end.drain(until_ns(until))
        for rank in range(len(self.pump.resp)):
            while True:
                try:
                    self.pump.read_one(rank, until)
                except (QueueTimeout, Cancelled, PeerDiedError):
                    break

    # ------------------------------------------------------------------ re-forming the group

    def pause(self, timeout: float) -> bool:
        """The group is about to be re-formed (mpx/_driver/regroup.py): from now on every
        call is queued in the driver, and nobody but this thread reads replies. True once
        this thread holds the baton and no write is under way; False, with nothing paused,
        if the table failed or closed, or the readers did not let go within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self.registry.lock:
            if self.registry.failure is not None or self.registry.closed:
                return False
            self.registry.paused = True
        with self.sender.order:
            self.sender.held = True
            while self.sender.writing_large and time.monotonic() < deadline:
                self.sender.queued_cv.wait(max(0.0, deadline - time.monotonic()))
            writing = self.sender.writing_large
        self.pump.nudge_reader()
        if not writing and self.pump.baton.take(max(0.001, deadline - time.monotonic())):
            return True
        self.resume()
        return False

    def lose(self, rank: int, err: ExecutorFailed, current: Callable[[], bool],
             guard: Any) -> bool:
        """(the death watch) ``rank``'s process died and the rank will be restarted: new
        calls wait in the driver from now on (until the restart's ``resume``); what the
        rank wrote before it died is read, so the calls it answered keep their replies;
        the calls it did not answer fail with ``err``, and their futures complete now,
        not when the restart ends. (While a restart holds the baton past FAIL_HANDOVER_S,
        nothing is read first: a reply the rank wrote and nobody read yet is lost with it,
        and its call fails too; the bound on reporting the death comes first.) The table
        stays paused until the restart's ``resume`` (or ``unpause``): a reader that holds
        the baton lets go within one read, and none takes it meanwhile, so that this
        thread gets it.

        ``current()``, asked holding ``guard`` (the membership's lock, which a regroup
        holds to replace a process), says whether the process that died is still the
        rank's current one: a death found after a regroup replaced it (a restart of
        another rank that restarted this one too) loses nothing, and nothing is paused.
        Whether the death was the current process's."""
        reg = self.registry
        with guard:
            if not current():
                return False
            with reg.lock:
                if reg.failure is not None or reg.closed:
                    return False
                reg.paused = True  # (a regroup that replaces the process resumes it)
            self.hold_sending()
        self.pump.nudge_reader()
        try:
            if self.pump.baton.take(FAIL_HANDOVER_S) and current():
                self.drain_rank(rank)  # (holding the baton: no regroup replaces it now)
            with guard:
                if current():
                    self.fail_unanswered(rank, err)
        finally:
            if self.pump.baton.let_go():
                self.pump.handed_over()
        reg.after_reading()
        return True

    def unpause(self) -> None:
        """Undo ``lose`` when no restart follows it (a resize restarted the rank meanwhile,
        or it left the group): the held calls go out and the readers read again. Called
        holding the membership's ``regroup_lock``, so that no re-forming is under way."""
        with self.registry.lock:
            self.registry.paused = False
        self.release_sending()
        with self.pump.turn_lock:
            self.pump.turn.notify_all()

    def hold_sending(self) -> None:
        """Queue every call from now on, in the driver (a resize waits for the calls in
        flight meanwhile); ``release_sending`` or ``resume`` sends them."""
        with self.sender.order:
            self.sender.held = True

    def release_sending(self) -> None:
        """Undo ``hold_sending``: the queued calls go out."""
        with self.sender.order:
            self.sender.held = False
            self.sender.queued_cv.notify_all()
        self.sender.flush()

    def first_unsent(self) -> int:
        """The seq of the oldest call not sent yet (the next one made, if none waits)."""
        with self.sender.order:
            return self.sender.outbox[0][0].seq if self.sender.outbox else self.registry.next_seq

    def in_flight(self) -> int:
        """How many calls went out and are not settled (the queued ones not counted)."""
        return self.sender.pending_calls().in_flight

    def drain_rank(self, rank: int) -> None:
        """(paused) Read what ``rank``, whose process died, wrote before it died: the calls
        it answered keep its replies."""
        until = time.monotonic() + FAIL_DRAIN_S
        self.pump.ends[rank].drain(until_ns(until))
        while True:
            try:
                self.pump.read_one(rank, until)
            except (QueueTimeout, Cancelled, PeerDiedError):
                return

    def read_paused(self, skip: Collection[int] = ()) -> int:
        """(paused) Read the replies already there, of every rank but those in ``skip``
        (whose process is gone, its queue drained): a regroup waits on ranks that may be
        blocked writing replies into a full queue, which nobody else reads meanwhile. How
        many. (A rank found dead is reported: the monitor restarts it after this regroup.)"""
        return self.pump.read_all_ready(skip)

    def fail_unanswered(self, rank: int, err: ExecutorFailed) -> None:
        """(paused) The calls that went out and that ``rank`` did not answer fail with
        ``err``; the replies the other ranks still send them are dropped on arrival."""
        with self.registry.lock:
            calls = [c for c in self.registry.pending.values()
                     if not self.registry.is_queued(c) and rank in c.missing()]
        for call in calls:
            self.registry.settle(call, error=err)

    def regrouped(self, broadcast: MessageQueue, resp: list[MessageQueue]) -> None:
        """(paused) The group was re-formed: the calls go out on ``broadcast`` from now on,
        and each rank answers on ``resp[rank]``. A rank whose queue is new answers first the
        oldest call not sent yet; the queued calls wait for ``len(resp)`` replies."""
        n = len(resp)
        # one step under `order` (then `lock`): a call is numbered, checked and sized
        # against the old membership and queued, or against the new one, never half of each
        with self.sender.order, self.registry.lock:
            first = self.sender.outbox[0][0].seq if self.sender.outbox else self.registry.next_seq
            reports = self.registry.stalls.reports
            for rank in [r for r in reports if r >= n or resp[r] is not self.pump.resp[r]]:
                del reports[rank]  # (its process is gone: so is its stall)
            for rank, q in enumerate(resp):
                if rank >= len(self.pump.resp) or q is not self.pump.resp[rank]:
                    if rank < len(self.registry.next_reply):
                        self.registry.next_reply[rank] = first
                    else:
                        self.registry.next_reply.append(first)
            del self.registry.next_reply[n:]
            self.pump.gone_bytes += sum(end.bytes_read for rank, end in enumerate(self.pump.ends)
                                   if rank >= n or resp[rank] is not self.pump.resp[rank])
            self.registry.n_ranks = n
            self.registry.meter.resize(n)
            for call, _, _, _ in self.sender.outbox:
                call.resize(n)
            orphans = [call for call, _, _, _ in self.sender.outbox
                       if call.reply_rank is not None and call.reply_rank >= n]
            self.sender.use_broadcast(broadcast)
            self.pump.attach_replies(resp)
        for call in orphans:  # (settled, it is never sent)
            self.registry.settle(call, error=ValueError(
                f"collective_rpc {call.method!r}: unique_reply_rank {call.reply_rank} left the "
                f"group, which was resized to {n} ranks before the call went out"))

    def resume(self) -> None:
        """End the pause: the queued calls go out, in order, and the readers read again."""
        with self.sender.order:
            self.sender.held = False
            self.sender.queued_cv.notify_all()
        with self.registry.lock:
            self.registry.paused = False
        self.pump.baton.let_go()
        self.pump.handed_over()  # (flushes, and wakes whoever waits to read)
        with self.pump.turn_lock:
            self.pump.turn.notify_all()

    def close(self) -> None:
        """Shutdown: fail every pending call with ExecutorFailed, wake every reader, and
        stop the sender, the background reader and the callback thread."""
        with self.registry.lock:
            self.registry.closed = True
            self.registry.stop()
            background, self.pump.background = self.pump.background, None
        self.registry.settle_all(ExecutorFailed("the executor was shut down"))
        if self.pump.resp:
            self.sender.stop_sending()
        for q in self.pump.resp:
            q.shutdown()
        with self.pump.turn_lock:
            self.pump.turn.notify_all()
        try:
            self.registry.after_reading()
        finally:
            if background is not None:
                background.join(5)
            self.registry.callbacks.close()

