# cython: language_level=3, boundscheck=False, wraparound=False, annotation_typing=False, binding=False
"""The hot parts of the driver's calls: ``Call``, one call's record in the call table
(mpx/_driver/calls.py), with ``record_each`` and ``settle_ok``, which record and settle a
batch of replies; ``FutureCore``, the hot part of ``mpx.RPCFuture`` (see
mpx/_driver/futures.py): its state, completion and the hand-off to an awaiting asyncio
task, which waits on a ``Waiter`` woken in batches by ``LoopWakeups``; ``Baton``, the
right to read replies, which compiled an interrupt cannot leave held; and ``Ledger``, the
calls in flight with their counters, whose hot changes take the call table's lock in C
(both hold a ``CLock``).

One source, two builds (Cython's pure-Python mode): setup.py compiles this file, with the C
types of mpx/_driver/future_core.pxd, into the extension ``mpx._driver.future_core``;
without a compiler, and under MPX_PURE_PYTHON=1, it runs as it reads, as plain Python
(mpx/_impl.py chooses). It imports no other mpx module: what it must know of the wire (the
OK and ERR statuses) and of the driver's event loops is handed to it
(``configure_replies``, ``configure_loops``).

It only records: the reply pump (mpx/_driver/pump.py) reads and decodes the replies, and
hands each to ``Call.take`` or ``record_each``. The synchronisation is described in
``RPCFuture``'s comment: every state change of a future, and every read that must not
miss one, holds ``_lock`` (a ``CLock`` compiled, taken in C by the hot paths; a
``threading.Lock`` in plain Python), on which the Condition of the base class's waits is
built. (Once FINISHED, the awaiting tasks and loop callbacks are written
by ``_hand_off`` alone, which takes them without the lock.)

Completing a future is split so that the thread that reads replies runs no user code:
``complete_each`` (``_complete``, then ``_hand_off`` to the event loops) in that thread, and
``_run_callbacks`` (the done callbacks) in the executor's callback thread.
"""

from __future__ import annotations

import array
import asyncio
import bisect
import collections
import concurrent.futures
import contextvars
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

try:
    import cython
except ImportError:  # Cython is a build dependency only: plain Python needs cython.compiled
    from mpx.mechanism import _cython_shim as cython  # type: ignore[no-redef]

if cython.compiled:  # the C lock (CLock), the thread's ident, frexp
    from cython.cimports.cpython.exc import PyErr_CheckSignals
    from cython.cimports.libc.errno import EINTR, ETIMEDOUT, errno
    from cython.cimports.libc.math import frexp
    from cython.cimports.mpx._driver.future_core import (  # (its .pxd)
        PyThread_get_thread_ident,
        sem_clockwait,
        sem_destroy,
        sem_init,
        sem_post,
        sem_trywait,
        sem_wait,
    )
    from cython.cimports.posix.time import CLOCK_MONOTONIC, clock_gettime, timespec

IMPLEMENTATION = "cython" if cython.compiled else "python"

# What Call.take and Call.add return (the _-named copies are C ints where compiled).
MORE = _MORE = 0          # ranks are still missing
ALL_OK = _ALL_OK = 1      # every rank answered OK and no aggregator runs: ok_value() is it
ANSWERED = _ANSWERED = 2  # every rank answered, some with an error, or an aggregator runs
LEAVE = _LEAVE = 3        # (take) not a reply this call can take in turn: the table's

# concurrent.futures' states of a future, as its Future's own methods (wait, as_completed,
# result, repr) compare ``_state`` with them (equal strings, stable since Python 3.2): an
# RPCFuture is RUNNING from the start and FINISHED once its call is settled; it is never
# PENDING nor CANCELLED.
RUNNING = "RUNNING"
FINISHED = "FINISHED"
# concurrent.futures' logger (logging.getLogger("concurrent.futures")), which logs what a
# done callback raised
_LOGGER = logging.getLogger("concurrent.futures")
_InvalidStateError = concurrent.futures.InvalidStateError
_monotonic = time.monotonic
_copy_context = contextvars.copy_context
_get_ident = threading.get_ident
_Lock = threading.Lock
_NEVER = object()

# The wire's OK and ERR reply statuses (configure_replies). Until they are set, no reply is
# a call's: take and record_each leave every reply to the call table's own recording.
_OK: Any = _NEVER
_ERR: Any = _NEVER
# (configure_loops) the delivery of an event loop (mpx/_driver/futures.py), made on first use
_delivery_of: Any = None
# The delivery whose tasks LoopWakeups.run wakes now, in some thread: the likeliest loop
# of an RPCFuture awaited meanwhile (a hint: __await__ checks it with runs_here).
_waking: Any = None

# This process's pid, kept current across os.fork() by the hook below: a future serves only
# the process that made it, and each of its public entry points compares its owner with
# this, without a system call (glibc caches no pid).
_pid: int = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


# (configure_owner) the error of a future used outside its process: (what, owner, here)
_not_owner: Any = None


def configure_owner(error_of: Callable[[str, int, int], BaseException]) -> None:
    """Set the error ``_check_owner`` raises: ``error_of(what, owner_pid, this_pid)``."""
    global _not_owner
    _not_owner = error_of


def _now() -> float:
    """time.monotonic(), without the Python call where compiled."""
    if cython.compiled:
        ts = cython.declare(timespec)
        clock_gettime(CLOCK_MONOTONIC, cython.address(ts))
        return ts.tv_sec + ts.tv_nsec * 1e-9
    return _monotonic()


def _this_thread() -> int:
    """This thread's ident, as threading.get_ident() gives it."""
    return PyThread_get_thread_ident() if cython.compiled else _get_ident()


def configure_replies(ok: Any, err: Any) -> None:
    """The statuses of a call's reply that ``take`` and ``record_each`` record: OK (the
    payload is the result) and ERR (an error's ``(type name, message, traceback)``)."""
    global _OK, _ERR
    _OK, _ERR = ok, err


