# cython: language_level=3, boundscheck=False, wraparound=False
"""The hot parts of the driver's calls, with their state in C fields: ``Call``, one call's
record in the call table (mpx/_driver/calls.py), with ``record_each`` and ``settle_ok``,
which record and settle a batch of replies; ``FutureCore``, the hot part of
``mpx.RPCFuture`` (see mpx/_driver/futures.py): its state, completion and the hand-off to an
awaiting asyncio task, which waits on a ``Waiter`` woken in batches by ``LoopWakeups``.

``mpx/_future_core_py.py`` is its pure-Python twin, with the same fields, methods and
locking; ``RPCFuture`` puts either under its own Python methods. The synchronisation is
described there, in ``RPCFuture``'s comment: every state change, and every read that must
not miss one, holds ``_lock`` (a ``threading.Lock``), on which the Condition of the base
class's waits is built. (Once FINISHED, the awaiting tasks and loop callbacks are written
by ``_hand_off`` alone, which takes them without the lock.)

Completing a future is split so that the thread that reads replies runs no user code:
``complete_each`` (``_complete``, then ``_hand_off`` to the event loops) in that thread, and
``_run_callbacks`` (the done callbacks) in the executor's callback thread.
"""

import asyncio
import concurrent.futures
import contextvars
import threading

from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from libc.stdint cimport int64_t

from mpx import wire

IMPLEMENTATION = "cython"

cdef object _RUNNING = concurrent.futures._base.RUNNING
cdef object _FINISHED = concurrent.futures._base.FINISHED
cdef object _LOGGER = concurrent.futures._base.LOGGER
cdef object _InvalidStateError = concurrent.futures.InvalidStateError
cdef object _running_loop = asyncio._get_running_loop
cdef object _CancelledError = asyncio.CancelledError
cdef object _AsyncioInvalidStateError = asyncio.InvalidStateError
cdef object _copy_context = contextvars.copy_context
cdef object _Lock = threading.Lock
cdef object _get_ident = threading.get_ident
cdef object _NEVER = object()
cdef object _OK = wire.OK
cdef object _ERR = wire.ERR

cdef bint _runs_here(loop) except -1:
    """Whether ``loop`` runs in this thread now: asyncio's own look (_get_running_loop)
    makes a getpid syscall each time, ~0.17 us on this VM, where an asyncio loop's
    ``_thread_id`` is this thread's ident only while it runs here."""
    cdef object tid = getattr(loop, "_thread_id", _NEVER)
    if tid is _NEVER:
        return loop is _running_loop()
    return tid is not None and tid == _get_ident()


# set by mpx._driver.futures: this thread's cached (loop, delivery), and the lookup
cdef object _last = None
cdef object _delivery_of = None


# what Call.add returns
cdef enum:
    C_MORE = 0      # ranks are still missing
    C_ALL_OK = 1    # every rank answered OK and no aggregator runs: ok_value() is the outcome
    C_ANSWERED = 2  # every rank answered, some with an error, or an aggregator runs
MORE = C_MORE
ALL_OK = C_ALL_OK
ANSWERED = C_ANSWERED


