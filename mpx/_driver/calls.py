"""The call table and the reply pump of one executor.

Every call gets a sequence number, goes out once on the broadcast queue, and is answered by
every rank, in order, on that rank's response queue. One thread at a time reads replies: it
holds the *baton*. Whichever thread reads a reply completes the call it belongs to, so a
call's future completes when its replies arrive, whoever waits.

- A thread that waits for a call (a blocking ``collective_rpc``, ``future.result()``) takes
  the baton when it is free and reads the replies itself: the hot path has no hand-off.
  While another thread holds it, the waiter sleeps until its call is done or the baton is
  handed over.
- A background reader takes the baton only while non-blocking futures are outstanding and
  no thread waits: so callbacks, ``concurrent.futures.wait`` and asyncio work without
  anyone calling ``result()``. It hands the baton over as soon as a thread waits.
- Replies of a call that already timed out are dropped by sequence number.
- ``fail`` (a worker died) reads every reply already written, by every rank, before it
  fails the calls still missing one; ``close`` (shutdown) fails every pending call.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpx import _debug, serde, wire
from mpx._driver.futures import RPCFuture, complete_each
from mpx._driver.stalls import StallDiagnosis
from mpx._impl import future_core_module
from mpx.errors import (
    Cancelled,
    DeserializationError,
    ExecutorFailed,
    PeerDiedError,
    QueueTimeout,
    RPCError,
    RPCTimeoutError,
    WorkerStalledError,
)
from mpx.queue import MessageQueue, make_room
from mpx.wire import OK, STALL

_core = future_core_module()
if TYPE_CHECKING:
    from mpx._future_core import Call
else:
    # one call in flight: its replies so far and, once done, its outcome (C fields when
    # the extension is built)
    Call = _core.Call
_ALL_OK = _core.ALL_OK
_record_each, _settle_ok = _core.record_each, _core.settle_ok

logger = logging.getLogger("mpx")

# How long fail() waits for the thread reading replies to hand the baton over (its queue
# was woken), so that the replies already written are read first. Part of the 1 s bound on
# reporting a death.
FAIL_HANDOVER_S = 0.5
# While non-blocking calls with deadlines are pending, a reader waiting for one reply looks
# at the deadlines at least this often: a later one may have an earlier deadline, and
# nobody may wait for it. (A blocking call's own thread wakes at its deadline.) Each look
# costs a wake and a short poll: ~0.4% of a core at this period.
DEADLINE_POLL_S = 0.25
# How long the background reader leaves the reading to an event loop (renewed at each of
# the loop's reading steps): a loop whose thread is blocked elsewhere holds the replies of
# other threads' futures up no longer than this.
LOOP_LEASE_S = 0.005
# How long a sender whose broadcast ring is full, having read the replies there, waits for
# the next one before it looks at the ring again.
DRAIN_WAIT_S = 0.001


def _undecodable(e: DeserializationError) -> list:
    """The ERR payload that stands for a reply the driver could not unpickle (a list: a
    reply is a tuple)."""
    return ["DeserializationError", f"the driver could not unpickle the result: {e}", ""]


def _until_ns(until: float | None) -> int:
    """A time.monotonic() deadline as the transport ends take it (-1: none)."""
    return -1 if until is None else int(until * 1e9)


def _min(*limits: float | None) -> float | None:
    present = [t for t in limits if t is not None]
    return min(present) if present else None


class CallTable:
    """Sends calls and reads their replies (see the module docstring).

    ``stalls`` keeps the workers' stall reports; ``on_peer_gone(rank, error)`` is told when
    a reader finds that rank's response queue dead (a monitor then fails the group).
    """

    def __init__(self, n_ranks: int, stalls: StallDiagnosis,
                 on_peer_gone: Callable[[int, PeerDiedError], None]) -> None:
        self.n_ranks = n_ranks
        self.stalls = stalls
        self.on_peer_gone = on_peer_gone
        self.resp: list[MessageQueue] = []
        self.lock = threading.Lock()        # pending, the counters and the end state
        self.send_lock = threading.Lock()   # sequence numbers go out in order
        self.baton = threading.Lock()       # held by the one thread that reads replies
        self.turn = threading.Condition(threading.Lock())  # call done, or baton handed over
        self.reader_ident: int | None = None  # the baton holder (callbacks may call again)
        self.sender_ident: int | None = None  # the send_lock holder: it runs no callbacks
        self.waiting = 0                    # threads sleeping on `turn` for their call
        self.pending: dict[int, Call] = {}  # by seq, oldest first
        self.next_seq = 0
        self.next_reply = [0] * n_ranks     # per rank: the seq its next reply answers
        self.outstanding = 0                # pending non-blocking calls
        self.with_deadline = 0              # pending calls with a deadline
        self.failure: ExecutorFailed | None = None
        self.stopping = False  # a failure or shutdown is under way: nobody takes the baton
        self.closed = False
        self._completed: collections.deque[Call] = collections.deque()  # futures to set
        self._completing = threading.Lock()
        self._background: threading.Thread | None = None
        self.give_way = threading.Event()  # set: the background reader stops waiting
        # until when the background reader leaves the reading to event loops, which read
        # in their own thread while their awaited futures' replies keep coming (futures.py)
        self.loops_until = 0.0

    def attach(self, broadcast: MessageQueue, resp: list[MessageQueue]) -> None:
        """The broadcast queue and every rank's response queue, once all are up."""
        self.resp = resp
        out = broadcast.writing_end()  # (enqueue's work without its frame)
        self.wake_workers = out.wake_readers  # type: ignore[method-assign]
        self._write, self._has_room, self._local = out.write, out.has_room, out.shares_memory
        self._reads = [q.reading_end().read_into for q in resp]  # each rank's reply reader

    # ------------------------------------------------------------------ sending

    def check_usable(self) -> None:
        """Raise the failure, or ExecutorFailed after shutdown."""
        if self.failure is not None:
            raise self.failure
        if self.closed or self.stopping:
            raise ExecutorFailed("the executor was shut down")

    def wake_workers(self) -> None:
        """A call follows: workers asleep after idling start waking now (see
        MessageQueue.wake_readers); attach() binds the queue's method in this one's
        place."""

    def send(self, method: Any, name: str, args: tuple, kwargs: dict | None,
             reply_rank: int | None, aggregator: Callable | None, timeout: float | None,
             non_block: bool) -> Call:
        """Register and broadcast one call (``name`` is the method's for messages)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # (the hot locks are taken with acquire/release: half the cost of `with` here)
        self.send_lock.acquire()
        try:
            self.sender_ident = threading.get_ident()
            seq = self.next_seq
            call = Call(seq, name, self.n_ranks, reply_rank, aggregator, deadline)
            if non_block:
                call.future = RPCFuture(self, call)
            self.lock.acquire()
            try:
                if self.failure is not None or self.closed or self.stopping:
                    self.check_usable()
                self.pending[seq] = call
                if deadline is not None:
                    self.with_deadline += 1
                if non_block:
                    self.outstanding += 1
            finally:
                self.lock.release()
            try:
                self.wake_workers()  # (again: those that parked since, while it pickles)
                kind, parts = serde.encode(wire.call(seq, method, args, kwargs, reply_rank),
                                           self._local)
                until = _until_ns(deadline)
                if len(self.pending) > 1:  # (else the ring holds no call unread: no need)
                    make_room(self._has_room, parts, until, self.drain)
                self._write(kind, parts, until)
            except BaseException as e:
                self._forget(call)
                raise self._send_error(e, name) from e
            finally:
                self.sender_ident = None
            self.next_seq = seq + 1
        finally:
            self.send_lock.release()
        if self._completed:
            self._complete_futures()  # those a drain() settled while the ring was full
        # (first the cheap look at an event loop's lease: it reads for these futures, the
        # common case)
        if non_block and (self._background is None or not self.baton.locked() and
                          time.monotonic() >= self.loops_until and
                          self._background_may_read()):
            self._start_background()
        return call

    def _send_error(self, e: BaseException, name: str) -> BaseException:
        if isinstance(e, QueueTimeout):
            return RPCTimeoutError(f"collective_rpc {name!r} timed out before every worker "
                                   f"could take the call: {e}", list(range(self.n_ranks)))
        if isinstance(e, PeerDiedError) and e.rank is not None:
            self.on_peer_gone(e.rank, e)  # the monitor may not have seen it yet
        if isinstance(e, (PeerDiedError, Cancelled)):
            if self.failure is not None:
                return self.failure
            return ExecutorFailed(f"collective_rpc {name!r} could not be sent: {e}")
        return e

    def _forget(self, call: Call) -> None:
        """Unregister a call that was never sent."""
        with self.lock:
            if call.done:
                return
            call.done = True
            self.pending.pop(call.seq, None)
            self.with_deadline -= call.deadline is not None
            self.outstanding -= call.future is not None

    # ------------------------------------------------------------------ waiting

    def wait(self, call: Call, timeout: float | None = None) -> None:
        """Return once ``call`` is done: read replies while no other thread does, else
        sleep until the call is done or the baton is free. ``TimeoutError`` when
        ``timeout`` passes first (the call goes on); a call past its deadline fails with
        RPCTimeoutError (or WorkerStalledError)."""
        wait_until = None if timeout is None else time.monotonic() + timeout
        me = threading.get_ident()
        while not call.done:
            if not self.stopping:
                if self.reader_ident == me:
                    self._read_until(call, wait_until)  # a done callback waits on a call
                    continue
                if self.baton.acquire(False):
                    self.reader_ident = me
                    try:
                        self._read_until(call, wait_until)
                    finally:
                        self._hand_over()
                    continue
            self._wait_turn(call, wait_until)
        if self._completed:
            self._complete_futures()

    def _wait_turn(self, call: Call, wait_until: float | None) -> None:
        with self.turn:
            self.waiting += 1
            self.give_way.set()  # the background reader hands the baton over
            try:
                while not call.done and (self.stopping or self.baton.locked()):
                    limit = _min(wait_until, call.deadline)
                    left = None if limit is None else limit - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self.turn.wait(left)
            finally:
                self.waiting -= 1
                if not self.waiting and self.outstanding:
                    self.turn.notify_all()  # the background reader may read again
        if not call.done:
            self._check_time(call, wait_until)

    def _hand_over(self) -> None:
        """Release the baton; wake the threads that wait for it, the background reader too."""
        self.reader_ident = None
        self.baton.release()
        if self.waiting or self.outstanding and self._background_may_read():
            with self.turn:
                self.turn.notify_all()
        if self._completed:
            self._complete_futures()

    def _check_time(self, call: Call, wait_until: float | None) -> None:
        """Fail ``call`` if its deadline passed; TimeoutError if the wait's did."""
        now = time.monotonic()
        if call.deadline is not None and now >= call.deadline:
            self._expire(call, now)
        elif wait_until is not None and now >= wait_until:
            raise TimeoutError(f"result() timed out; call {call.method!r} is still running")

    # ------------------------------------------------------------------ reading (baton held)

    def _read_until(self, call: Call, wait_until: float | None) -> None:
        while not call.done and not self.stopping:
            if not self.with_deadline:
                until = wait_until
            elif len(self.pending) == 1:  # this call alone: its own deadline (inline: hot)
                d = call.deadline
                until = wait_until if d is None or wait_until is not None and wait_until < d \
                    else d
            else:
                until = self._read_limit(wait_until)
            try:
                if self.stalls.reports:  # (their bookkeeping is _record's, reply by reply)
                    self._read_one(call.first_missing(), until)
                else:
                    self._gather(call, until)
            except QueueTimeout:
                self._read_available()  # the stall reports of the other ranks
                self._expire_due()
                if not call.done:
                    self._check_time(call, wait_until)
            except PeerDiedError as e:
                self._peer_gone(e)
            except Cancelled:
                return  # fail() or close() is under way: they settle the call

    def _gather(self, call: Call, until: float | None) -> None:
        """Read ``call``'s replies in rank order until it is answered or a reply needs
        _record (a stall report, an older call's reply): what _read_one does reply by
        reply, in one compiled loop (Call.gather)."""
        try:
            answered, rank, reply = call.gather(self._reads, self.next_reply, _until_ns(until),
                                                serde.decode_lent)
        except DeserializationError as e:
            rank = call.first_missing()
            self._record(rank, self.next_reply[rank], wire.ERR, _undecodable(e))
        except PeerDiedError as e:
            e.rank = call.first_missing()
            raise
        else:
            if answered == _ALL_OK:
                self._settle(call, call.ok_value())
            elif answered:
                self._finish(call)
            else:
                seq, status, payload = reply
                self._record(rank, seq, status, payload)
        if self._completed:
            self._complete_futures()

    def _read_limit(self, wait_until: float | None) -> float | None:
        """The earliest of ``wait_until`` and the pending deadlines; while futures with
        deadlines are pending, a poll period at most."""
        if not self.with_deadline:
            return wait_until
        calls = list(self.pending.values())
        deadlines = [c.deadline for c in calls if c.deadline is not None]
        poll = any(c.future is not None and c.deadline is not None for c in calls)
        return _min(wait_until, *deadlines,
                    time.monotonic() + DEADLINE_POLL_S if poll else None)

    def _read_one(self, rank: int, until: float | None,
                  cancel: threading.Event | None = None, complete: bool = True) -> None:
        """Read and record rank's next reply, waiting until monotonic ``until`` at most
        (Cancelled once ``cancel`` is set); then, unless ``complete`` is False (the caller
        completes a batch), set the futures of the calls it settled."""
        try:
            seq, status, payload = self._reads[rank](_until_ns(until), cancel, False,
                                                     serde.decode_lent)
        except DeserializationError as e:
            seq, status, payload = self.next_reply[rank], wire.ERR, _undecodable(e)
        except PeerDiedError as e:
            e.rank = rank
            raise
        self._record(rank, seq, status, payload)
        if complete and self._completed:
            self._complete_futures()

    def _read_available(self) -> int:
        """Read every reply that is already there, a batch per rank, then set the futures
        of the calls they settled; how many."""
        got = 0
        try:
            for rank, q in enumerate(self.resp):
                replies = q.dequeue_ready(_undecodable)
                if replies:
                    self._record_batch(rank, replies)
                    got += len(replies)
        except PeerDiedError as e:
            e.rank = rank
            self._peer_gone(e)
        except Cancelled:
            pass
        finally:
            if self._completed:
                self._complete_futures()
        return got

    def _record_batch(self, rank: int, replies: list) -> None:
        """_record each of ``rank``'s ``replies`` in order; the replies of calls, while no
        stall is reported, in compiled loops (record_each, settle_ok)."""
        start, n = 0, len(replies)
        while start < n:
            if self.stalls.reports:  # (their bookkeeping is _record's, reply by reply)
                stop = start
            else:
                answered: list[Call] = []
                stop = _record_each(replies, start, rank, self.next_reply, self.pending,
                                    answered)
                if answered:
                    self._settle_answered(answered)
            if stop == n:
                return
            reply = replies[stop]
            if type(reply) is tuple:
                self._record(rank, *reply)
            else:
                self._record(rank, self.next_reply[rank], wire.ERR, reply)
            start = stop + 1

    def _settle_answered(self, calls: list[Call]) -> None:
        """Settle, in order, calls that every rank answered (as _record would)."""
        i, n = 0, len(calls)
        while i < n:
            self.lock.acquire()
            try:
                i, with_deadline, futures = _settle_ok(calls, i, self.pending, self._completed)
                self.with_deadline -= with_deadline
                self.outstanding -= futures
            finally:
                self.lock.release()
            if i < n:
                self._finish(calls[i])
                i += 1
        if self.waiting:
            with self.turn:
                self.turn.notify_all()

    def _peer_gone(self, e: PeerDiedError) -> None:
        with self.lock:
            self.stopping = True  # until the monitor fails the group, nobody reads
        assert e.rank is not None
        self.on_peer_gone(e.rank, e)

    def _record(self, rank: int, seq: int, status: int, payload: Any) -> None:
        if status == STALL:
            self.stalls.report(rank, payload, self.next_reply[rank])
            return
        if self.stalls.reports:
            self.stalls.answered(rank, seq)
        self.next_reply[rank] = seq + 1
        call = self.pending.get(seq)
        if call is None:
            return  # the reply of a call that already timed out
        answered = call.add(rank, status == OK, payload)
        if answered == _ALL_OK:
            self._settle(call, call.ok_value())
        elif answered:
            self._finish(call)

    def _finish(self, call: Call) -> None:
        """Settle a call every rank answered."""
        if call.errors:
            ranks = sorted(call.errors)
            etype, msg, tb = call.errors[ranks[0]]
            self._settle(call, error=RPCError(ranks, etype, msg, tb, method=call.method))
        elif call.reply_rank is not None:
            self._settle(call, call.results[call.reply_rank])
        elif call.aggregator is None:
            self._settle(call, [call.results[r] for r in range(call.n_ranks)])
        else:
            try:
                value = call.aggregator([call.results[r] for r in range(call.n_ranks)])
            except Exception as e:
                self._settle(call, error=e)
            else:
                self._settle(call, value)

    def _settle(self, call: Call, value: Any = None, error: BaseException | None = None) -> None:
        self.lock.acquire()
        try:
            if call.done:
                return
            self.pending.pop(call.seq, None)
            if call.deadline is not None:
                self.with_deadline -= 1
            call.value, call.error = value, error
            if call.future is not None:
                self.outstanding -= 1
                self._completed.append(call)
            call.done = True
        finally:
            self.lock.release()
        if self.waiting:
            with self.turn:
                self.turn.notify_all()

    def _complete_futures(self) -> None:
        """Set the futures of settled calls, in order, outside every lock (their done
        callbacks run here; not in a sender, which holds the send lock)."""
        if self.sender_ident == threading.get_ident():
            return
        while self._completed:
            if not self._completing.acquire(False):
                return  # another thread is setting them, these too
            try:
                complete_each(self._completed)
            finally:
                self._completing.release()

    def _expire_due(self) -> None:
        if not self.with_deadline:
            return
        now = time.monotonic()
        for call in list(self.pending.values()):
            if call.deadline is not None and now >= call.deadline:
                self._expire(call, now)

    def _expire(self, call: Call, now: float) -> None:
        missing = call.missing()
        text, stalled = self.stalls.describe_missing(missing, call.started)
        message = (f"collective_rpc {call.method!r} timed out after {now - call.started:.1f} s; "
                   f"ranks {missing} have not answered: {text}")
        self._settle(call, error=WorkerStalledError(message, missing, stalled) if stalled else
                     RPCTimeoutError(message, missing))

    # ------------------------------------------------------------------ other readers

    def _take_baton(self, timeout: float) -> bool:
        if self.reader_ident == threading.get_ident():
            return False
        if not self.baton.acquire(timeout=timeout):
            return False
        self.reader_ident = threading.get_ident()
        return True

    def read_available(self, timeout: float) -> None:
        """Read the replies already there (stall reports among them), unless another
        thread holds the baton for ``timeout`` seconds: it reads them then."""
        if self._take_baton(timeout):
            try:
                self._read_available()
            finally:
                self._hand_over()

    def drain(self) -> bool:
        """Called by a sender while the broadcast ring is full (the workers may be blocked
        on full response rings): when no other thread reads, read the replies, waiting
        up to DRAIN_WAIT_S for the next one, and look again (True). Else (False) the
        sender waits for room while the thread that holds the baton, or the background
        reader (never an event loop's lease), reads them."""
        me = threading.get_ident()
        mine = self.reader_ident == me
        if not mine and not self.baton.acquire(False):
            self.wake_background()
            return False
        if not mine:
            self.reader_ident = me
        if self.loops_until:
            # an event loop reads for its futures (its tasks are the usual senders here):
            # these reads keep its lease, or else, when its reading steps come further
            # apart than LOOP_LEASE_S (many tasks per loop iteration), the background
            # reader takes the baton between them, and the two threads trade it (and
            # the GIL) for every few replies
            self.loops_until = time.monotonic() + LOOP_LEASE_S
        try:
            if not self._read_available() and self.pending:
                oldest = next(iter(list(self.pending.values())), None)
                if oldest is not None and not oldest.done:
                    try:
                        self._read_one(oldest.first_missing(),
                                       time.monotonic() + DRAIN_WAIT_S)
                    except (QueueTimeout, Cancelled):
                        pass
                    except PeerDiedError as e:
                        self._peer_gone(e)
        finally:
            if not mine:
                self._hand_over()
        return True

    def _start_background(self) -> None:
        """Make sure the background reader runs while futures are outstanding."""
        if self._background is None:
            with self.lock:
                if self._background is None and not self.closed:
                    self._background = threading.Thread(
                        target=_debug.counted_thread(self._read_in_background),
                        name="mpx-reply-reader", daemon=True)
                    self._background.start()
                    return
        if self._background_may_read() and not self.baton.locked():
            with self.turn:
                self.turn.notify_all()

    def read_ready(self) -> int | None:
        """Read the replies already there, unless another thread holds the baton (None):
        how many were read. An event loop's reader calls this in the loop's thread."""
        if self.stopping or not self.baton.acquire(False):
            return None
        self.reader_ident = threading.get_ident()
        try:
            return self._read_available()
        finally:
            self._hand_over()

    def lease_to_loop(self) -> None:
        """An event loop reads the replies of its awaited futures (or will, at its next
        iteration): the background reader hands the baton over after the reply it is
        reading, and leaves the reading to the loop for LOOP_LEASE_S."""
        self.loops_until = time.monotonic() + LOOP_LEASE_S
        if not self.give_way.is_set():
            self.give_way.set()

    def wake_background(self) -> None:
        """The event loop found no reply: the background reader waits for the next."""
        self.loops_until = 0.0
        if self._background_may_read() and not self.baton.locked():
            with self.turn:
                self.turn.notify_all()

    def _background_may_read(self) -> bool:
        return bool(self.outstanding and not self.waiting and not self.stopping
                    and (not self.loops_until or time.monotonic() >= self.loops_until))

    def _read_in_background(self) -> None:
        while True:
            with self.turn:
                while not (self._background_may_read() and not self.baton.locked()):
                    if self.closed:
                        return
                    lease = self.loops_until - time.monotonic()
                    self.turn.wait(lease if lease > 0 else None)
            if not self._take_baton(0):
                continue
            self.give_way.clear()
            try:
                while self._background_may_read():
                    oldest = next(iter(list(self.pending.values())), None)
                    if oldest is None:
                        break
                    rank = oldest.first_missing()
                    oldest = None  # a parked reader keeps no call (nor its future) alive
                    try:
                        self._read_one(rank, self._read_limit(None), self.give_way)
                        self._read_available()  # those that came meanwhile, in one batch
                    except QueueTimeout:
                        self._read_available()
                        self._expire_due()
                    except PeerDiedError as e:
                        self._peer_gone(e)
                    except Cancelled:
                        break
            except Exception as e:  # a broken queue: fail rather than leave futures hanging
                logger.exception("mpx: the background reply reader failed")
                self.fail(ExecutorFailed(f"reading replies failed: {e!r}"))
                return
            finally:
                self._hand_over()

    # ------------------------------------------------------------------ ending

    def fail(self, err: ExecutorFailed) -> bool:
        """The group failed: read every reply already written, by every rank; the calls
        all ranks answered get their results, the others fail with ``err``. False if the
        table already failed or is shutting down."""
        with self.lock:
            if self.failure is not None or self.closed:
                return False
            self.failure = err
            self.stopping = True
        for q in self.resp:
            q.shutdown()  # wakes the reader; what was written can still be read
        mine = self._take_baton(FAIL_HANDOVER_S)
        try:
            if mine:
                for rank in range(len(self.resp)):
                    self._read_rest(rank)
        finally:
            self._settle_all(err)
            if mine:
                self._hand_over()
            self._complete_futures()
        return True

    def _read_rest(self, rank: int) -> None:
        """Read what ``rank`` wrote before its queue was shut down."""
        while True:
            try:
                self._read_one(rank, time.monotonic())
            except (QueueTimeout, Cancelled, PeerDiedError):
                return

    def close(self) -> None:
        """Shutdown: fail every pending call with ExecutorFailed, wake every reader and
        stop the background reader."""
        with self.lock:
            self.closed = self.stopping = True
            background, self._background = self._background, None
        self._settle_all(ExecutorFailed("the executor was shut down"))
        for q in self.resp:
            q.shutdown()
        with self.turn:
            self.turn.notify_all()
        self._complete_futures()
        if background is not None and background is not threading.current_thread():
            background.join(5)

    def _settle_all(self, err: BaseException) -> None:
        with self.lock:
            calls = list(self.pending.values())
        for call in calls:
            self._settle(call, error=err)
        with self.turn:
            self.turn.notify_all()
