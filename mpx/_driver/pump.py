"""The reply pump: whoever reads replies reads them through it, holding the *baton*.

Rules (see mpx/_driver/calls.py for the whole model):

- One thread at a time holds the baton and reads. While it holds it, it only reads and
  records (mpx/_driver/registry.py); it runs no user code. The pump does the reading (the
  transport's read, serde's decode) and hands each reply to a record: the call's own
  (``Call.take``, mpx/_driver/ledger.py) or the registry's; the records never read.
  Once it lets go (``Baton.let_go``, then ``handed_over``) it makes the outcomes of what it answered and sets
  their futures (``after_reading``).
- A thread that waits for its call (a blocking ``collective_rpc``, ``future.result()``)
  takes the baton when it is free and reads its replies itself: the hot path has no
  hand-off. While another thread holds the baton, it sleeps on ``turn`` until its call is
  done, its deadline passes, or the baton is free.
- The background reader takes the baton only while non-blocking calls are outstanding and
  no thread waits and no event loop holds the lease; it gives way at once (its read is
  nudged) when a thread starts to wait.
- A reader waits no longer than the earliest deadline it knows. It publishes that limit
  (``reading_until``) before it computes it; a sender whose new call has an earlier
  deadline nudges the reading ends, and the wait ends (WaitNudged) to be computed again.
- An interrupt (any BaseException) that escapes a read leaves the registry repaired
  (``repair``) and the baton released: it is taken inside the ``try`` and let go first
  thing in its ``finally`` (``Baton``, mpx/_driver/locks.py, says why); a wake-up
  an interrupt cut short is made up by the waiters' recheck (TURN_RECHECK_S).
- Locks are entered with ``with`` on the lock itself (never ``acquire()`` before a
  ``try``, nor a Condition's ``with``, whose ``__enter__`` is Python): an interrupt can
  land between any two calls, never inside ``with lock``'s entry.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from mpx import _debug
from mpx._driver.ledger import ALL_OK, ANSWERED, MORE  # (Call.take's)
from mpx._driver.locks import Baton
from mpx._driver.registry import Call, CallRegistry
from mpx.errors import Cancelled, DeserializationError, ExecutorFailed, PeerDiedError, QueueTimeout
from mpx.protocol import wire
from mpx.queue import MessageQueue
from mpx.transport.base import added_link_counts

if TYPE_CHECKING:
    from mpx._driver.sender import Sender
    from mpx.transport.base import Reader

logger = logging.getLogger("mpx")


# How long the background reader leaves the reading to an event loop (renewed at each of
# the loop's reading steps): a loop whose thread is blocked elsewhere holds the replies of
# other threads' futures up no longer than this.
LOOP_LEASE_S = 0.005
# How long an event loop's reading step waits for the next reply when none is there but
# calls are in flight: a round trip here takes ~10 us, and handing the reading to the
# background reader costs two thread wake-ups (~50 us each on this VM) per batch. Short
# enough that the loop's other callbacks never notice.
LOOP_READ_WAIT_S = 50e-6
# reading_until while a reader computes its limit: any sender with a deadline nudges.
_COMPUTING = -1.0
# How often a thread sleeping on `turn` (for its call, or the background reader with
# futures outstanding) looks again although nobody woke it: an interrupt can cut a hand-over
# short before its wake-up (see Baton in mpx/_driver/locks.py).
TURN_RECHECK_S = 0.1
# While calls wait in the sender's queue (the broadcast ring is full), a reader waiting on
# one rank looks at every rank this often: a worker blocked on its full response ring
# takes no calls, so its replies must be read for the ring to make room.
QUEUED_SLICE_S = 0.005


def _undecodable(e: DeserializationError) -> list:
    """The ERR payload that stands for a reply the driver could not unpickle (a list: a
    reply is a tuple)."""
    return [type(e).__name__, f"the driver could not unpickle the result: {e}", ""]


def until_ns(until: float | None) -> int:
    """A time.monotonic() deadline as the transport ends take it (-1: none)."""
    return -1 if until is None else int(until * 1e9)


class ReplyPump:
    """Reads replies into ``registry`` (see the module docstring). ``fail(error)`` fails
    the call table (the background reader's queue broke); the sender whose queued calls
    the readers flush as replies show room is given by ``attach_sender``."""

    def __init__(self, registry: CallRegistry, fail: Callable[[ExecutorFailed], Any]) -> None:
        self.registry = registry
        self._fail = fail
        # (the registry's containers, the same objects: the hot paths look them up once)
        self.ledger, self.pending, self.next_reply = \
            registry.ledger, registry.pending, registry.next_reply
        self.turn, self.turn_lock, self.stalls = registry.turn, registry.turn_lock, registry.stalls
        self.resp: list[MessageQueue] = []
        self.baton = Baton()                 # held by the one thread that reads replies
        self.reading_until: float | None = None  # the holder's read limit (see above)
        self.background: threading.Thread | None = None
        self._background_reads = False       # the background reader holds the baton
        self._background_idle = False        # it sleeps on `turn` with no time limit
        # until when the background reader leaves the reading to event loops, which read
        # in their own thread while their awaited futures' replies keep coming (futures.py)
        self.loops_until = 0.0
        self.ends: list[Reader] = []  # each rank's reply channel (its queue's reading end)
        self.gone_bytes = 0  # what the reply channels of processes that are gone read
        self.sender: Sender | None = None
        # the sender's queue (sender.py): while calls wait in it, waits are sliced and the
        # readers flush it as replies show room
        self._outbox: collections.deque[tuple[Call, int, tuple, bool]] = collections.deque()

    def attach_sender(self, sender: Sender) -> None:
        """The sender whose queue (``outbox``) the readers flush as replies come in: each
        reply means its rank has taken a call, so the ring has room again."""
        self.sender = sender
        self._outbox = sender.outbox

    def flush(self) -> None:
        assert self.sender is not None
        self.sender.flush()

    def attach_replies(self, resp: list[MessageQueue]) -> None:
        self.resp = resp
        self.ends = [q.reading_end() for q in resp]

    def bytes_received(self) -> int:
        """The bytes of every reply read so far, all ranks together (those of processes
        that are gone too)."""
        return self.gone_bytes + sum([end.bytes_read for end in self.ends])

    def link_counts(self) -> tuple[int, int, int]:
        """The reply ends' Endpoint.link_counts, added up (those of live processes)."""
        return added_link_counts(self.ends)

    def nudge_reader(self) -> None:
        """End the wait of the thread that reads replies now (or its next wait), so that it
        looks at the deadlines and at who waits again."""
        for end in self.ends:
            end.nudge()

    def deadline_added(self, deadline: float) -> None:
        """A call with ``deadline`` was registered: shorten the reader's wait if it would
        outlast it."""
        if self.baton.locked():
            until = self.reading_until
            if until is None or until == _COMPUTING or deadline < until:
                self.nudge_reader()

    # ------------------------------------------------------------------ waiting

    def wait(self, call: Call, timeout: float | None = None) -> None:
        """Return once ``call`` is done: read replies while no other thread does, else
        sleep until the call is done or the baton is free. ``TimeoutError`` when
        ``timeout`` passes first (the call goes on); a call past its deadline fails with
        RPCTimeoutError (or WorkerStalledError)."""
        wait_until = None if timeout is None else time.monotonic() + timeout
        while not call.done:
            read = False
            if not (self.registry.stopping or self.registry.paused):
                try:
                    read = self.baton.take()
                    if read:
                        self._read_until(call, wait_until)
                finally:
                    if self.baton.let_go():
                        self.handed_over()
                if read and (call.done or call.seq in self.pending):
                    continue
            # another thread reads, or makes the outcome of this answered call
            self._wait_turn(call, wait_until)

    def _wait_turn(self, call: Call, wait_until: float | None) -> None:
        with self.turn_lock:
            self.registry.waiting += 1
            if self._background_reads:
                self.nudge_reader()  # the background reader hands the baton over
            try:
                while not call.done and (self.registry.stopping or self.registry.paused or self.baton.locked()
                                         or call.seq not in self.pending):
                    limit = wait_until if call.deadline is None or wait_until is not None \
                        and wait_until < call.deadline else call.deadline
                    left = None if limit is None else limit - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self.turn.wait(TURN_RECHECK_S if left is None or left > TURN_RECHECK_S
                                   else left)
            finally:
                self.registry.waiting -= 1
                if not self.registry.waiting and self.ledger.outstanding:
                    self.turn.notify_all()  # the background reader may read again
        if not call.done:
            self._check_time(call, wait_until)

    def handed_over(self) -> None:
        """After letting go of the baton (``baton.let_go()``, called in the ``finally``
        itself, see Baton): wake the threads that wait for it (the background reader too),
        then do what reading left to do (after_reading). An interrupt may cut this short:
        the waiters look again every TURN_RECHECK_S."""
        try:
            if self.registry.waiting:
                with self.turn_lock:
                    self.turn.notify_all()
            elif self.ledger.outstanding:
                self._wake_background_reader()
        finally:
            if self._outbox:
                self.flush()
            if self.registry.answered or self.registry.completed:
                self.registry.after_reading()

    @staticmethod
    def _queued_slice(until: float | None) -> float:
        """``until``, or sooner: QUEUED_SLICE_S from now (calls are queued)."""
        soon = time.monotonic() + QUEUED_SLICE_S
        return soon if until is None or soon < until else until

    def _check_time(self, call: Call, wait_until: float | None) -> None:
        """Fail ``call`` if its deadline passed; TimeoutError if the wait's did."""
        now = time.monotonic()
        if call.deadline is not None and now >= call.deadline:
            self.registry.expire(call, now)
        elif wait_until is not None and now >= wait_until:
            raise TimeoutError(f"result() timed out; call {call.method!r} is still running")

    # ------------------------------------------------------------------ reading (baton held)

    def _read_until(self, call: Call, wait_until: float | None) -> None:
        reg = self.registry
        try:
            while not (reg.stopping or reg.paused) and call.seq in self.pending:  # (answered: no)
                self.reading_until = _COMPUTING
                if not self.ledger.with_deadline:
                    until = wait_until
                elif len(self.pending) == 1:  # this call alone: its own deadline (hot)
                    d = call.deadline
                    until = wait_until if d is None or wait_until is not None and \
                        wait_until < d else d
                else:
                    until = self.registry.read_limit(wait_until)
                if self._outbox:
                    until = self._queued_slice(until)
                self.reading_until = until
                try:
                    if self.stalls.reports:  # (their bookkeeping is _record's, reply by reply)
                        self.read_one(call.first_missing(), until)
                    else:
                        self._gather(call, until)
                    if self._outbox:
                        self.flush()
                except QueueTimeout:  # (WaitNudged too: a new deadline, look again)
                    self.read_all_ready()  # the stall reports of the other ranks
                    if self._outbox:
                        self.flush()
                    self.registry.expire_due()
                    if not call.done and call.seq in self.pending:
                        self._check_time(call, wait_until)
                except PeerDiedError as e:
                    self._peer_gone(e)
                except Cancelled:
                    return  # fail() or close() is under way: they settle the call
                if call.done:
                    return
        except BaseException:
            self.registry.repair()
            raise

    def _gather(self, call: Call, until: float | None) -> None:
        """Read ``call``'s replies in rank order, until it is answered or a reply needs
        _record (a stall report, an older call's reply, one after a gap): what read_one
        does reply by reply, with ``call.take`` recording each reply of this call."""
        ends, next_reply = self.ends, self.next_reply
        deadline_ns = until_ns(until)
        rank = call.first_missing()
        while True:
            try:
                reply = ends[rank].recv(deadline_ns)
            except DeserializationError as e:
                self.registry.record(rank, next_reply[rank], wire.ERR, _undecodable(e))
                return
            except PeerDiedError as e:
                e.rank = rank
                raise
            answered = call.take(rank, reply, next_reply)
            if answered == ALL_OK:
                self.registry.settle(call, call.ok_value())
            elif answered == MORE:
                rank = call.first_missing()
                continue
            elif answered == ANSWERED:
                self.registry.answer(call)
            else:  # (LEAVE) not this call's next reply: the table records it
                seq, status, payload = reply
                self.registry.record(rank, seq, status, payload)
            return

    def read_one(self, rank: int, until: float | None) -> None:
        """Read and record rank's next reply, waiting until monotonic ``until`` at most."""
        try:
            seq, status, payload = self.ends[rank].recv(until_ns(until))
        except DeserializationError as e:
            seq, status, payload = self.next_reply[rank], wire.ERR, _undecodable(e)
        except PeerDiedError as e:
            e.rank = rank
            raise
        self.registry.record(rank, seq, status, payload)

    def read_all_ready(self, skip: Collection[int] = ()) -> int:
        """Read every reply that is already there, a batch per rank (but the ranks in
        ``skip``); how many."""
        got = 0
        for rank, end in enumerate(self.ends):
            if skip and rank in skip:
                continue
            try:
                replies = end.recv_ready(_undecodable)
            except PeerDiedError as e:
                e.rank = rank
                self._peer_gone(e)
                continue
            except Cancelled:
                continue
            if replies:
                self.registry.record_batch(rank, replies)
                got += len(replies)
        return got

    def _peer_gone(self, e: PeerDiedError) -> None:
        with self.registry.lock:
            self.registry.paused = True  # until the monitor fails the group or restarts the rank
        assert e.rank is not None
        self.registry.on_peer_gone(e.rank, e)

    # ------------------------------------------------------------------ other readers

    def read_available(self, timeout: float) -> None:
        """Read the replies already there (stall reports among them), unless another
        thread holds the baton for ``timeout`` seconds: it reads them then."""
        try:
            if self.baton.take(timeout):
                self.read_all_ready()
        except BaseException:
            if self.baton.held():
                self.registry.repair()
            raise
        finally:
            if self.baton.let_go():
                self.handed_over()

    def read_ready(self, wait_s: float = LOOP_READ_WAIT_S) -> int | None:
        """Read the replies already there (or, with none there, the next within
        ``wait_s``), unless another thread holds the baton (None): how many were read. An
        event loop's reader calls this in the loop's thread; a sender whose call was
        queued, with ``wait_s=0``."""
        if self.registry.stopping or self.registry.paused:
            return None
        try:
            if not self.baton.take():
                return None
            got = self.read_all_ready()
            if not got and wait_s and self.pending:
                got = self._read_soon(wait_s)
            return got
        except BaseException:
            if self.baton.held():
                self.registry.repair()
            raise
        finally:
            if self.baton.let_go():
                self.handed_over()

    def _read_soon(self, wait_s: float) -> int:
        """(baton held) Wait ``wait_s`` at most for the oldest call's next reply, and take
        what came with it: how many replies."""
        oldest = next(iter(list(self.pending.values())), None)
        if oldest is None:
            return 0
        try:
            self.read_one(oldest.first_missing(), time.monotonic() + wait_s)
        except (QueueTimeout, Cancelled):
            return 0
        except PeerDiedError as e:
            self._peer_gone(e)
            return 0
        return 1 + self.read_all_ready()

    def lease_to_loop(self) -> None:
        """An event loop reads the replies of its awaited futures (or will, at its next
        iteration): the background reader hands the baton over after the reply it is
        reading, and leaves the reading to the loop for LOOP_LEASE_S."""
        self.loops_until = time.monotonic() + LOOP_LEASE_S
        if self._background_reads:
            self.nudge_reader()

    def wake_background(self) -> None:
        """The event loop found no reply: the background reader waits for the next."""
        self.loops_until = 0.0
        self._wake_background_reader()

    # ------------------------------------------------------------------ the background reader

    def read_for_futures(self) -> None:
        """A non-blocking call was sent: make sure its replies are read (by the background
        reader, unless an event loop reads them for a lease)."""
        # (first the cheap look at an event loop's lease: it reads for these futures, the
        # common case)
        if self.background is None or self._background_idle or \
                not self.baton.locked() and time.monotonic() >= self.loops_until and \
                self._background_may_read():
            self._start_background()

    def _start_background(self) -> None:
        """Make sure the background reader runs while futures are outstanding."""
        if self.background is None:
            with self.registry.lock:
                if self.background is None and not self.registry.closed:
                    self.background = threading.Thread(
                        target=_debug.counted_thread(self._read_in_background),
                        name="mpx-reply-reader", daemon=True)
                    self.background.start()
                    return
        self._wake_background_reader()

    def _wake_background_reader(self) -> None:
        """Wake the background reader if it may read now, or if it sleeps with no limit
        (it then looks again: a loop's lease it did not know of may have begun)."""
        if self._background_idle or self._background_may_read() and not self.baton.locked():
            with self.turn_lock:
                self.turn.notify_all()

    def _background_may_read(self) -> bool:
        return bool(self.ledger.outstanding and self.pending and not self.registry.waiting and
                    not self.registry.stopping and not self.registry.paused and
                    (not self.loops_until or time.monotonic() >= self.loops_until))

    def _read_in_background(self) -> None:
        while True:
            with self.turn_lock:
                while not (self._background_may_read() and not self.baton.locked()):
                    if self.registry.closed:
                        return
                    lease = self.loops_until - time.monotonic()
                    self._background_idle = lease <= 0
                    if lease <= 0 and self.ledger.outstanding:  # (a wake-up lost to an interrupt)
                        lease = TURN_RECHECK_S
                    self.turn.wait(lease if lease > 0 else None)
                self._background_idle = False
            if not self.baton.take():
                continue
            self._background_reads = True
            broken: Exception | None = None
            try:
                self._read_some()
            except Exception as e:  # a broken queue: fail rather than leave futures hanging
                logger.exception("the background reply reader failed")
                broken = e
            except BaseException:  # an interrupt: its call failed with it; read on
                self.registry.repair()
            finally:
                self._background_reads = False
                if self.baton.let_go():
                    self.handed_over()
            if broken is not None:
                self._fail(ExecutorFailed(f"reading replies failed: {broken!r}"))
                return

    def _read_some(self) -> None:
        """One turn of the background reader, baton held: wait for the oldest call's next
        reply (to the earliest deadline), then take what came meanwhile."""
        self.reading_until = _COMPUTING
        oldest = next(iter(list(self.pending.values())), None)
        if oldest is None or not self._background_may_read():
            return
        rank = oldest.first_missing()
        oldest = None  # a parked reader keeps no call (nor its future) alive
        until = self.registry.read_limit(None)
        if self._outbox:
            until = self._queued_slice(until)
        self.reading_until = until
        try:
            self.read_one(rank, until)
            self.read_all_ready()  # those that came meanwhile, in one batch
        except QueueTimeout:  # (WaitNudged too: someone waits, or a new deadline)
            self.read_all_ready()
            self.registry.expire_due()
        except PeerDiedError as e:
            self._peer_gone(e)
        except Cancelled:
            pass
