"""``RPCFuture``: the future of a non-blocking call, complete on its own, and awaitable."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Callable, Generator
from typing import Any, Protocol


class ReplySource(Protocol):
    """What a future needs of the call table: to wait for its call, and (an event loop)
    to read replies in its own thread."""

    def wait(self, call: Any, timeout: float | None = None) -> None:
        """Return once ``call`` is done (reading replies meanwhile); TimeoutError after
        ``timeout`` seconds."""

    def read_ready(self) -> int | None:
        """Read the replies already there: how many, or None if another thread reads."""

    def lease_to_loop(self) -> None:
        """Leave the reading to an event loop for a moment."""

    def wake_background(self) -> None:
        """The loop reads no more: the background reader waits for the next replies."""


class _LoopDelivery:
    """Completes the asyncio side of the futures awaited in one event loop, and reads their
    replies in the loop's own thread while they keep coming.

    A reply read in another thread wakes the loop once for every batch (where
    ``asyncio.wrap_future`` wakes it once for each future). While futures are awaited, the
    loop then reads the replies itself, a step per loop iteration, with no thread hand-off;
    when a step finds none, the background reader waits for the next one.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)  # the registry is keyed by the loop: no cycle
        self.thread = threading.get_ident()
        self.lock = threading.Lock()
        self.batch: list[tuple[asyncio.Future, concurrent.futures.Future, ReplySource]] = []
        self.awaiting: dict[ReplySource, int] = {}  # futures awaited in this loop, by source
        self.reading: set[ReplySource] = set()      # sources this loop reads now

    def forget(self, source: ReplySource) -> None:
        """A future of ``source`` awaited in this loop was handed to its awaiting task (or
        that task gave up on it); in the loop's thread."""
        left = self.awaiting[source] - 1
        if left:
            self.awaiting[source] = left
        else:
            del self.awaiting[source]

    def add(self, target: asyncio.Future, done: concurrent.futures.Future,
            source: ReplySource) -> None:
        with self.lock:
            first = not self.batch
            self.batch.append((target, done, source))
        loop = self.loop()
        if threading.get_ident() == self.thread:
            if first and loop is not None:
                loop.call_soon(self.deliver)  # (a step delivers before that)
            return
        source.lease_to_loop()
        if first and loop is not None:
            try:
                loop.call_soon_threadsafe(self.deliver)
            except RuntimeError:
                pass  # the loop is closed: nobody awaits any more

    def deliver(self) -> None:
        """Set the asyncio futures of the completed ones (in the loop's thread), then read
        on for the futures still awaited."""
        self._deliver_batch()
        for source in list(self.awaiting):
            self._read(source)

    def _deliver_batch(self) -> None:
        if not self.batch:
            return
        with self.lock:
            batch, self.batch = self.batch, []
        for target, done, source in batch:
            _set_target(target, done)
            self.forget(source)

    def _read(self, source: ReplySource) -> None:
        loop = self.loop()
        if source in self.reading or loop is None:
            return
        self.reading.add(source)
        source.lease_to_loop()
        loop.call_soon(self._step, source)

    def _step(self, source: ReplySource) -> None:
        got = source.read_ready()
        self._deliver_batch()
        loop = self.loop()
        if got and self.awaiting.get(source) and loop is not None:
            source.lease_to_loop()
            loop.call_soon(self._step, source)  # replies keep coming: read on next round
            return
        self.reading.discard(source)
        if self.awaiting.get(source):
            source.wake_background()


_deliveries: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopDelivery] = \
    weakref.WeakKeyDictionary()
_deliveries_lock = threading.Lock()


# concurrent.futures' states (stable since Python 3.2): an RPCFuture is RUNNING from the
# start and FINISHED once its call is settled; it is never PENDING nor CANCELLED.
_RUNNING = concurrent.futures._base.RUNNING  # type: ignore[attr-defined]
_FINISHED = concurrent.futures._base.FINISHED  # type: ignore[attr-defined]
_LOGGER = concurrent.futures._base.LOGGER  # type: ignore[attr-defined]
_running_loop = asyncio._get_running_loop  # the C function: no RuntimeError, no warning
_last = threading.local()  # this thread's loop and its delivery, the common case's lookup


def _delivery(loop: asyncio.AbstractEventLoop) -> _LoopDelivery:
    found = getattr(_last, "delivery", None)
    if found is not None and found.loop() is loop:
        return found
    found = _deliveries.get(loop)
    if found is None:
        with _deliveries_lock:
            found = _deliveries.setdefault(loop, _LoopDelivery(loop))
    _last.delivery = found
    return found