cdef double _monotonic():
    # (time.monotonic's clock)
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class Call:
    """One call in flight: the replies gathered so far and, once done, its outcome. The
    call table changes it holding its locks (``add`` only in the thread that reads
    replies); ``future`` is set for a non-blocking call."""

    cdef readonly object seq
    cdef readonly object method
    cdef readonly Py_ssize_t n_ranks
    cdef readonly object reply_rank
    cdef readonly object aggregator
    cdef readonly object deadline
    cdef readonly double started
    cdef public object future
    cdef readonly dict results
    cdef readonly dict errors
    cdef public bint done
    cdef public object value
    cdef public object error

    def __init__(self, seq, method, Py_ssize_t n_ranks, reply_rank, aggregator, deadline):
        self.seq = seq
        self.method = method
        self.n_ranks = n_ranks
        self.reply_rank = reply_rank
        self.aggregator = aggregator
        self.deadline = deadline
        self.started = _monotonic()
        self.results = {}
        self.errors = {}

    def add(self, rank, bint ok, payload):
        """Record ``rank``'s reply (its result if ``ok``, else its error payload): MORE,
        ALL_OK or ANSWERED."""
        return self._add(rank, ok, payload)

    cdef int _add(self, rank, bint ok, payload) except -1:
        if ok:
            self.results[rank] = payload
        else:
            self.errors[rank] = payload
        if len(self.results) == self.n_ranks and self.aggregator is None:
            return C_ALL_OK
        if len(self.results) + len(self.errors) == self.n_ranks:
            return C_ANSWERED
        return C_MORE

    def ok_value(self):
        """The outcome of a call every rank answered OK: the list of results in rank
        order, or the result of ``reply_rank``."""
        return self._ok_value()

    cdef object _ok_value(self):
        cdef Py_ssize_t r
        cdef dict results = self.results
        if self.reply_rank is not None:
            return results[self.reply_rank]
        return [results[r] for r in range(self.n_ranks)]

    def missing(self):
        """The ranks that have not answered yet."""
        cdef Py_ssize_t r
        return [r for r in range(self.n_ranks) if r not in self.results and r not in self.errors]

    def first_missing(self):
        """The lowest rank that has not answered yet (the call is not done)."""
        return self._first_missing()

    cdef Py_ssize_t _first_missing(self) except -1:
        cdef Py_ssize_t r
        if not self.results and not self.errors:
            return 0
        for r in range(self.n_ranks):
            if r not in self.results and r not in self.errors:
                return r
        raise AssertionError(f"call {self.seq} has every reply but is not done")

    def gather(self, list reads, list next_reply, int64_t deadline_ns, decode):
        """Read this call's missing replies in rank order, each with
        ``reads[rank](deadline_ns, None, False, decode)`` (a transport reader's
        ``read_into``), and add those that answer it, setting ``next_reply[rank]``: the
        call table's read of a call whose replies come in order. Returns ``(ALL_OK or
        ANSWERED, rank, None)`` once every rank answered, or ``(MORE, rank, reply)`` with
        the first reply it leaves to the table (a stall report, an older call's reply,
        one that follows a gap in ``next_reply[rank]``, anything not a ``(seq, OK or ERR,
        payload)`` tuple of this call). An exception of
        ``reads[rank]`` propagates; ``first_missing()`` is then the rank it was reading."""
        cdef Py_ssize_t rank = self._first_missing()
        cdef object reply, seq, status
        cdef int answered
        while True:
            reply = reads[rank](deadline_ns, None, False, decode)
            if type(reply) is not tuple or len(<tuple>reply) != 3:
                return (C_MORE, rank, reply)
            seq = (<tuple>reply)[0]
            status = (<tuple>reply)[1]
            if not (seq is self.seq or seq == self.seq) or next_reply[rank] != seq or \
                    not (status is _OK or status is _ERR):
                return (C_MORE, rank, reply)
            next_reply[rank] = seq + 1
            answered = self._add(rank, status is _OK, (<tuple>reply)[2])
            if answered != C_MORE:
                return (answered, rank, None)
            rank = self._first_missing()

    def outcome(self):
        """The result of a done call, or raise its error."""
        if self.error is not None:
            raise self.error
        return self.value


