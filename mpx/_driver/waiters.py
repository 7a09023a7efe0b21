# cython: language_level=3, boundscheck=False, wraparound=False, annotation_typing=False, binding=False
"""What asyncio sees of an awaited RPCFuture: the ``Waiter`` a task awaits, in its loop's
thread (the part of an asyncio.Future that asyncio's tasks use), the wake-ups of a loop's
tasks run in batches (``LoopWakeups``), and the scheduling of asyncio's own callbacks in
their loop (``call_in_loop``). mpx/_driver/future_core.py hands a completed future's
outcome to these.

One source, two builds (Cython's pure-Python mode): setup.py compiles this file, with the C
types of mpx/_driver/waiters.pxd, into the extension ``mpx._driver.waiters``; without a
compiler, and under MPX_PURE_PYTHON=1, it runs as plain Python (mpx/_impl.py chooses).
The private names of asyncio it relies on are mpx/_interp.py's.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any

from mpx import _interp

try:
    import cython
except ImportError:  # Cython is a build dependency only: plain Python needs cython.compiled
    from mpx.mechanism import _cython_shim as cython  # type: ignore[no-redef]

if cython.compiled:
    from cython.cimports.mpx._driver.primitives import this_thread
else:
    from mpx._driver.primitives import this_thread

IMPLEMENTATION = "cython" if cython.compiled else "python"

_copy_context = contextvars.copy_context

# The delivery whose tasks LoopWakeups.run wakes now, in some thread: the likeliest loop
# of an RPCFuture awaited meanwhile (a hint: new_waiter checks it with runs_here).
_waking: Any = None


def runs_here(delivery: Any) -> bool:
    """Whether ``delivery``'s event loop runs in this thread now, as mpx knows it without
    asking asyncio (whose look costs a getpid system call each time on Python 3.11): its
    ``running_thread`` is this thread inside the loop's callbacks that mpx runs (reading
    replies, waking its tasks) and the task steps they run. False anywhere else, even where
    the loop does run: the caller then takes the way that works from any thread
    (``call_soon_threadsafe``)."""
    return delivery.running_thread == this_thread()


def _running_loop() -> Any:
    """The event loop running in this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


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
        _waking, delivery.running_thread = delivery, this_thread()
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

    # (_asyncio_future_blocking: mpx/_interp.py's ASYNCIO_BLOCKING, which asyncio.isfuture
    # looks for on the class: here, the slot's)
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


def new_waiter(delivery_of: Callable[[Any], Any]) -> Waiter:
    """A Waiter for a task of the event loop that runs in this thread, its ``_wakeups``
    those of the loop's delivery (``delivery_of(loop)``, made on first use); RuntimeError
    where no loop runs. A task that mpx woke (LoopWakeups.run) awaits again in a loop mpx
    knows: found without asking asyncio."""
    delivery = _waking
    loop = None
    if delivery is not None and runs_here(delivery):
        loop = delivery.loop()
    if loop is None:
        loop = _running_loop()
        if loop is None:
            raise RuntimeError("an RPCFuture is awaited only in a running event loop")
        delivery = delivery_of(loop)
    wakeups = delivery.wakeups
    if type(wakeups) is not LoopWakeups:  # (made by the first future awaited in the loop)
        wakeups = delivery.wakeups = LoopWakeups(delivery)
    return Waiter(loop, wakeups)


def asyncio_loop(fn: Callable[[Any], object]) -> Any:
    """The event loop running in this thread if ``fn`` is a function of asyncio's own (the
    callback ``asyncio.wait`` adds to what it waits for, which must run in its loop), else
    None: every other done callback runs where concurrent.futures' would."""
    if _interp.is_asyncio_callback(fn):
        return _running_loop()
    return None


def call_in_loop(delivery: Any, fn: Callable[[Any], object], arg: Any, context: Any) -> bool:
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