class RPCFuture(concurrent.futures.Future):
    """The future of one ``collective_rpc(..., non_block=True)`` call.

    It completes when the call's replies arrive, whether or not anyone calls ``result()``:
    done callbacks run, and ``concurrent.futures.wait``/``as_completed`` work. It is
    awaitable as it is (``await ex.collective_rpc(..., non_block=True)``), and works with
    ``asyncio.wrap_future``, ``asyncio.gather`` and ``asyncio.wait_for``.

    A call is running from the moment it is sent, so ``cancel()`` returns False, as it does
    for a running ``concurrent.futures`` call. Cancelling a task that awaits the future (or an
    ``asyncio.wait_for`` timeout) leaves the call to finish; its reply is then dropped.
    """

    # Synchronisation. concurrent.futures.Future builds a threading.Condition (pure Python,
    # an RLock and a waiter deque: ~2 us) for every future; most RPCFutures are only awaited
    # or only done-called, and no thread ever sleeps on them. Here every state change and
    # every read that must not miss one (state, result, callbacks, waiters, the awaiting
    # loop's future) happens under ``_lock``, a plain Lock; the Condition is built on that
    # same lock, on first use, by whichever thread is about to sleep on it (``_condition``).
    # The handshake with the completing thread is then that of any monitor:
    #   - the completer, holding _lock, sets FINISHED and, if a Condition exists by then,
    #     notifies it;
    #   - a sleeper makes the Condition (holding _lock, so two sleepers make one), and then,
    #     holding _lock again through ``with cond``, checks the state before it waits
    #     (``wait`` releases _lock atomically).
    # Either the completer took _lock first: the sleeper then sees FINISHED and never waits;
    # or the sleeper did: the Condition exists when the completer looks, and the sleeper is
    # already waiting on it (or will see FINISHED). No wake-up is lost, and the base class's
    # methods that use ``self._condition`` (wait, as_completed, repr) work unchanged.

    # Until set on the instance, these read as their class defaults (fewer stores per call).
    _cond: threading.Condition | None = None
    _result: Any = None
    _exception: BaseException | None = None
    # the asyncio future of the first task that awaits this one, and its loop's delivery
    _target: asyncio.Future | None = None
    _delivery: _LoopDelivery | None = None

    def __init__(self, source: ReplySource, call: Any) -> None:
        # (no super().__init__(): it builds the Condition)
        self._lock = threading.Lock()
        self._state = _RUNNING  # set_running_or_notify_cancel(), for a future none has seen
        self._waiters: list = []  # (the base class's wait/as_completed append to it)
        self._done_callbacks: list[Callable[[concurrent.futures.Future], object]] = []
        self._call = call  # what source.wait() waits for, until this future is done
        self._source = source

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        cond = self._cond
        if cond is None:  # (a thread inside ``with cond`` finds it: no re-entry of _lock)
            with self._lock:
                if self._cond is None:
                    self._cond = threading.Condition(self._lock)
                cond = self._cond
        return cond

    def done(self) -> bool:
        return self._state == _FINISHED

    def cancel(self) -> bool:
        """False: the call was sent, and a sent call runs to its end."""
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return self._state == _RUNNING

    def result(self, timeout: float | None = None) -> Any:
        """The call's result; ``TimeoutError`` after ``timeout`` seconds (the call goes on).
        The waiting thread reads the replies itself when no other thread does."""
        if self._state != _FINISHED:
            call = self._call
            if call is not None:
                self._source.wait(call, timeout)
            if self._state != _FINISHED:  # set by another thread just now: wait for it
                return super().result(timeout)
        exc = self._exception
        if exc is not None:
            try:
                raise exc
            finally:
                exc = None  # no cycle through the traceback's frame
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's exception, or None; waits as :meth:`result` does."""
        if self._state != _FINISHED:
            call = self._call
            if call is not None:
                self._source.wait(call, timeout)
            if self._state != _FINISHED:
                return super().exception(timeout)
        return self._exception

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future], object]) -> None:
        """Run ``fn(future)`` once the call is done, in the thread that completes it (at
        once, here, if it is done already)."""
        with self._lock:
            if self._state != _FINISHED:
                self._done_callbacks.append(fn)
                return
        try:
            fn(self)
        except Exception:
            _LOGGER.exception("exception calling callback for %r", self)

    def set_result(self, result: Any) -> None:
        self._complete(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        self._complete(None, exception)

    def _complete(self, result: Any, exc: BaseException | None) -> None:
        with self._lock:
            if self._state == _FINISHED:
                raise concurrent.futures.InvalidStateError(f"{self._state}: {self!r}")
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
            target = self._target
        if target is not None:
            self._target = None
            delivery = self._delivery
            assert delivery is not None
            if target.get_loop() is _running_loop():
                # the loop's own thread: wake the task directly (_set_target, inline: hot)
                if not target.done():
                    if exc is None:
                        target.set_result(result)
                    else:
                        target.set_exception(exc)
                delivery.forget(self._source)
            else:
                delivery.add(target, self, self._source)
        for fn in self._done_callbacks:  # (added before FINISHED: none is added now)
            try:
                fn(self)
            except Exception:
                _LOGGER.exception("exception calling callback for %r", self)

    def __await__(self) -> Generator[Any, None, Any]:
        # Not a generator: the task gets the asyncio future's own (C) iterator, so every
        # step of the awaiting task runs no Python frame of ours. The loop's count of
        # awaited futures drops when the outcome is handed over (or dropped), not here.
        if self._state == _FINISHED:
            return _finished(self)
        loop = _running_loop()
        if loop is None:
            raise RuntimeError("an RPCFuture is awaited only in a running event loop")
        target = loop.create_future()
        delivery = _delivery(loop)
        source = self._source
        with self._lock:
            first = self._state != _FINISHED and self._target is None
            if first:
                self._target, self._delivery = target, delivery
        if not first:  # done meanwhile, or a second task awaits it: the general way
            self.add_done_callback(lambda f: delivery.add(target, f, source))
        awaiting = delivery.awaiting  # a future of source is awaited: read for it
        awaiting[source] = awaiting.get(source, 0) + 1
        if source not in delivery.reading:
            delivery._read(source)
        return target.__await__()


def _finished(future: RPCFuture) -> Generator[Any, None, Any]:
    return future.result(0)
    yield  # (a generator that returns at once)


def _set_target(target: asyncio.Future, done: concurrent.futures.Future) -> None:
    """Hand a done call's outcome to the asyncio future a task awaits (in its loop's thread)."""
    if target.done():
        return  # the awaiting task gave up (wait_for, cancel): the reply is dropped
    exc = done._exception  # type: ignore[attr-defined]
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(done._result)  # type: ignore[attr-defined]