def record_each(list replies, Py_ssize_t start, rank, list next_reply, dict pending,
                list answered):
    """Record ``rank``'s replies ``replies[start:]`` in order, as the call table's
    ``_record`` does one by one: each ``(seq, OK or ERR, payload)`` tuple sets
    ``next_reply[rank]`` and is added to its call in ``pending`` (by seq; a call no longer
    pending, one that timed out, drops it), and every call that is then answered by every
    rank is appended to ``answered``. Stops at the first reply of any other shape (a stall
    report, an undecodable one's stand-in) and returns its index, or ``len(replies)``."""
    cdef Py_ssize_t i, n = len(replies)
    cdef object reply, seq, status, found
    for i in range(start, n):
        reply = replies[i]
        if type(reply) is not tuple or len(<tuple>reply) != 3:
            return i
        status = (<tuple>reply)[1]
        if not (status is _OK or status is _ERR):
            return i
        seq = (<tuple>reply)[0]
        next_reply[rank] = seq + 1
        found = pending.get(seq)
        if found is not None and \
                (<Call>found)._add(rank, status is _OK, (<tuple>reply)[2]) != C_MORE:
            answered.append(found)
    return n


def settle_ok(list calls, Py_ssize_t start, dict pending, completed):
    """With the call table's lock held: settle ``calls[start:]`` (every rank answered
    each) in order, as the table's ``_settle`` does, until one needs the table's
    ``_finish`` (an error, an aggregator). Each call not already done (a timeout may have
    settled it) leaves ``pending``, gets ``ok_value()`` and is done; one with a future is
    appended to the deque ``completed``. Returns ``(index where it stopped, how many of
    those settled had a deadline, how many had a future)``."""
    cdef Py_ssize_t i, n = len(calls), with_deadline = 0, futures = 0
    cdef Call call
    for i in range(start, n):
        call = <Call>calls[i]
        if call.done:
            continue
        if call.errors or call.aggregator is not None:
            return (i, with_deadline, futures)
        del pending[call.seq]
        if call.deadline is not None:
            with_deadline += 1
        call.value = call._ok_value()
        if call.future is not None:
            futures += 1
            completed.append(call)
        call.done = True
    return (n, with_deadline, futures)


def configure(last, delivery_of):
    """``last``: a threading.local whose ``delivery`` is this thread's last delivery;
    ``delivery_of(loop)``: the delivery of a loop, made on first use."""
    global _last, _delivery_of
    _last, _delivery_of = last, delivery_of


def _finished(future):
    """What awaiting a done future runs: a generator that returns its outcome at once."""
    result = future.result(0)
    if result is _NEVER:  # (never true: the yield makes this a generator)
        yield
    return result


cdef enum:
    W_PENDING = 0
    W_DONE = 1
    W_CANCELLED = 2


cdef class LoopWakeups:
    """The wake-ups of the tasks of one event loop whose Waiters completed, run together:
    one loop callback for each batch of Waiters completed in a row (an asyncio.Future
    schedules one for each future, through the loop's Python ``call_soon``). A batch
    runs when its first wake-up would have, so its later ones run ahead of what the loop
    scheduled in between."""

    cdef list due

    def __cinit__(self):
        self.due = []

    cdef int schedule(self, Waiter waiter) except -1:
        if not self.due:
            waiter._loop.call_soon(self.run)
        self.due.append(waiter)
        return 0

    def run(self):
        """Run the due Waiters' callbacks, in the order they completed."""
        cdef list due = self.due
        cdef Waiter waiter
        self.due = []
        for waiter in due:
            waiter._run_callbacks()


