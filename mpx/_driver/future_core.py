# cython: language_level=3, boundscheck=False, wraparound=False, annotation_typing=False, binding=False
"""``FutureCore``, the hot part of ``mpx.RPCFuture`` (see mpx/_driver/futures.py): its state,
its completion, and the hand-off of its outcome to the asyncio tasks that await it (which
wait on a ``Waiter``, mpx/_driver/waiters.py); ``complete_each``, which completes the
futures of a batch of settled calls.

One source, two builds (Cython's pure-Python mode): setup.py compiles this file, with the C
types of mpx/_driver/future_core.pxd, into the extension ``mpx._driver.future_core``;
without a compiler, and under MPX_PURE_PYTHON=1, it runs as plain Python (mpx/_impl.py
chooses). It imports no mpx module outside the futures core but mpx/_interp.py (the names
of concurrent.futures' internals): what it must know of the driver (the NotOwnerError, the
event loops' deliveries) each future is given (``CoreSettings``).

The synchronisation is described in ``RPCFuture``'s comment: every state change of a
future, and every read that must not miss one, holds ``_lock`` (a ``CLock`` compiled,
taken in C by the hot paths; a ``threading.Lock`` in plain Python: see
mpx/_driver/primitives.py), on which the Condition of the base class's waits is built.
(Once FINISHED, the awaiting tasks and loop callbacks are written by ``_hand_off`` alone,
which takes them without the lock.)

Completing a future is split so that the thread that reads replies runs no user code:
``complete_each`` (``_complete``, then ``_hand_off`` to the event loops) in that thread, and
``_run_callbacks`` (the done callbacks) in the executor's callback thread.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import os
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

from mpx import _interp

try:
    import cython
except ImportError:  # Cython is a build dependency only: plain Python needs cython.compiled
    from mpx.mechanism import _cython_shim as cython  # type: ignore[no-redef]

if cython.compiled:
    from cython.cimports.mpx._driver.core_settings import CoreSettings
    from cython.cimports.mpx._driver.primitives import lock_enter, lock_exit, new_lock, this_thread
    from cython.cimports.mpx._driver.waiters import Waiter, asyncio_loop, call_in_loop, new_waiter
else:
    from mpx._driver.core_settings import CoreSettings
    from mpx._driver.primitives import lock_enter, lock_exit, new_lock, this_thread
    from mpx._driver.waiters import Waiter, asyncio_loop, call_in_loop, new_waiter

IMPLEMENTATION = "cython" if cython.compiled else "python"

# concurrent.futures' states of a future (mpx/_interp.py), as its Future's own methods and
# functions (wait, as_completed) compare ``_state`` with them: an RPCFuture is RUNNING from
# the start and FINISHED once its call is settled; it is never PENDING nor CANCELLED.
RUNNING = _interp.RUNNING
FINISHED = _interp.FINISHED
# concurrent.futures' logger, which logs what a done callback raised
_LOGGER = _interp.FUTURES_LOGGER
_InvalidStateError = concurrent.futures.InvalidStateError
_copy_context = contextvars.copy_context
_NEVER = object()

# This process's pid, kept current across os.fork() by the hook below: a future serves only
# the process that made it, and each of its public entry points compares its owner with
# this, without a system call (glibc caches no pid).
_pid: int = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def _finished(future: Any) -> Generator[Any, None, Any]:
    """What awaiting a done future runs: a generator that returns its outcome at once."""
    result = future.result(0)
    if result is _NEVER:  # (never true: the yield makes this a generator)
        yield
    return result


# What FutureCore._finish reports: the follow-up work left once the outcome is set.
_F_HAND_OFF = 1   # an awaiting task's Waiter, or a callback added in an event loop
_F_CALLBACKS = 2  # done callbacks, for _run_callbacks
_F_FINISHED = 4   # (_finish_locked) it was done already: nothing changed


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

    # (_state, and _waiters below: what concurrent.futures' functions read on a future,
    # mpx/_interp.py's FUTURE_FIELDS)
    __slots__ = ("_lock", "_state", "_result", "_exception", "_waiting", "_done_callbacks",
                 "_loop_waits", "_cond", "_call", "_source", "_target", "_delivery",
                 "_settings", "_owner")

    def __init__(self, source: Any, call: Any, settings: CoreSettings) -> None:
        self._lock: Any = new_lock()
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
        self._settings = settings  # its executor's: its NotOwnerError, the loops' deliveries
        self._owner = _pid  # the process it serves

    def _check_owner(self) -> None:
        """NotOwnerError unless this is the process that made it (a forked child's copy
        would wait for replies its process never reads)."""
        if self._owner != _pid:
            raise self._settings.not_owner("this executor's future", self._owner, _pid)

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
        loop = asyncio_loop(fn)
        entry: Any
        if loop is not None:
            entry = (self._settings.delivery_of(loop), fn,
                     _copy_context() if context is None else context)
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
        lock_enter(self._lock)  # (compiled: in C, no interrupt comes in between)
        try:
            follow = self._finish_locked(result, exc)
        finally:
            lock_exit(self._lock)
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
        if self._waiting:  # (concurrent.futures' waiters: mpx/_interp.py's WAITER_METHODS)
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
        self._do_hand_off(this_thread())

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
                    call_in_loop(entry[0], entry[1], self, entry[2])
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
        _complete_one(self, result, exc, None, True, this_thread())

    def __await__(self) -> Iterator[Any]:
        # Not a generator: the task gets the Waiter, its own iterator, so every step of
        # the awaiting task runs no frame of ours but the Waiter's. The loop's count of
        # awaited futures drops when the outcome is handed over (or dropped), not here.
        if self._owner != _pid:
            self._check_owner()
        if self._state is FINISHED:
            return _finished(self)
        target = new_waiter(self._settings.delivery_of)  # (its loop's, which runs here)
        source = self._source
        lock_enter(self._lock)  # (as in _finish)
        try:
            delivery = self._attach(target)
        finally:
            lock_exit(self._lock)
        if delivery is None:  # done meanwhile
            return _finished(self)
        awaiting = delivery.awaiting  # a future of source is awaited: read for it
        awaiting[source] = awaiting.get(source, 0) + 1
        if source not in delivery.reading:
            delivery._read(source)
        return target  # (its own iterator)

    def _attach(self, target: Waiter) -> Any:
        """__await__, holding ``_lock``: ``target``, the Waiter of a task, is told the
        outcome: the delivery of its loop; or None, and nothing done, if it is done
        already."""
        if self._state is FINISHED:
            return None
        delivery = target._wakeups.delivery
        if self._target is None:
            self._target = target
            self._delivery = delivery
        elif self._loop_waits is None:  # a second task awaits it
            self._loop_waits = [(delivery, target)]
        else:
            self._loop_waits.append((delivery, target))
        return delivery


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
    thread = this_thread()
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
