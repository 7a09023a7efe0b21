"""Pure-Python twin of ``mpx._future_core`` (the same fields, methods and locking): a call's
record, its batches of replies, and the hot part of ``mpx.RPCFuture`` with the Waiter an
awaiting task waits on, used when the extension is absent or MPX_PURE_PYTHON=1."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

from mpx import wire

IMPLEMENTATION = "python"

_RUNNING = concurrent.futures._base.RUNNING  # type: ignore[attr-defined]
_FINISHED = concurrent.futures._base.FINISHED  # type: ignore[attr-defined]
_LOGGER = concurrent.futures._base.LOGGER  # type: ignore[attr-defined]
_running_loop = asyncio._get_running_loop  # the C function: no RuntimeError, no warning

_last: Any = None
_delivery_of: Any = None
_NEVER = object()


def _runs_here(loop: asyncio.AbstractEventLoop) -> bool:
    """See ``mpx._future_core._runs_here``."""
    tid = getattr(loop, "_thread_id", _NEVER)
    if tid is _NEVER:
        return loop is _running_loop()
    return tid is not None and tid == threading.get_ident()


MORE, ALL_OK, ANSWERED = 0, 1, 2  # what Call.add returns


class Call:
    """See ``mpx._future_core.Call``."""

    __slots__ = ("seq", "method", "n_ranks", "reply_rank", "aggregator", "deadline",
                 "started", "future", "results", "errors", "done", "value", "error")

    def __init__(self, seq: int, method: str, n_ranks: int, reply_rank: int | None,
                 aggregator: Callable | None, deadline: float | None) -> None:
        self.seq = seq
        self.method = method
        self.n_ranks = n_ranks
        self.reply_rank = reply_rank
        self.aggregator = aggregator
        self.deadline = deadline
        self.started = time.monotonic()
        self.future: Any = None
        self.results: dict[int, Any] = {}
        self.errors: dict[int, Any] = {}
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def add(self, rank: int, ok: bool, payload: Any) -> int:
        """See ``mpx._future_core.Call.add``."""
        if ok:
            self.results[rank] = payload
        else:
            self.errors[rank] = payload
        if len(self.results) == self.n_ranks and self.aggregator is None:
            return ALL_OK
        if len(self.results) + len(self.errors) == self.n_ranks:
            return ANSWERED
        return MORE

    def ok_value(self) -> Any:
        """See ``mpx._future_core.Call.ok_value``."""
        if self.reply_rank is not None:
            return self.results[self.reply_rank]
        return [self.results[r] for r in range(self.n_ranks)]

    def missing(self) -> list[int]:
        """See ``mpx._future_core.Call.missing``."""
        return [r for r in range(self.n_ranks) if r not in self.results and r not in self.errors]

    def first_missing(self) -> int:
        """See ``mpx._future_core.Call.first_missing``."""
        if not self.results and not self.errors:
            return 0
        for r in range(self.n_ranks):
            if r not in self.results and r not in self.errors:
                return r
        raise AssertionError(f"call {self.seq} has every reply but is not done")

    def gather(self, reads: list, next_reply: list, deadline_ns: int,
               decode: Callable[[int, Any], Any]) -> tuple[int, int, Any]:
        """See ``mpx._future_core.Call.gather``."""
        rank = self.first_missing()
        while True:
            reply = reads[rank](deadline_ns, None, False, decode)
            if type(reply) is not tuple or len(reply) != 3:
                return MORE, rank, reply
            seq, status, payload = reply
            if seq != self.seq or next_reply[rank] != seq or \
                    not (status is wire.OK or status is wire.ERR):
                return MORE, rank, reply
            next_reply[rank] = seq + 1
            answered = self.add(rank, status is wire.OK, payload)
            if answered != MORE:
                return answered, rank, None
            rank = self.first_missing()

    def outcome(self) -> Any:
        """See ``mpx._future_core.Call.outcome``."""
        if self.error is not None:
            raise self.error
        return self.value


def record_each(replies: list, start: int, rank: int, next_reply: list, pending: dict,
                answered: list) -> int:
    """See ``mpx._future_core.record_each``."""
    for i in range(start, len(replies)):
        reply = replies[i]
        if type(reply) is not tuple or len(reply) != 3:
            return i
        seq, status, payload = reply
        if not (status is wire.OK or status is wire.ERR):
            return i
        next_reply[rank] = seq + 1
        call = pending.get(seq)
        if call is not None and call.add(rank, status is wire.OK, payload) != MORE:
            answered.append(call)
    return len(replies)


def settle_ok(calls: list, start: int, pending: dict, completed: Any) -> tuple[int, int, int]:
    """See ``mpx._future_core.settle_ok``."""
    with_deadline = futures = 0
    for i in range(start, len(calls)):
        call = calls[i]
        if call.done:
            continue
        if call.errors or call.aggregator is not None:
            return i, with_deadline, futures
        del pending[call.seq]
        with_deadline += call.deadline is not None
        call.value = call.ok_value()
        if call.future is not None:
            futures += 1
            completed.append(call)
        call.done = True
    return len(calls), with_deadline, futures


def configure(last: Any, delivery_of: Callable[[asyncio.AbstractEventLoop], Any]) -> None:
    """See ``mpx._future_core.configure``."""
    global _last, _delivery_of
    _last, _delivery_of = last, delivery_of


def _finished(future: Any) -> Generator[Any, None, Any]:
    return future.result(0)
    yield  # (a generator that returns at once)


_W_PENDING, _W_DONE, _W_CANCELLED = 0, 1, 2


class LoopWakeups:
    """See ``mpx._future_core.LoopWakeups``."""

    def __init__(self) -> None:
        self.due: list[Waiter] = []

    def schedule(self, waiter: Waiter) -> None:
        if not self.due:
            waiter._loop.call_soon(self.run)
        self.due.append(waiter)

    def run(self) -> None:
        """See ``mpx._future_core.LoopWakeups.run``."""
        due, self.due = self.due, []
        for waiter in due:
            waiter._run_callbacks()


class Waiter:
    """See ``mpx._future_core.Waiter``."""

    _asyncio_future_blocking = False  # (asyncio.isfuture looks at the class)

    def __init__(self, loop: asyncio.AbstractEventLoop, wakeups: LoopWakeups) -> None:
        self._loop = loop
        self._wakeups = wakeups
        self._state = _W_PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._cancel_message: Any = None
        self._callbacks: list[tuple[Callable[[Any], object], contextvars.Context]] = []

    def get_loop(self) -> asyncio.AbstractEventLoop:
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

    def add_done_callback(self, fn: Callable[[Any], object], *,
                          context: contextvars.Context | None = None) -> None:
        if context is None:
            context = contextvars.copy_context()
        if self._state != _W_PENDING:
            self._loop.call_soon(fn, self, context=context)
        else:
            self._callbacks.append((fn, context))

    def remove_done_callback(self, fn: Callable[[Any], object]) -> int:
        kept = [(f, c) for f, c in self._callbacks if f != fn]
        removed = len(self._callbacks) - len(kept)
        self._callbacks = kept
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
        if self._callbacks:
            self._wakeups.schedule(self)

    def _run_callbacks(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for fn, context in callbacks:
            try:
                context.run(fn, self)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as e:
                self._loop.call_exception_handler({
                    "message": f"Exception in callback {fn!r}", "exception": e,
                    "future": self})

    def __await__(self) -> Waiter:
        return self

    def __iter__(self) -> Waiter:
        return self

    def __next__(self) -> Any:
        if self._state == _W_PENDING:
            self._asyncio_future_blocking = True
            return self
        raise StopIteration(self.result())


_F_HAND_OFF, _F_CALLBACKS = 1, 2  # what FutureCore._finish reports (see the core)


def runs_here(loop: asyncio.AbstractEventLoop) -> bool:
    """See ``mpx._future_core.runs_here``."""
    return _runs_here(loop)


def _asyncio_loop(fn: Callable[[Any], object]) -> asyncio.AbstractEventLoop | None:
    """See ``mpx._future_core._asyncio_loop``."""
    module = getattr(fn, "__module__", None)
    if type(module) is str and (module.startswith("asyncio.") or module == "asyncio"):
        return _running_loop()
    return None


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], object], arg: Any,
                  context: contextvars.Context) -> bool:
    """See ``mpx._future_core._call_in_loop``."""
    if loop.is_closed():
        return False
    try:
        if _runs_here(loop):
            loop.call_soon(fn, arg, context=context)
        else:
            loop.call_soon_threadsafe(fn, arg, context=context)
    except RuntimeError:
        if loop.is_closed():
            return False
        raise
    return True


class FutureCore:
    """See ``mpx._future_core.FutureCore``."""

    # Until set on the instance, these read as their class defaults (fewer stores per call).
    _cond: threading.Condition | None = None
    _result: Any = None
    _exception: BaseException | None = None
    # None until a callback is added outside an event loop: each fn, or (fn, context)
    _done_callbacks: list | None = None
    # None until a second task awaits it or a callback is added in an event loop: each
    # (delivery, Waiter) or (loop, fn, context)
    _loop_waits: list | None = None
    # the Waiter of the first task that awaits this one, and its loop's delivery
    _target: Waiter | None = None
    _delivery: Any = None

    def __init__(self, source: Any, call: Any) -> None:
        self._lock = threading.Lock()
        self._state = _RUNNING
        self._waiters: list = []
        self._call = call
        self._source = source

    def done(self) -> bool:
        return self._state == _FINISHED

    def cancel(self) -> bool:
        """False: the call was sent, and a sent call runs to its end."""
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return self._state == _RUNNING

    def add_done_callback(self, fn: Callable[[Any], object], *,
                          context: contextvars.Context | None = None) -> None:
        """See ``mpx._future_core.FutureCore.add_done_callback``."""
        loop = _asyncio_loop(fn)
        entry: Any
        if loop is not None:
            entry = (loop, fn, contextvars.copy_context() if context is None else context)
        elif context is not None:
            entry = (fn, context)
        else:
            entry = fn
        with self._lock:
            if self._state != _FINISHED:
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
        """See ``mpx._future_core.FutureCore.remove_done_callback``."""
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
        """See ``mpx._future_core.FutureCore._complete``."""
        return self._finish(result, exc) != 0

    def _finish(self, result: Any, exc: BaseException | None) -> int:
        follow = 0
        with self._lock:
            finished = self._state == _FINISHED
            if not finished:
                self._result, self._exception = result, exc
                self._state = _FINISHED
                self._call = None  # (the call holds this future)
                if self._waiters:
                    for waiter in self._waiters:
                        if exc is None:
                            waiter.add_result(self)
                        else:
                            waiter.add_exception(self)
                if self._cond is not None:
                    self._cond.notify_all()
                if self._target is not None or self._loop_waits is not None:
                    follow = _F_HAND_OFF
                if self._done_callbacks is not None:
                    follow |= _F_CALLBACKS
        if finished:  # (raised here: the repr takes the lock)
            raise concurrent.futures.InvalidStateError(f"{_FINISHED}: {self!r}")
        return follow

    def _hand_off(self) -> None:
        """See ``mpx._future_core.FutureCore._hand_off``."""
        # (once FINISHED only this writes them: read and cleared without the lock)
        target, self._target = self._target, None
        waits, self._loop_waits = self._loop_waits, None
        delivery, self._delivery = self._delivery, None
        raised = None
        if target is not None:
            source = self._source
            try:
                if _runs_here(target._loop):
                    # the loop's own thread: wake the task directly
                    target._settle(self._result, self._exception)
                    delivery.forget(source)
                else:
                    delivery.add(target, self, source)
            except Exception:
                _LOGGER.exception("mpx: handing %r to the task that awaits it failed", self)
            except BaseException as e:  # an interrupt: the others are handed off first
                raised = e
        for entry in waits or ():
            try:
                if len(entry) == 2:  # (delivery, Waiter): a second awaiting task
                    entry[0].add(entry[1], self, self._source)
                else:  # asyncio's callback: dropped with its loop if that has closed
                    _call_in_loop(entry[0], entry[1], self, entry[2])
            except Exception:
                _LOGGER.exception("mpx: waking the event loop of %r failed", self)
            except BaseException as e:
                raised = raised or e
        if raised is not None:
            try:
                raise raised
            finally:
                raised = None

    def _follow(self) -> int:
        """See ``mpx._future_core.FutureCore._follow``."""
        follow = 0
        if self._target is not None or self._loop_waits is not None:
            follow = _F_HAND_OFF
        if self._done_callbacks is not None:
            follow |= _F_CALLBACKS
        return follow

    def _take_callbacks(self) -> list | None:
        with self._lock:
            fns, self._done_callbacks = self._done_callbacks, None
        return fns

    def _run_callbacks(self) -> None:
        """See ``mpx._future_core.FutureCore._run_callbacks``."""
        self._run_callbacks_in(False)

    def _run_callbacks_in(self, here: bool) -> None:
        """See ``mpx._future_core.FutureCore._run_callbacks_in``."""
        raised = None
        for fn in self._take_callbacks() or ():
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
        """See ``mpx._future_core.FutureCore._set``."""
        _complete_one(self, result, exc, None, True)

    def __await__(self) -> Iterator[Any]:
        # Not a generator: the task gets the Waiter, its own iterator, so every step of
        # the awaiting task runs no frame of ours but the Waiter's. The loop's count of
        # awaited futures drops when the outcome is handed over (or dropped), not here.
        if self._state == _FINISHED:
            return _finished(self)
        delivery: Any = getattr(_last, "delivery", None)  # (this thread's last loop's)
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
        with self._lock:
            finished = self._state == _FINISHED
            if not finished:
                if self._target is None:
                    self._target, self._delivery = target, delivery
                elif self._loop_waits is None:  # a second task awaits it
                    self._loop_waits = [(delivery, target)]
                else:
                    self._loop_waits.append((delivery, target))
        if finished:  # done meanwhile
            return _finished(self)
        awaiting = delivery.awaiting  # a future of source is awaited: read for it
        awaiting[source] = awaiting.get(source, 0) + 1
        if source not in delivery.reading:
            delivery._read(source)
        return target  # (its own iterator)


def _complete_one(fut: Any, value: Any, error: BaseException | None, due: list | None,
                  by_hand: bool) -> int:
    """See ``mpx._future_core._complete_one``."""
    raised = None
    try:
        follow = fut._finish(value, error)
    except concurrent.futures.InvalidStateError:
        if by_hand:
            raise
        return 1
    except BaseException as e:
        if fut._state != _FINISHED:
            raise
        raised = e  # (while it woke the threads that wait on it)
        follow = fut._follow()
    if follow & _F_CALLBACKS and due is not None:
        due.append(fut)
    if follow & _F_HAND_OFF:
        try:
            fut._hand_off()
        except BaseException as e:
            raised = raised or e
    if follow & _F_CALLBACKS and due is None:
        try:
            fut._run_callbacks_in(True)
        except BaseException as e:
            raised = raised or e
    if raised is not None:
        try:
            raise raised
        finally:
            raised = None
    return 0


def complete_each(completed: Any, due: list | None = None) -> None:
    """See ``mpx._future_core.complete_each``."""
    while completed:
        call = completed.popleft()
        fut = call.future
        if fut._state == _FINISHED:
            continue  # set by hand
        try:
            _complete_one(fut, call.value, call.error, due, False)
        except BaseException:
            if fut._state != _FINISHED:
                completed.appendleft(call)
            raise