def configure_loops(delivery_of: Callable[[Any], Any]) -> None:
    """``delivery_of(loop)``: the delivery of an event loop (mpx/_driver/futures.py's
    ``_LoopDelivery``: ``loop()``, ``running_thread``, ``awaiting``, ``reading``,
    ``wakeups``, ``add``, ``_read``), made on first use."""
    global _delivery_of
    _delivery_of = delivery_of


def runs_here(delivery: Any) -> bool:
    """Whether ``delivery``'s event loop runs in this thread now, as mpx knows it without
    asking asyncio (whose look costs a getpid system call each time on Python 3.11): its
    ``running_thread`` is this thread inside the loop's callbacks that mpx runs (reading
    replies, waking its tasks) and the task steps they run. False anywhere else, even where
    the loop does run: the caller then takes the way that works from any thread
    (``call_soon_threadsafe``)."""
    return delivery.running_thread == _get_ident()


def _running_loop() -> Any:
    """The event loop running in this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class CLock:
    """A C lock, for the compiled core's locks: the Baton's, the call table's
    (``Ledger.lock``, which is ``CallRegistry.lock``, mpx/_driver/registry.py) and each
    future's (``FutureCore._lock``). The compiled code takes and releases it with no Python
    call between; Python code enters it with ``with``: ``__enter__`` and ``__exit__`` are C
    functions, so no interrupt lands inside them (see Baton). ``acquire``, ``release`` and
    ``locked`` are threading.Lock's, for the threading.Condition built on a future's lock
    and for concurrent.futures' waits. Not reentrant. A wait for it lets the GIL go and
    runs the signal handlers whenever a signal cuts it short: a handler's exception
    (Ctrl-C) ends the wait, with the lock not taken. (Plain Python takes a threading.Lock
    instead: this class's methods would be Python there.)"""

    __slots__ = ("_sem",)
    _sem: Any  # (a C sem_t: the .pxd's)

    # A POSIX semaphore of one, as CPython's own locks are on Linux, held here rather than
    # behind PyThread_acquire_lock, which reads the clock on every acquire, even one that
    # does not wait (3.11, HAVE_SEM_CLOCKWAIT): a free lock is taken with one atomic.

    def __cinit__(self) -> None:  # (compiled only: plain Python never makes one)
        if sem_init(cython.address(self._sem), 0, 1) != 0:
            raise OSError(errno, "sem_init failed for a CLock")

    def __init__(self) -> None:
        if not cython.compiled:
            raise TypeError("CLock is the compiled core's; plain Python takes a "
                            "threading.Lock")

    def __dealloc__(self) -> None:
        sem_destroy(cython.address(self._sem))

    def _try(self) -> bool:
        """Take it if it is free, without waiting."""
        return sem_trywait(cython.address(self._sem)) == 0

    def _acquire(self) -> None:
        self._wait(-1.0)

    def _acquire_within(self, timeout: float) -> bool:
        return self._wait(_now() + timeout)

    def _wait(self, until: float) -> bool:
        """Take it, waiting until monotonic ``until`` at most (< 0: no limit)."""
        if self._try():
            return True
        ts = cython.declare(timespec)
        if until >= 0:
            ts.tv_sec = int(until)
            ts.tv_nsec = int((until - ts.tv_sec) * 1e9)
        while True:
            with cython.nogil:
                if until >= 0:
                    r = sem_clockwait(cython.address(self._sem), CLOCK_MONOTONIC,
                                      cython.address(ts))
                else:
                    r = sem_wait(cython.address(self._sem))
                err = errno
            if r == 0:
                return True
            if err == ETIMEDOUT:
                return False
            if err != EINTR:
                raise OSError(err, "waiting for a CLock failed")
            PyErr_CheckSignals()  # (raises what a handler raised: nothing is held)

    def _release(self) -> None:
        sem_post(cython.address(self._sem))

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take it, as threading.Lock.acquire does: without waiting unless ``blocking``,
        else for ``timeout`` seconds at most (-1: no limit); whether it was taken."""
        if not blocking:
            if timeout != -1:
                raise ValueError("can't specify a timeout for a non-blocking call")
            return self._try()
        if timeout == -1:
            return self._wait(-1.0)
        if timeout < 0:
            raise ValueError("timeout value must be a non-negative number")
        return self._acquire_within(timeout)

    def release(self) -> None:
        """Release it (from any thread, as a threading.Lock); RuntimeError if it is free."""
        if self._try():
            self._release()
            raise RuntimeError("release unlocked lock")
        self._release()

    def locked(self) -> bool:
        """Whether some thread holds it."""
        if self._try():
            self._release()
            return False
        return True

    def __enter__(self) -> CLock:
        self._acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._release()


class Baton:
    """The right to read replies, held by one thread at a time (mpx/_driver/pump.py).

    An interrupt (the KeyboardInterrupt of SIGINT's handler, or whatever a signal handler
    raises) is raised in the main thread when the interpreter next checks, which it does
    after each call returns and on entering a Python function: between a lock's
    ``acquire()`` and the ``try`` that would release it, or in a ``finally`` before its
    ``release()``. Compiled, ``take`` and ``let_go`` take and release a ``CLock`` and mark
    the holding thread with no such check between, so that the pattern ::

        try:
            if baton.take():
                ...  # read
        finally:
            if baton.let_go():
                ...  # what the hand-over does next (may be cut short: nothing is held)

    never leaves the baton held. (Uncompiled, an interrupt can still land inside them: the
    thread's next try to read then fails to take it, and its ``finally`` lets it go.)
    A thread never takes the baton twice: ``take`` refuses one this thread holds.
    """

    __slots__ = ("_lock", "_c", "_held", "_holder")

    def __init__(self) -> None:
        if cython.compiled:  # (taken and released with no Python call)
            self._c = CLock()
        else:
            self._lock = _Lock()
        self._held = False
        self._holder = 0  # the holding thread's ident, while _held

    def take(self, timeout: float = 0.0) -> bool:
        """Take the baton if it is free, waiting up to ``timeout`` seconds for it (0: not
        at all); False if another thread holds it then, or this one does. A signal
        handler's exception (Ctrl-C) ends the wait, with the baton not taken."""
        me = PyThread_get_thread_ident() if cython.compiled else _get_ident()  # (hot: inline)
        if self._held and self._holder == me:
            return False
        if cython.compiled:
            got = self._c._try() if timeout <= 0 else self._c._acquire_within(timeout)
        elif timeout <= 0:
            got = self._lock.acquire(False)
        else:
            got = self._lock.acquire(True, timeout)
        if got:
            self._holder = me
            self._held = True
        return got

    def held(self) -> bool:
        """Whether this thread holds the baton."""
        return self._held and self._holder == _this_thread()

    def locked(self) -> bool:
        """Whether some thread holds the baton (for other threads, a hint)."""
        return self._held

    @property
    def holder(self) -> int | None:
        """The holding thread's ident, or None."""
        return self._holder if self._held else None

    def let_go(self) -> bool:
        """Release the baton if this thread holds it: whether it did."""
        if not self._held or self._holder != (
                PyThread_get_thread_ident() if cython.compiled else _get_ident()):  # (inline)
            return False
        self._held = False
        if cython.compiled:
            self._c._release()
        else:
            self._lock.release()
        return True


class Ledger:
    """The calls in flight of one call table (mpx/_driver/registry.py): ``pending``, by
    sequence number, oldest first; the counters derived from it, ``with_deadline`` and
    ``outstanding`` (pending calls with a deadline, with a future); ``completed``, a deque
    of the settled calls whose futures are still to set; ``open``, whether calls may
    still register. Every change holds ``lock``. The hot ones are these methods: compiled,
    they take and release the lock in C, with no Python between for an interrupt to land
    in; the table makes the others inside ``with ledger.lock``."""

    __slots__ = ("lock", "_c", "pending", "completed", "with_deadline", "outstanding", "open",
                 "meter")

    def __init__(self, meter: Meter | None = None) -> None:
        self.lock: Any
        if cython.compiled:
            self._c = CLock()
            self.lock = self._c
        else:
            self.lock = _Lock()  # (with ``with``: a CLock's would be Python here)
        self.pending: dict[int, Call] = {}
        self.completed: collections.deque[Call] = collections.deque()
        self.with_deadline = 0
        self.outstanding = 0
        self.open = True
        self.meter = meter  # (its outcomes and bytes are recorded here, under ``lock``)

    def register(self, call: Call, parts: tuple = ()) -> bool:
        """Enter ``call``, whose message is ``parts``, in ``pending``; False, and nothing
        done, once ``open`` is False."""
        if cython.compiled:
            self._c._acquire()
            try:
                return self._register(call, parts)
            finally:
                self._c._release()
        else:
            with self.lock:
                return self._register(call, parts)

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
        if cython.compiled:
            self._c._acquire()
            try:
                return self._settle(call, value, error)
            finally:
                self._c._release()
        else:
            with self.lock:
                return self._settle(call, value, error)

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
            self.meter.settled(call, error)
        return True

    def forget(self, call: Call) -> None:
        """Unregister ``call``, never sent: it leaves ``pending`` and is done, with no
        outcome (nothing waits for it)."""
        if cython.compiled:
            self._c._acquire()
            try:
                self._forget(call)
            finally:
                self._c._release()
        else:
            with self.lock:
                self._forget(call)

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
        if cython.compiled:
            self._c._acquire()
            try:
                return self._settle_batch(calls, start)
            finally:
                self._c._release()
        else:
            with self.lock:
                return self._settle_batch(calls, start)

    def _settle_batch(self, calls: list[Call], start: int) -> int:
        stop, with_deadline, futures = settle_ok(calls, start, self.pending, self.completed,
                                                 self.meter)
        self.with_deadline -= with_deadline
        self.outstanding -= futures
        return stop


# The meter's latency buckets (seconds): four per octave from 2**-20 s (~0.95 us) to 2**8 s;
# bucket i counts the values at most BOUNDS[i], the last one (N_BUCKETS - 1) the rest. Every
# fourth bound is a power of two, which the Prometheus collector exports.
BOUNDS = tuple(2.0 ** (k / 4) for k in range(-80, 33))
N_BUCKETS = len(BOUNDS) + 1
_BOUNDS_AT = array.array("d", BOUNDS + (float("inf"),))
# (Histogram.observe, compiled) a mantissa in [0.5, 1) above _Qn lies above the octave's
# (n + 1)th bound, counting 2**(e-1) as its first
_Q1, _Q2, _Q3 = 2.0 ** -0.75, 2.0 ** -0.5, 2.0 ** -0.25


class Histogram:
    """Counts of values by the meter's latency buckets (``BOUNDS``): ``buckets``, an
    ``array('q')`` of N_BUCKETS counts, with their ``count``, ``sum`` and ``max``. Changed by
    one thread at a time (the meter's rules); read by any."""

    __slots__ = ("buckets", "_counts", "_bounds", "count", "sum", "max")

    def __init__(self) -> None:
        self.buckets = array.array("q", bytes(8 * N_BUCKETS))
        self._counts = self.buckets  # (compiled: a C view of it, as _bounds of the bounds)
        self._bounds = _BOUNDS_AT
        self.count = 0
        self.sum = 0.0
        self.max = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` (seconds) in its bucket."""
        if cython.compiled:  # the first bound >= value, from its binary exponent
            bounds = self._bounds
            if not value > bounds[0]:  # (NaN too, as bisect puts it)
                lo = 0
            else:  # value = m * 2**e, 0.5 <= m < 1: the octave's bounds are 2**(e-1)..2**e
                e = 0
                m = frexp(value, cython.address(e))
                lo = 4 * e + 76 + (m > 0.5) + (m > _Q1) + (m > _Q2) + (m > _Q3)
                if lo > N_BUCKETS - 1:
                    lo = N_BUCKETS - 1
                while value <= bounds[lo - 1]:  # (the rounding of 2.0 ** (k / 4))
                    lo -= 1
                while value > bounds[lo]:
                    lo += 1
        else:  # (bisect, in C)
            lo = bisect.bisect_left(BOUNDS, value)
        self._counts[lo] += 1
        self.count += 1
        self.sum += value
        if value > self.max:
            self.max = value

    def add(self, other: Histogram) -> None:
        """Count ``other``'s values too."""
        for i in range(N_BUCKETS):
            self._counts[i] += other._counts[i]
        self.count += other.count
        self.sum += other.sum
        if other.max > self.max:
            self.max = other.max

    def clear(self) -> None:
        """Forget every value."""
        for i in range(N_BUCKETS):
            self._counts[i] = 0
        self.count = 0
        self.sum = 0.0
        self.max = 0.0


class MethodMeter:
    """One method's calls, by outcome, and the time from each call made to its last reply
    (``durations``: the calls every rank answered)."""

    __slots__ = ("ok", "error", "timeout", "durations")

    def __init__(self) -> None:
        self.ok = 0
        self.error = 0
        self.timeout = 0
        self.durations = Histogram()


class Meter:
    """What one call table measures, as its calls go: bytes sent; per rank the time from a
    call made to that rank's reply read (``recent``, the current window of ``window_s``
    seconds; ``previous``, the one before; ``earlier``, every window before those: since the
    start is the three together); the skew between a call's first and last reply (with
    two ranks or more), kept the same three ways; per method its outcomes and durations
    (``methods``). The thread holding the baton records replies
    (``Call.add``); the ledger records outcomes holding its lock. Readers take numbers
    without a lock: a snapshot may miss the reply being recorded at that instant.
    ``timeout_type``: the error class whose calls count as timed out (the others that
    failed count as errors)."""

    __slots__ = ("n_ranks", "window_s", "timeout_type", "bytes_sent", "recent", "previous",
                 "earlier", "skew_recent", "skew_previous", "skew_earlier", "methods",
                 "window_start")

    def __init__(self, n_ranks: int, timeout_type: type, window_s: float = 60.0) -> None:
        self.n_ranks = n_ranks
        self.window_s = window_s
        self.timeout_type = timeout_type
        self.bytes_sent = 0
        self.recent: list[Histogram] = [Histogram() for _ in range(n_ranks)]
        self.previous: list[Histogram] = [Histogram() for _ in range(n_ranks)]
        self.earlier: list[Histogram] = [Histogram() for _ in range(n_ranks)]
        self.skew_recent = Histogram()
        self.skew_previous = Histogram()
        self.skew_earlier = Histogram()
        self.methods: dict[str, MethodMeter] = {}
        self.window_start = _now()

    def resize(self, n_ranks: int) -> None:
        """The group was resized to ``n_ranks``: the ranks that left take their
        histograms with them, the new ones start empty."""
        for hs in (self.recent, self.previous, self.earlier):
            del hs[n_ranks:]
            hs.extend([Histogram() for _ in range(n_ranks - len(hs))])
        self.n_ranks = n_ranks

    def sent(self, parts: tuple) -> None:
        """Count the bytes of a call's encoded ``parts``."""
        n = 0
        for part in parts:
            n += len(part) if type(part) is bytes else memoryview(part).nbytes
        self.bytes_sent += n

    def reply(self, rank: int, call: Call, last: bool) -> None:
        """``rank``'s reply to ``call`` was read now; ``last``: it was the call's last."""
        now = _now()
        if now - self.window_start >= self.window_s:
            self._next_window(now)
        h = self.recent[rank]
        h.observe(now - call.started)
        if call.first_reply == 0.0:
            call.first_reply = now
        if last:
            call.last_reply = now
            if self.n_ranks > 1:
                self.skew_recent.observe(now - call.first_reply)

    def _next_window(self, now: float) -> None:
        for r in range(self.n_ranks):
            self.earlier[r].add(self.previous[r])
        self.skew_earlier.add(self.skew_previous)
        self.recent, self.previous = self.previous, self.recent
        for h in self.recent:
            h.clear()
        self.skew_recent, self.skew_previous = self.skew_previous, self.skew_recent
        self.skew_recent.clear()
        self.window_start = now

    def settled(self, call: Call, error: Any) -> None:
        """(the ledger's lock held) ``call`` ended, with ``error`` or None."""
        m = self.methods.get(call.method)
        if m is None:
            m = self.methods[call.method] = MethodMeter()
        if error is None:
            m.ok += 1
        elif isinstance(error, self.timeout_type):
            m.timeout += 1
        else:
            m.error += 1
        if call.last_reply != 0.0:
            m.durations.observe(call.last_reply - call.started)


class Call:
    """One call in flight: the replies gathered so far and, once done, its outcome. The
    call table changes it holding its locks (``take`` and ``add`` only in the thread that
    reads replies); ``future`` is set for a non-blocking call."""

    __slots__ = ("seq", "method", "n_ranks", "reply_rank", "aggregator", "deadline",
                 "started", "first_reply", "last_reply", "meter", "future", "results", "errors", "done",
                 "value", "error")

    def __init__(self, seq: int, method: str, n_ranks: int, reply_rank: int | None,
                 aggregator: Callable[[list], Any] | None, deadline: float | None) -> None:
        self.seq = seq
        self.method = method
        self.n_ranks = n_ranks
        self.reply_rank = reply_rank
        self.aggregator = aggregator
        self.deadline = deadline
        self.started = _now()
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
                in_turn(reply, rank, next_reply) is None:
            return _LEAVE
        return self.add(rank, reply[1] is _OK, reply[2])

    def add(self, rank: int, ok: bool, payload: Any) -> int:
        """Record ``rank``'s reply (its result if ``ok``, else its error payload): MORE,
        ALL_OK or ANSWERED."""
        if ok:
            self.results[rank] = payload
        else:
            self.errors[rank] = payload
        replied = len(self.results) + len(self.errors)
        if self.meter is not None:
            self.meter.reply(rank, self, replied == self.n_ranks)
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


def in_turn(reply: Any, rank: Any, next_reply: list[int]) -> Any:
    """The one test a reply passes to be recorded, and the one advance of its rank's
    position: every reply is recorded through here (``Call.take``, ``record_each``, and
    through the latter the call table's ``CallRegistry.record``). ``reply`` is a call's
    reply, a ``(seq, OK or ERR, payload)`` tuple, and the one ``rank`` owes next
    (``next_reply[rank] == seq``): ``next_reply[rank]`` becomes ``seq + 1`` and the seq is
    returned. Else None, and nothing changes: a stall report, a reply after a gap or an
    undecodable one's stand-in is the call table's to record first."""
    if type(reply) is not tuple or len(reply) != 3:
        return None
    seq = reply[0]
    status = reply[1]
    if not (status is _OK or status is _ERR) or next_reply[rank] != seq:
        return None
    next_reply[rank] = seq + 1
    return seq


def record_each(replies: list, start: int, rank: int, next_reply: list[int],
                pending: dict[int, Call], answered: list[Call]) -> int:
    """Record ``rank``'s replies ``replies[start:]`` in order: each one in turn
    (``in_turn``) is added to its call in ``pending`` (by seq; a call no longer pending,
    one that timed out, drops it), and every call that is then answered by every rank is
    appended to ``answered``. Stops at the first reply not in turn (a stall report, one
    after a gap, an undecodable one's stand-in: the call table's ``record`` takes it) and
    returns its index, or ``len(replies)``."""
    n = len(replies)
    for i in range(start, n):
        reply = replies[i]
        seq = in_turn(reply, rank, next_reply)
        if seq is None:
            return i
        call = pending.get(seq)
        if call is not None and call.add(rank, reply[1] is _OK, reply[2]) != _MORE:
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
            meter.settled(call, None)
    return (n, with_deadline, futures)


def _finished(future: Any) -> Generator[Any, None, Any]:
    """What awaiting a done future runs: a generator that returns its outcome at once."""
    result = future.result(0)
    if result is _NEVER:  # (never true: the yield makes this a generator)
        yield
    return result


class LoopWakeups:
    """The wake-ups of the tasks of one event loop whose Waiters completed, run together:
    one loop callback for each batch of Waiters completed in a row (an asyncio.Future
    schedules one for each future, through the loop's Python ``call_soon``). A batch
    runs when its first wake-up would have, so its later ones run ahead of what the loop
    scheduled in between. ``delivery``: the loop's delivery (mpx/_driver/futures.py), whose
    ``running_thread`` is this thread while a batch runs (see ``runs_here``)."""

    __slots__ = ("due", "delivery")

    def __init__(self, delivery: Any = None) -> None:
        self.due: list[Waiter] = []
        self.delivery = delivery

    def schedule(self, waiter: Waiter) -> None:
        if not self.due:
            waiter._loop.call_soon(self.run)
        self.due.append(waiter)

    def run(self) -> None:
        """Run the due Waiters' callbacks, in the order they completed (the tasks that
        await them take their next step here, in the loop's thread)."""
        global _waking
        due = self.due
        self.due = []
        delivery = self.delivery
        if delivery is None:
            for waiter in due:
                waiter._run_callbacks()
            return
        outer, outer_thread = _waking, delivery.running_thread
        _waking, delivery.running_thread = delivery, _get_ident()
        try:
            for waiter in due:
                waiter._run_callbacks()
        finally:
            _waking, delivery.running_thread = outer, outer_thread


_W_PENDING, _W_DONE, _W_CANCELLED = 0, 1, 2  # a Waiter's states


class Waiter:
    """What a task awaiting an RPCFuture waits on, in its loop's thread: the part of an
    asyncio.Future that asyncio's tasks use (``_asyncio_future_blocking``, ``get_loop``,
    ``add_done_callback``, ``result``, ``cancel``), set in the loop's thread, its
    callbacks run in batches (LoopWakeups)."""

    # (asyncio.isfuture looks for _asyncio_future_blocking on the class: here, the slot's)
    __slots__ = ("_asyncio_future_blocking", "_loop", "_wakeups", "_state", "_result",
                 "_exception", "_cancel_message", "_callback", "_context", "_more")

    def __init__(self, loop: Any, wakeups: LoopWakeups) -> None:
        self._asyncio_future_blocking = False
        self._loop = loop
        self._wakeups = wakeups
        self._state = _W_PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._cancel_message: Any = None
        # the first callback (the awaiting task's) and its context; any further ones
        self._callback: Callable[[Any], object] | None = None
        self._context: Any = None
        self._more: list[tuple[Callable[[Any], object], Any]] | None = None

    def get_loop(self) -> Any:
        return self._loop

    def done(self) -> bool:
        return self._state != _W_PENDING

    def cancelled(self) -> bool:
        return self._state == _W_CANCELLED

    def result(self) -> Any:
        if self._state == _W_DONE:
            if self._exception is not None:
                raise self._exception
            return self._result
        if self._state == _W_CANCELLED:
            raise self._cancelled_error()
        raise asyncio.InvalidStateError("Result is not ready.")

    def exception(self) -> BaseException | None:
        if self._state == _W_DONE:
            return self._exception
        if self._state == _W_CANCELLED:
            raise self._cancelled_error()
        raise asyncio.InvalidStateError("Exception is not set.")

    def _cancelled_error(self) -> asyncio.CancelledError:
        if self._cancel_message is None:
            return asyncio.CancelledError()
        return asyncio.CancelledError(self._cancel_message)

    def add_done_callback(self, fn: Callable[[Any], object], *, context: Any = None) -> None:
        if context is None:
            context = _copy_context()
        if self._state != _W_PENDING:
            self._loop.call_soon(fn, self, context=context)
        elif self._callback is None:
            self._callback, self._context = fn, context
        else:
            if self._more is None:
                self._more = []
            self._more.append((fn, context))

    def remove_done_callback(self, fn: Callable[[Any], object]) -> int:
        removed = 0
        if self._callback is not None and self._callback == fn:
            self._callback = self._context = None
            removed = 1
        if self._more:
            kept = [(f, c) for f, c in self._more if f != fn]
            removed += len(self._more) - len(kept)
            self._more = kept
        return removed

    def cancel(self, msg: Any = None) -> bool:
        if self._state != _W_PENDING:
            return False
        self._state = _W_CANCELLED
        self._cancel_message = msg
        self._schedule()
        return True

    def set_result(self, result: Any) -> None:
        if self._state != _W_PENDING:
            raise asyncio.InvalidStateError(f"invalid state: {self!r}")
        self._settle(result, None)

    def set_exception(self, exc: BaseException) -> None:
        if self._state != _W_PENDING:
            raise asyncio.InvalidStateError(f"invalid state: {self!r}")
        self._settle(None, exc)

    def _settle(self, result: Any, exc: BaseException | None) -> None:
        """Set the outcome unless cancelled (the awaiting task gave up: it is dropped)."""
        if self._state == _W_PENDING:
            self._result, self._exception = result, exc
            self._state = _W_DONE
            self._schedule()

    def _schedule(self) -> None:
        if self._callback is not None or self._more:
            self._wakeups.schedule(self)

    def _run_callbacks(self) -> None:
        fn, context, more = self._callback, self._context, self._more
        self._callback = self._context = self._more = None
        if fn is not None:
            self._call(fn, context)
        if more:
            for fn, context in more:
                self._call(fn, context)

    def _call(self, fn: Callable[[Any], object], context: Any) -> None:
        try:
            context.run(fn, self)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._loop.call_exception_handler({
                "message": f"Exception in callback {fn!r}", "exception": e, "future": self})

    def __await__(self) -> Waiter:
        return self

    def __iter__(self) -> Waiter:
        return self

    def __next__(self) -> Any:
        if self._state == _W_PENDING:
            self._asyncio_future_blocking = True
            return self
        raise StopIteration(self.result())


# What FutureCore._finish reports: the follow-up work left once the outcome is set.
_F_HAND_OFF = 1   # an awaiting task's Waiter, or a callback added in an event loop
_F_CALLBACKS = 2  # done callbacks, for _run_callbacks
_F_FINISHED = 4   # (_finish_locked) it was done already: nothing changed


def _asyncio_loop(fn: Callable[[Any], object]) -> Any:
    """The event loop running in this thread if ``fn`` is a function of asyncio's own (the
    callback ``asyncio.wait`` adds to what it waits for, which must run in its loop), else
    None: every other done callback runs where concurrent.futures' would."""
    module = getattr(fn, "__module__", None)
    if type(module) is str and (module.startswith("asyncio.") or module == "asyncio"):
        return _running_loop()
    return None


def _call_in_loop(delivery: Any, fn: Callable[[Any], object], arg: Any, context: Any) -> bool:
    """Schedule ``context.run(fn, arg)`` in ``delivery``'s loop, from any thread: False if
    the loop is gone or closed (nobody will run it there)."""
    loop = delivery.loop()
    if loop is None or loop.is_closed():
        return False
    try:
        if runs_here(delivery):
            loop.call_soon(fn, arg, context=context)
        else:
            loop.call_soon_threadsafe(fn, arg, context=context)  # (wakes the loop)
    except RuntimeError:
        if loop.is_closed():  # closed meanwhile
            return False
        raise
    return True


class FutureCore:
    """State, completion and asyncio hand-off of an RPCFuture.

    Completing a future is three steps, so that the thread that reads replies runs no user
    code: ``_complete`` (the outcome, FINISHED, the threads that sleep on it woken; returns
    whether anything is left), ``_hand_off`` (the event loops that await it, or whose
    callbacks wait for it, woken: never blocks, never raises), then ``_run_callbacks`` (the
    done callbacks, each in turn; the call table runs it on its callback thread).
    ``complete_each`` does the first two for a batch of settled calls and hands back the
    futures whose callbacks are due; ``set_result``/``set_exception`` by hand do all three
    in the calling thread.
    """

    __slots__ = ("_lock", "_state", "_result", "_exception", "_waiting", "_done_callbacks",
                 "_loop_waits", "_cond", "_call", "_source", "_target", "_delivery", "_owner")

    def __init__(self, source: Any, call: Any) -> None:
        self._lock: Any
        if cython.compiled:
            self._lock = CLock.__new__(CLock)  # (tp_new, no call of the type)
        else:
            self._lock = _Lock()
        self._state = RUNNING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiting: list | None = None  # the base class's _waiters, made on first use
        # None until a callback is added outside an event loop: each fn, or (fn, context)
        self._done_callbacks: list | None = None
        # None until a second task awaits it or a callback is added in an event loop: each
        # (delivery, Waiter) or (its loop's delivery, fn, context)
        self._loop_waits: list | None = None
        self._cond: threading.Condition | None = None
        self._call = call
        self._source = source
        # the Waiter of the first task that awaits it, and its loop's delivery
        self._target: Waiter | None = None
        self._delivery: Any = None
        self._owner = _pid  # the process it serves

    def _check_owner(self) -> None:
        """NotOwnerError unless this is the process that made it (a forked child's copy
        would wait for replies its process never reads)."""
        if self._owner != _pid:
            raise _not_owner("this executor's future", self._owner, _pid)

    @property
    def _waiters(self) -> list:
        # (concurrent.futures.wait and as_completed append to it, holding the lock)
        if self._waiting is None:
            self._waiting = []
        return self._waiting

    def done(self) -> bool:
        if self._owner != _pid:
            self._check_owner()
        return self._state is FINISHED

    def cancel(self) -> bool:
        """False: the call was sent, and a sent call runs to its end."""
        self._check_owner()
        return False

    def cancelled(self) -> bool:
        self._check_owner()
        return False

    def running(self) -> bool:
        self._check_owner()
        return self._state is RUNNING

    def add_done_callback(self, fn: Callable[[Any], object], *, context: Any = None) -> None:
        """Run ``fn(future)`` once the call is done (in ``context`` if given), in the
        thread that runs the done callbacks (the executor's callback thread); at once,
        here, if it is done already (as concurrent.futures does). A callback of asyncio's
        own, added in a running event loop (``asyncio.wait`` adds one), runs in that loop,
        as asyncio expects, and not at all if the loop has closed by then."""
        self._check_owner()
        loop = _asyncio_loop(fn)
        entry: Any
        if loop is not None:
            entry = (_delivery_of(loop), fn, _copy_context() if context is None else context)
        elif context is not None:
            entry = (fn, context)
        else:
            entry = fn
        with self._lock:
            if self._state is not FINISHED:
                if loop is not None:
                    if self._loop_waits is None:
                        self._loop_waits = [entry]
                    else:
                        self._loop_waits.append(entry)
                elif self._done_callbacks is None:
                    self._done_callbacks = [entry]
                else:
                    self._done_callbacks.append(entry)
                return
        try:
            if context is None:
                fn(self)
            else:
                context.run(fn, self)
        except Exception:
            _LOGGER.exception("exception calling callback for %r", self)

    def remove_done_callback(self, fn: Callable[[Any], object]) -> int:
        """Remove every ``fn`` added and not run yet; how many (asyncio's protocol)."""
        self._check_owner()
        removed = 0
        with self._lock:
            if self._done_callbacks:
                kept = [e for e in self._done_callbacks
                        if not (e == fn or type(e) is tuple and e[0] == fn)]
                removed += len(self._done_callbacks) - len(kept)
                self._done_callbacks = kept or None
            if self._loop_waits:
                kept = [e for e in self._loop_waits if not (len(e) == 3 and e[1] == fn)]
                removed += len(self._loop_waits) - len(kept)
                self._loop_waits = kept or None
        return removed

    def _complete(self, result: Any, exc: BaseException | None) -> bool:
        """Set the outcome and FINISHED, and wake the threads that wait on it (no user code,
        no asyncio): True if ``_hand_off`` and/or ``_run_callbacks`` have work left.
        InvalidStateError if it is done already."""
        return self._finish(result, exc) != 0

    def _finish(self, result: Any, exc: BaseException | None) -> int:
        # (compiled: the CLock in C; plain: `with`, not acquire(), so that no interrupt
        # comes in between)
        if cython.compiled:
            self._lock._acquire()
            try:
                follow = self._finish_locked(result, exc)
            finally:
                self._lock._release()
        else:
            with self._lock:
                follow = self._finish_locked(result, exc)
        if follow == _F_FINISHED:  # (raised here: the repr takes the lock)
            raise _InvalidStateError(f"{FINISHED}: {self!r}")
        return follow

    def _finish_locked(self, result: Any, exc: BaseException | None) -> int:
        """_finish, holding ``_lock``: _F_FINISHED if it was done already."""
        if self._state is FINISHED:
            return _F_FINISHED
        self._result = result
        self._exception = exc
        self._state = FINISHED
        self._call = None  # (the call holds this future)
        if self._waiting:
            for waiter in self._waiting:
                if exc is None:
                    waiter.add_result(self)
                else:
                    waiter.add_exception(self)
        if self._cond is not None:
            self._cond.notify_all()
        return self._follow()

    def _hand_off(self) -> None:
        """Once done: hand the outcome to the tasks that await it and schedule asyncio's
        callbacks, each in its loop, from any thread (the loop is woken with
        call_soon_threadsafe unless it runs here; a loop that has closed is left out). No
        user code; never blocks; logs an error rather than raise it (an interrupt that
        comes meanwhile propagates once every loop was told). Once: a second call finds
        nothing left."""
        self._do_hand_off(_get_ident())

    def _do_hand_off(self, thread: int) -> None:
        """_hand_off, in the thread whose ident is ``thread``."""
        target, waits = self._target, self._loop_waits
        # (written by nobody else once FINISHED; taken in one go under the GIL)
        self._target = None
        self._loop_waits = None
        raised = None
        if target is not None:
            delivery = self._delivery
            self._delivery = None
            source = self._source
            try:
                if delivery.running_thread == thread:  # (runs_here(delivery))
                    # the loop's own thread: wake the task directly
                    target._settle(self._result, self._exception)
                    awaiting = delivery.awaiting  # delivery.forget(source)
                    left = awaiting[source] - 1
                    if left:
                        awaiting[source] = left
                    else:
                        del awaiting[source]
                else:
                    delivery.add(target, self, source)
            except Exception:
                _LOGGER.exception("handing %r to the task that awaits it failed", self)
            except BaseException as e:  # an interrupt: the others are handed off first
                raised = e
        if waits is not None:
            try:
                self._hand_off_rest(waits)
            except BaseException as e:
                if raised is None:
                    raised = e
        if raised is not None:
            try:
                raise raised
            finally:
                raised = None  # (no cycle through the traceback's frame)

    def _hand_off_rest(self, waits: list) -> None:
        raised = None
        for entry in waits:
            try:
                if len(entry) == 2:  # (delivery, Waiter): a second awaiting task
                    entry[0].add(entry[1], self, self._source)
                else:  # asyncio's callback: dropped with its loop if that has closed
                    _call_in_loop(entry[0], entry[1], self, entry[2])
            except Exception:
                _LOGGER.exception("waking the event loop of %r failed", self)
            except BaseException as e:
                if raised is None:
                    raised = e
        if raised is not None:
            try:
                raise raised
            finally:
                raised = None

    def _follow(self) -> int:
        """What is left to do for a FINISHED future (as ``_finish`` reports it)."""
        follow = 0
        if self._target is not None or self._loop_waits is not None:
            follow = _F_HAND_OFF
        if self._done_callbacks is not None:
            follow |= _F_CALLBACKS
        return follow

    def _run_callbacks(self) -> None:
        """Run the done callbacks, once, each in turn: whatever one raises (BaseException
        included: the thread that runs them must live on) is logged with
        concurrent.futures' logger, and the next one runs."""
        self._run_callbacks_in(False)

    def _run_callbacks_in(self, here: bool) -> None:
        """_run_callbacks; ``here`` (the thread that set the future by hand): an Exception
        is logged, and a BaseException (Ctrl-C) propagates once the others ran."""
        with self._lock:
            fns, self._done_callbacks = self._done_callbacks, None
        if fns is None:
            return
        raised = None
        for fn in fns:
            try:
                if type(fn) is tuple:
                    fn[1].run(fn[0], self)
                else:
                    fn(self)
            except Exception:
                _LOGGER.exception("exception calling callback for %r", self)
            except BaseException as e:
                if not here:
                    _LOGGER.exception("exception calling callback for %r", self)
                elif raised is None:
                    raised = e
        if raised is not None:
            try:
                raise raised
            finally:
                raised = None

    def _set(self, result: Any, exc: BaseException | None) -> None:
        """``set_result``/``set_exception`` by hand: complete it, hand it to asyncio and run
        its callbacks, all here (InvalidStateError if it is done already)."""
        self._check_owner()
        _complete_one(self, result, exc, None, True, _get_ident())

    def __await__(self) -> Iterator[Any]:
        # Not a generator: the task gets the Waiter, its own iterator, so every step of
        # the awaiting task runs no frame of ours but the Waiter's. The loop's count of
        # awaited futures drops when the outcome is handed over (or dropped), not here.
        if self._owner != _pid:
            self._check_owner()
        if self._state is FINISHED:
            return _finished(self)
        # a task woken by mpx (LoopWakeups.run) awaits again: its loop is known
        delivery = _waking
        loop = None
        if delivery is not None and runs_here(delivery):
            loop = delivery.loop()
        if loop is None:
            loop = _running_loop()
            if loop is None:
                raise RuntimeError("an RPCFuture is awaited only in a running event loop")
            delivery = _delivery_of(loop)
        wakeups = delivery.wakeups
        if type(wakeups) is not LoopWakeups:  # (made by the first core awaited in the loop)
            wakeups = delivery.wakeups = LoopWakeups(delivery)
        target = Waiter(loop, wakeups)
        source = self._source
        if cython.compiled:  # (as in _finish)
            self._lock._acquire()
            try:
                finished = self._attach(target, delivery)
            finally:
                self._lock._release()
        else:
            with self._lock:
                finished = self._attach(target, delivery)
        if finished:  # done meanwhile
            return _finished(self)
        awaiting = delivery.awaiting  # a future of source is awaited: read for it
        awaiting[source] = awaiting.get(source, 0) + 1
        if source not in delivery.reading:
            delivery._read(source)
        return target  # (its own iterator)


    def _attach(self, target: Waiter, delivery: Any) -> bool:
        """__await__, holding ``_lock``: ``target``, the Waiter of a task of ``delivery``'s
        loop, is told the outcome; or True, and nothing done, if it is done already."""
        if self._state is FINISHED:
            return True
        if self._target is None:
            self._target = target
            self._delivery = delivery
        elif self._loop_waits is None:  # a second task awaits it
            self._loop_waits = [(delivery, target)]
        else:
            self._loop_waits.append((delivery, target))
        return False


def _complete_one(fut: FutureCore, value: Any, error: BaseException | None,
                  due: list | None, by_hand: bool, thread: int) -> int:
    """Complete ``fut``, hand it off, and queue its callbacks on ``due`` (with no ``due``,
    run them here), in the thread whose ident is ``thread``. Set already: InvalidStateError
    by hand, else 1. An interrupt (KeyboardInterrupt...) that comes once it is FINISHED
    propagates only after the rest was done, so that no awaiting task and no callback is
    lost."""
    raised = None
    try:
        follow = fut._finish(value, error)
    except _InvalidStateError:
        if by_hand:
            raise
        return 1
    except BaseException as e:
        if fut._state is not FINISHED:
            raise
        raised = e  # (while it woke the threads that wait on it)
        follow = fut._follow()
    if follow & _F_CALLBACKS and due is not None:
        due.append(fut)
    if follow & _F_HAND_OFF:
        try:
            fut._do_hand_off(thread)
        except BaseException as e:
            if raised is None:
                raised = e
    if follow & _F_CALLBACKS and due is None:
        try:
            fut._run_callbacks_in(True)
        except BaseException as e:
            if raised is None:
                raised = e
    if raised is not None:
        try:
            raise raised
        finally:
            raised = None
    return 0


def complete_each(completed: Any, due: list | None = None) -> None:
    """Complete, in order, the futures of the settled calls in the deque ``completed`` (each
    call has ``future``, ``value`` and ``error``), emptying it, and hand each to the event
    loops that await it; a future someone already set by hand is left as it is. The
    futures whose done callbacks are left to run are appended to ``due`` (the caller then
    runs ``_run_callbacks()`` on each, outside every lock), or, with no ``due``, run here.
    An interrupt stops it after the future it was completing (the calls not reached stay
    in ``completed``; one whose future it had not set goes back to the front)."""
    thread = _get_ident()
    while completed:
        call = completed.popleft()
        fut = call.future
        if fut._state is FINISHED:
            continue  # set by hand
        try:
            _complete_one(fut, call.value, call.error, due, False, thread)
        except BaseException:
            if fut._state is not FINISHED:
                completed.appendleft(call)
            raise