cdef class Waiter:
    """What a task awaiting an RPCFuture waits on, in its loop's thread: the part of an
    asyncio.Future that asyncio's tasks use (``_asyncio_future_blocking``, ``get_loop``,
    ``add_done_callback``, ``result``, ``cancel``), set in the loop's thread, its
    callbacks run in batches (LoopWakeups)."""

    cdef public object _asyncio_future_blocking
    cdef object _loop
    cdef LoopWakeups _wakeups
    cdef int _state
    cdef object _result
    cdef object _exception
    cdef object _cancel_message
    cdef object _callback      # the first callback (the awaiting task's) and its context
    cdef object _context
    cdef list _more            # any further (callback, context)

    def __init__(self, loop, LoopWakeups wakeups):
        self._asyncio_future_blocking = False
        self._loop = loop
        self._wakeups = wakeups

    def get_loop(self):
        return self._loop

    def done(self):
        return self._state != W_PENDING

    def cancelled(self):
        return self._state == W_CANCELLED

    def result(self):
        if self._state == W_DONE:
            if self._exception is not None:
                raise self._exception
            return self._result
        if self._state == W_CANCELLED:
            raise self._cancelled_error()
        raise _AsyncioInvalidStateError("Result is not ready.")

    def exception(self):
        if self._state == W_DONE:
            return self._exception
        if self._state == W_CANCELLED:
            raise self._cancelled_error()
        raise _AsyncioInvalidStateError("Exception is not set.")

    cdef object _cancelled_error(self):
        if self._cancel_message is None:
            return _CancelledError()
        return _CancelledError(self._cancel_message)

    def add_done_callback(self, fn, *, context=None):
        if context is None:
            context = _copy_context()
        if self._state != W_PENDING:
            self._loop.call_soon(fn, self, context=context)
        elif self._callback is None:
            self._callback, self._context = fn, context
        else:
            if self._more is None:
                self._more = []
            self._more.append((fn, context))

    def remove_done_callback(self, fn):
        cdef Py_ssize_t removed = 0
        if self._callback is not None and self._callback == fn:
            self._callback = self._context = None
            removed = 1
        if self._more:
            kept = [(f, c) for f, c in self._more if f != fn]
            removed += len(self._more) - len(kept)
            self._more = kept
        return removed

    def cancel(self, msg=None):
        if self._state != W_PENDING:
            return False
        self._state = W_CANCELLED
        self._cancel_message = msg
        self._schedule()
        return True

    def set_result(self, result):
        if self._state != W_PENDING:
            raise _AsyncioInvalidStateError(f"invalid state: {self!r}")
        self._settle(result, None)

    def set_exception(self, exc):
        if self._state != W_PENDING:
            raise _AsyncioInvalidStateError(f"invalid state: {self!r}")
        self._settle(None, exc)

    cdef int _settle(self, result, exc) except -1:
        """Set the outcome unless cancelled (the awaiting task gave up: it is dropped)."""
        if self._state == W_PENDING:
            self._result, self._exception = result, exc
            self._state = W_DONE
            self._schedule()
        return 0

    cdef int _schedule(self) except -1:
        if self._callback is not None or self._more:
            self._wakeups.schedule(self)
        return 0

    cdef int _run_callbacks(self) except -1:
        cdef object fn = self._callback, context = self._context, more = self._more
        self._callback = self._context = self._more = None
        if fn is not None:
            self._call(fn, context)
        if more:
            for fn, context in more:
                self._call(fn, context)
        return 0

    cdef int _call(self, fn, context) except -1:
        try:
            context.run(fn, self)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._loop.call_exception_handler({
                "message": f"Exception in callback {fn!r}", "exception": e, "future": self})
        return 0

    def __await__(self):
        return self

    def __iter__(self):
        return self

    def __next__(self):
        if self._state == W_PENDING:
            self._asyncio_future_blocking = True
            return self
        raise StopIteration(self.result())


# What FutureCore._finish reports: the follow-up work left once the outcome is set.
cdef enum:
    F_HAND_OFF = 1   # an awaiting task's Waiter, or a callback added in an event loop
    F_CALLBACKS = 2  # done callbacks, for _run_callbacks


def runs_here(loop):
    """Whether ``loop`` runs in this thread now (what the core itself looks at)."""
    return _runs_here(loop)


cdef object _asyncio_loop(fn):
    """The event loop running in this thread if ``fn`` is a function of asyncio's own (the
    callback ``asyncio.wait`` adds to what it waits for, which must run in its loop), else
    None: every other done callback runs where concurrent.futures' would."""
    cdef object module = getattr(fn, "__module__", None)
    if type(module) is str and \
            ((<str>module).startswith("asyncio.") or (<str>module) == "asyncio"):
        return _running_loop()
    return None


