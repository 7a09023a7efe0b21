# cython: language_level=3, boundscheck=False, wraparound=False, annotation_typing=False, binding=False
"""The calls in flight: ``Call``, one call's record of its replies and, once done, its
outcome; ``in_turn``, ``record_each`` and ``settle_ok``, which record and settle a batch of
replies; and ``Ledger``, the call table's calls in flight with their counters, whose hot
changes take the table's lock in C.

One source, two builds (Cython's pure-Python mode): setup.py compiles this file, with the C
types of mpx/_driver/ledger.pxd, into the extension ``mpx._driver.ledger``; without a
compiler, and under MPX_PURE_PYTHON=1, it runs as plain Python (mpx/_impl.py chooses).
It imports no mpx module outside the futures core: what it must know of the wire (the OK
and ERR statuses) each Call is given (``CoreSettings``, mpx/_driver/core_settings.py).

It only records: the reply pump (mpx/_driver/pump.py) reads and decodes the replies, and
hands each to ``Call.take`` or, through the call registry (mpx/_driver/registry.py), to
``record_each``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

try:
    import cython
except ImportError:  # Cython is a build dependency only: plain Python needs cython.compiled
    from mpx.mechanism import _cython_shim as cython  # type: ignore[no-redef]

if cython.compiled:
    from cython.cimports.mpx._driver.core_settings import CoreSettings
    from cython.cimports.mpx._driver.meter import Meter
    from cython.cimports.mpx._driver.primitives import lock_enter, lock_exit, new_lock, now
else:
    from mpx._driver.core_settings import CoreSettings
    from mpx._driver.meter import Meter
    from mpx._driver.primitives import lock_enter, lock_exit, new_lock, now

IMPLEMENTATION = "cython" if cython.compiled else "python"

# What Call.take and Call.add return (the _-named copies are C ints where compiled).
MORE = _MORE = 0          # ranks are still missing
ALL_OK = _ALL_OK = 1      # every rank answered OK and no aggregator runs: ok_value() is it
ANSWERED = _ANSWERED = 2  # every rank answered, some with an error, or an aggregator runs
LEAVE = _LEAVE = 3        # (take) not a reply this call can take in turn: the table's


class Call:
    """One call in flight: the replies gathered so far and, once done, its outcome. The
    call table changes it holding its locks (``take`` and ``add`` only in the thread that
    reads replies); ``future`` is set for a non-blocking call. ``settings``: its
    executor's (the wire's reply statuses)."""

    __slots__ = ("seq", "method", "n_ranks", "reply_rank", "aggregator", "deadline",
                 "settings", "started", "first_reply", "last_reply", "meter", "future",
                 "results", "errors", "done", "value", "error")

    def __init__(self, seq: int, method: str, n_ranks: int, reply_rank: int | None,
                 aggregator: Callable[[list], Any] | None, deadline: float | None,
                 settings: CoreSettings) -> None:
        self.seq = seq
        self.method = method
        self.n_ranks = n_ranks
        self.reply_rank = reply_rank
        self.aggregator = aggregator
        self.deadline = deadline
        self.settings = settings
        self.started = now()
        self.first_reply = 0.0  # when its first and last replies were read (0.0: not yet;
        self.last_reply = 0.0   # the meter's)
        self.meter: Meter | None = None  # (set by the ledger that registers it)
        self.future: Any = None
        self.results: dict[int, Any] = {}
        self.errors: dict[int, Any] = {}
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def take(self, rank: int, reply: Any, next_reply: list[int]) -> int:
        """Record ``reply``, just read from ``rank``, if it is this call's reply and the one
        that rank owes next (``in_turn``): then it returns MORE, ALL_OK or ANSWERED, as
        ``add``. Anything else (a stall report, an older call's reply, one that follows a
        gap in ``next_reply[rank]``, an undecodable one's stand-in) is left as it is, to the
        call table: LEAVE."""
        if type(reply) is not tuple or len(reply) != 3 or reply[0] != self.seq or \
                in_turn(reply, rank, next_reply, self.settings) is None:
            return _LEAVE
        return self.add(rank, reply[1] is self.settings.ok, reply[2])

    def add(self, rank: int, ok: bool, payload: Any) -> int:
        """Record ``rank``'s reply (its result if ``ok``, else its error payload): MORE,
        ALL_OK or ANSWERED."""
        if ok:
            self.results[rank] = payload
        else:
            self.errors[rank] = payload
        replied = len(self.results) + len(self.errors)
        meter = self.meter
        if meter is not None:
            at = meter.reply(rank, self.started, self.first_reply, replied == self.n_ranks)
            if self.first_reply == 0.0:
                self.first_reply = at
            if replied == self.n_ranks:
                self.last_reply = at
        if len(self.results) == self.n_ranks and self.aggregator is None:
            return _ALL_OK
        if replied == self.n_ranks:
            return _ANSWERED
        return _MORE

    def resize(self, n_ranks: int) -> None:
        """The group was resized before this call went out: it waits for ``n_ranks``
        replies (no rank has replied yet)."""
        self.n_ranks = n_ranks

    def ok_value(self) -> Any:
        """The outcome of a call every rank answered OK: the list of results in rank
        order, or the result of ``reply_rank``."""
        results = self.results
        if self.reply_rank is not None:
            return results[self.reply_rank]
        return [results[r] for r in range(self.n_ranks)]

    def missing(self) -> list[int]:
        """The ranks that have not answered yet."""
        return [r for r in range(self.n_ranks) if r not in self.results and r not in self.errors]

    def first_missing(self) -> int:
        """The lowest rank that has not answered yet (the call is not done)."""
        if not self.results and not self.errors:
            return 0
        for r in range(self.n_ranks):
            if r not in self.results and r not in self.errors:
                return r
        raise AssertionError(f"call {self.seq} has every reply but is not done")

    def outcome(self) -> Any:
        """The result of a done call, or raise its error."""
        if self.error is not None:
            raise self.error
        return self.value


def in_turn(reply: Any, rank: Any, next_reply: list[int], settings: CoreSettings) -> Any:
    """The one test a reply passes to be recorded, and the one advance of its rank's
    position: every reply is recorded through here (``Call.take``, ``record_each``, and
    through the latter the call table's ``CallRegistry.record``). ``reply`` is a call's
    reply, a ``(seq, OK or ERR, payload)`` tuple (the statuses of ``settings``), and the one
    ``rank`` owes next (``next_reply[rank] == seq``): ``next_reply[rank]`` becomes ``seq +
    1`` and the seq is returned. Else None, and nothing changes: a stall report, a reply
    after a gap or an undecodable one's stand-in is the call table's to record first."""
    if type(reply) is not tuple or len(reply) != 3:
        return None
    seq = reply[0]
    status = reply[1]
    if not (status is settings.ok or status is settings.err) or next_reply[rank] != seq:
        return None
    next_reply[rank] = seq + 1
    return seq


def record_each(replies: list, start: int, rank: int, next_reply: list[int],
                pending: dict[int, Call], answered: list[Call], settings: CoreSettings) -> int:
    """Record ``rank``'s replies ``replies[start:]`` in order: each one in turn
    (``in_turn``) is added to its call in ``pending`` (by seq; a call no longer pending,
    one that timed out, drops it), and every call that is then answered by every rank is
    appended to ``answered``. Stops at the first reply not in turn (a stall report, one
    after a gap, an undecodable one's stand-in: the call table's ``record`` takes it) and
    returns its index, or ``len(replies)``."""
    n = len(replies)
    for i in range(start, n):
        reply = replies[i]
        seq = in_turn(reply, rank, next_reply, settings)
        if seq is None:
            return i
        call = pending.get(seq)
        if call is not None and call.add(rank, reply[1] is settings.ok, reply[2]) != _MORE:
            answered.append(call)
    return n


def settle_ok(calls: list[Call], start: int, pending: dict[int, Call],
              completed: Any, meter: Meter | None = None) -> tuple[int, int, int]:
    """With the call table's lock held: settle ``calls[start:]`` (every rank answered
    each) in order, as the table's ``_settle`` does, until one needs the table's
    ``_finish`` (an error, an aggregator). Each call not already done (a timeout may have
    settled it) leaves ``pending``, gets ``ok_value()`` and is done; one with a future is
    appended to the deque ``completed``; ``meter``, if given, records each one's outcome.
    Returns ``(index where it stopped, how many of those settled had a deadline, how many
    had a future)``."""
    n = len(calls)
    with_deadline = futures = 0
    for i in range(start, n):
        call = calls[i]
        if call.done:
            continue
        if call.errors or call.aggregator is not None:
            return (i, with_deadline, futures)
        del pending[call.seq]
        if call.deadline is not None:
            with_deadline += 1
        call.value = call.ok_value()
        if call.future is not None:
            futures += 1
            completed.append(call)
        call.done = True
        if meter is not None:
            meter.settled(call.method, None, call.started, call.last_reply)
    return (n, with_deadline, futures)


class Ledger:
    """The calls in flight of one call table (mpx/_driver/registry.py): ``pending``, by
    sequence number, oldest first; the counters derived from it, ``with_deadline`` and
    ``outstanding`` (pending calls with a deadline, with a future); ``completed``, a deque
    of the settled calls whose futures are still to set; ``open``, whether calls may
    still register. Every change holds ``lock`` (a ``CLock`` compiled, mpx/_driver/locks.py;
    a threading.Lock in plain Python). The hot ones are these methods, which take and
    release it with ``lock_enter``/``lock_exit`` (mpx/_driver/primitives.py: compiled, in C,
    with no Python between for an interrupt to land in); the table makes the others inside
    ``with ledger.lock``."""

    __slots__ = ("lock", "pending", "completed", "with_deadline", "outstanding", "open",
                 "meter")

    def __init__(self, meter: Meter | None = None) -> None:
        self.lock: Any = new_lock()
        self.pending: dict[int, Call] = {}
        self.completed: collections.deque[Call] = collections.deque()
        self.with_deadline = 0
        self.outstanding = 0
        self.open = True
        self.meter = meter  # (its outcomes and bytes are recorded here, under ``lock``)

    def register(self, call: Call, parts: tuple = ()) -> bool:
        """Enter ``call``, whose message is ``parts``, in ``pending``; False, and nothing
        done, once ``open`` is False."""
        lock_enter(self.lock)
        try:
            return self._register(call, parts)
        finally:
            lock_exit(self.lock)

    def _register(self, call: Call, parts: tuple) -> bool:
        if not self.open:
            return False
        if self.meter is not None:
            call.meter = self.meter
            self.meter.sent(parts)
        self.pending[call.seq] = call
        if call.deadline is not None:
            self.with_deadline += 1
        if call.future is not None:
            self.outstanding += 1
        return True

    def settle(self, call: Call, value: Any, error: BaseException | None) -> bool:
        """Give ``call`` its outcome: it leaves ``pending``, is done, and goes to
        ``completed`` if it has a future. False if it was already done."""
        lock_enter(self.lock)
        try:
            return self._settle(call, value, error)
        finally:
            lock_exit(self.lock)

    def _settle(self, call: Call, value: Any, error: BaseException | None) -> bool:
        if call.done:
            return False
        self.pending.pop(call.seq, None)
        if call.deadline is not None:
            self.with_deadline -= 1
        call.value = value
        call.error = error
        if call.future is not None:
            self.outstanding -= 1
            self.completed.append(call)
        call.done = True
        if self.meter is not None:
            self.meter.settled(call.method, error, call.started, call.last_reply)
        return True

    def forget(self, call: Call) -> None:
        """Unregister ``call``, never sent: it leaves ``pending`` and is done, with no
        outcome (nothing waits for it)."""
        lock_enter(self.lock)
        try:
            self._forget(call)
        finally:
            lock_exit(self.lock)

    def _forget(self, call: Call) -> None:
        if call.done or self.pending.pop(call.seq, None) is None:
            return
        call.done = True
        if call.deadline is not None:
            self.with_deadline -= 1
        if call.future is not None:
            self.outstanding -= 1

    def settle_ok(self, calls: list[Call], start: int) -> int:
        """Settle ``calls[start:]``, each answered OK by every rank, in order, until one
        needs the table's ``_finish`` (an error, an aggregator): its index, or
        ``len(calls)`` (module ``settle_ok``)."""
        lock_enter(self.lock)
        try:
            return self._settle_batch(calls, start)
        finally:
            lock_exit(self.lock)

    def _settle_batch(self, calls: list[Call], start: int) -> int:
        stop, with_deadline, futures = settle_ok(calls, start, self.pending, self.completed,
                                                 self.meter)
        self.with_deadline -= with_deadline
        self.outstanding -= futures
        return stop