cdef bint _call_in_loop(loop, fn, arg, context) except -1:
    """Schedule ``context.run(fn, arg)`` in ``loop``, from any thread: False if the loop is
    closed (nobody will run it there)."""
    if loop.is_closed():
        return False
    try:
        if _runs_here(loop):
            loop.call_soon(fn, arg, context=context)
        else:
            loop.call_soon_threadsafe(fn, arg, context=context)  # (wakes the loop)
    except RuntimeError:
        if loop.is_closed():  # closed meanwhile
            return False
        raise
    return True


cdef class FutureCore:
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

    cdef public object _lock
    cdef public object _state
    cdef public object _result
    cdef public object _exception
    cdef object waiters         # the base class's _waiters, made on first use
    # None until a callback is added outside an event loop: each fn, or (fn, context)
    cdef public object _done_callbacks
    # None until a second task awaits it or a callback is added in an event loop: each
    # (delivery, Waiter) or (loop, fn, context)
    cdef public object _loop_waits
    cdef public object _cond
    cdef public object _call
    cdef public object _source
    cdef public object _target    # the Waiter of the first task that awaits it
    cdef public object _delivery  # and its loop's delivery

    def __init__(self, source, call):
        self._lock = _Lock()
        self._state = _RUNNING
        self._call = call
        self._source = source

    @property
    def _waiters(self):
        # (concurrent.futures.wait and as_completed append to it, holding the lock)
        if self.waiters is None:
            self.waiters = []
        return self.waiters

    def done(self):
        return self._state is _FINISHED

    def cancel(self):
        """False: the call was sent, and a sent call runs to its end."""
        return False

    def cancelled(self):
        return False

    def running(self):
        return self._state is _RUNNING

    def add_done_callback(self, fn, *, context=None):
        """Run ``fn(future)`` once the call is done (in ``context`` if given), in the
        thread that runs the done callbacks (the executor's callback thread); at once,
        here, if it is done already (as concurrent.futures does). A callback of asyncio's
        own, added in a running event loop (``asyncio.wait`` adds one), runs in that loop,
        as asyncio expects, and not at all if the loop has closed by then."""
        cdef object loop = _asyncio_loop(fn)
        cdef object entry
        if loop is not None:
            entry = (loop, fn, _copy_context() if context is None else context)
        elif context is not None:
            entry = (fn, context)
        else:
            entry = fn
        with self._lock:
            if self._state is not _FINISHED:
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

    def remove_done_callback(self, fn):
        """Remove every ``fn`` added and not run yet; how many (asyncio's protocol)."""
        cdef Py_ssize_t removed = 0
        cdef list kept
        with self._lock:
            if self._done_callbacks:
                kept = [e for e in self._done_callbacks
                        if not (e == fn or type(e) is tuple and (<tuple>e)[0] == fn)]
                removed += len(self._done_callbacks) - len(kept)
                self._done_callbacks = kept or None
            if self._loop_waits:
                kept = [e for e in self._loop_waits
                        if not (len(<tuple>e) == 3 and (<tuple>e)[1] == fn)]
                removed += len(self._loop_waits) - len(kept)
                self._loop_waits = kept or None
        return removed

    def _complete(self, result, exc):
        """Set the outcome and FINISHED, and wake the threads that wait on it (no user code,
        no asyncio): True if ``_hand_off`` and/or ``_run_callbacks`` have work left.
        InvalidStateError if it is done already."""
        return self._finish(result, exc) != 0

    cdef int _finish(self, result, exc) except -1:
        cdef int follow = 0
        cdef bint finished
        cdef object waiter
        self._lock.acquire()  # (not `with`: once per future, and it costs more)
        try:
            finished = self._state is _FINISHED
            if not finished:
                self._result = result
                self._exception = exc
                self._state = _FINISHED
                self._call = None  # (the call holds this future)
                if self.waiters:
                    for waiter in self.waiters:
                        if exc is None:
                            waiter.add_result(self)
                        else:
                            waiter.add_exception(self)
                if self._cond is not None:
                    self._cond.notify_all()
                if self._target is not None or self._loop_waits is not None:
                    follow = F_HAND_OFF
                if self._done_callbacks is not None:
                    follow |= F_CALLBACKS
        finally:
            self._lock.release()
        if finished:  # (raised here: the repr takes the lock)
            raise _InvalidStateError(f"{_FINISHED}: {self!r}")
        return follow

    def _hand_off(self):
        """Once done: hand the outcome to the tasks that await it and schedule asyncio's
        callbacks, each in its loop, from any thread (the loop is woken with
        call_soon_threadsafe unless it runs here; a loop that has closed is left out). No
        user code; never blocks; logs an error rather than raise it (an interrupt that
        comes meanwhile propagates once every loop was told). Once: a second call finds
        nothing left."""
        self._do_hand_off()

    cdef int _do_hand_off(self) except -1:
        cdef object target = self._target, waits = self._loop_waits
        cdef object delivery, source, awaiting, raised = None
        cdef Py_ssize_t left
        # (written by nobody else once FINISHED; taken in one go under the GIL)
        self._target = None
        self._loop_waits = None
        if target is not None:
            delivery = self._delivery
            self._delivery = None
            source = self._source
            try:
                if _runs_here((<Waiter>target)._loop):
                    # the loop's own thread: wake the task directly
                    (<Waiter>target)._settle(self._result, self._exception)
                    awaiting = delivery.awaiting  # delivery.forget(source)
                    left = awaiting[source] - 1
                    if left:
                        awaiting[source] = left
                    else:
                        del awaiting[source]
                else:
                    delivery.add(target, self, source)
            except Exception:
                _LOGGER.exception("mpx: handing %r to the task that awaits it failed", self)
            except BaseException as e:  # an interrupt: the others are handed off first
                raised = e
        if waits is not None:
            try:
                self._hand_off_rest(waits)
            except BaseException as e:
                if raised is None:
                    raised = e
        if raised is not None:
            raise raised
        return 0

    cdef int _hand_off_rest(self, list waits) except -1:
        cdef object entry, raised = None
        for entry in waits:
            try:
                if len(<tuple>entry) == 2:  # (delivery, Waiter): a second awaiting task
                    (<tuple>entry)[0].add((<tuple>entry)[1], self, self._source)
                else:  # asyncio's callback: dropped with its loop if that has closed
                    _call_in_loop((<tuple>entry)[0], (<tuple>entry)[1], self,
                                  (<tuple>entry)[2])
            except Exception:
                _LOGGER.exception("mpx: waking the event loop of %r failed", self)
            except BaseException as e:
                if raised is None:
                    raised = e
        if raised is not None:
            raise raised
        return 0

    cdef int _follow(self):
        """What is left to do for a FINISHED future (as ``_finish`` reports it)."""
        cdef int follow = 0
        if self._target is not None or self._loop_waits is not None:
            follow = F_HAND_OFF
        if self._done_callbacks is not None:
            follow |= F_CALLBACKS
        return follow

    def _run_callbacks(self):
        """Run the done callbacks, once, each in turn: whatever one raises (BaseException
        included: the thread that runs them must live on) is logged with
        concurrent.futures' logger, and the next one runs."""
        self._run_callbacks_in(False)

    cdef int _run_callbacks_in(self, bint here) except -1:
        """_run_callbacks; ``here`` (the thread that set the future by hand): an Exception
        is logged, and a BaseException (Ctrl-C) propagates once the others ran."""
        cdef object fns, fn, raised = None
        with self._lock:
            fns, self._done_callbacks = self._done_callbacks, None
        if fns is None:
            return 0
        for fn in fns:
            try:
                if type(fn) is tuple:
                    (<tuple>fn)[1].run((<tuple>fn)[0], self)
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
            raise raised
        return 0

    def _set(self, result, exc):
        """``set_result``/``set_exception`` by hand: complete it, hand it to asyncio and run
        its callbacks, all here (InvalidStateError if it is done already)."""
        _complete_one(self, result, exc, None, True)

    def __await__(self):
        cdef object loop, target, delivery, source, awaiting, wakeups
        cdef bint finished
        if self._state is _FINISHED:
            return _finished(self)
        delivery = getattr(_last, "delivery", None)  # (this thread's last loop's)
        loop = None if delivery is None else delivery.loop()
        if loop is None or not _runs_here(loop):
            loop = _running_loop()
            if loop is None:
                raise RuntimeError("an RPCFuture is awaited only in a running event loop")
            delivery = _delivery_of(loop)
        wakeups = delivery.wakeups
        if type(wakeups) is not LoopWakeups:  # (made by the first core awaited in the loop)
            wakeups = delivery.wakeups = LoopWakeups()
        target = Waiter(loop, wakeups)
        source = self._source
        self._lock.acquire()
        finished = self._state is _FINISHED
        if not finished:
            if self._target is None:
                self._target = target
                self._delivery = delivery
            elif self._loop_waits is None:  # a second task awaits it
                self._loop_waits = [(delivery, target)]
            else:
                self._loop_waits.append((delivery, target))
        self._lock.release()
        if finished:  # done meanwhile
            return _finished(self)
        awaiting = delivery.awaiting  # a future of source is awaited: read for it
        awaiting[source] = awaiting.get(source, 0) + 1
        if source not in delivery.reading:
            delivery._read(source)
        return target  # (its own iterator)


cdef int _complete_one(FutureCore fut, value, error, list due, bint by_hand) except -1:
    """Complete ``fut``, hand it off, and queue its callbacks on ``due`` (with no ``due``,
    run them here). Set already: InvalidStateError by hand, else 1. An interrupt
    (KeyboardInterrupt...) that comes once it is FINISHED propagates only after the rest
    was done, so that no awaiting task and no callback is lost."""
    cdef int follow
    cdef object raised = None
    try:
        follow = fut._finish(value, error)
    except _InvalidStateError:
        if by_hand:
            raise
        return 1
    except BaseException as e:
        if fut._state is not _FINISHED:
            raise
        raised = e  # (while it woke the threads that wait on it)
        follow = fut._follow()
    if follow & F_CALLBACKS and due is not None:
        due.append(fut)
    if follow & F_HAND_OFF:
        try:
            fut._do_hand_off()
        except BaseException as e:
            if raised is None:
                raised = e
    if follow & F_CALLBACKS and due is None:
        try:
            fut._run_callbacks_in(True)
        except BaseException as e:
            if raised is None:
                raised = e
    if raised is not None:
        raise raised
    return 0


def complete_each(completed, list due=None):
    """Complete, in order, the futures of the settled calls in the deque ``completed`` (each
    call has ``future``, ``value`` and ``error``), emptying it, and hand each to the event
    loops that await it; a future someone already set by hand is left as it is. The
    futures whose done callbacks are left to run are appended to ``due`` (the caller then
    runs ``_run_callbacks()`` on each, outside every lock), or, with no ``due``, run here.
    An interrupt stops it after the future it was completing (the calls not reached stay
    in ``completed``; one whose future it had not set goes back to the front)."""
    cdef object call
    cdef FutureCore fut
    while completed:
        call = completed.popleft()
        fut = call.future
        if fut._state is _FINISHED:
            continue  # set by hand
        try:
            _complete_one(fut, call.value, call.error, due, False)
        except BaseException:
            if fut._state is not _FINISHED:
                completed.appendleft(call)
            raise
