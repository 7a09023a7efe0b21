"""``RPCFuture``: the future of a non-blocking call, complete on its own, and awaitable."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from typing import Any, Protocol

from mpx._driver.future_core import FINISHED, FutureCore
from mpx._driver.waiters import runs_here


class ReplySource(Protocol):
    """What a future needs of the call table: to wait for its call, and (an event loop)
    to read replies in its own thread."""

    def wait(self, call: Any, timeout: float | None = None) -> None:
        """Return once ``call`` is done (reading replies meanwhile); TimeoutError after
        ``timeout`` seconds."""

    def read_ready(self) -> int | None:
        """Read the replies already there (with none there, wait a moment for the next):
        how many, or None if another thread reads."""

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
    when a step finds none, the background reader waits for the next one. While a step
    reads (and while the core's LoopWakeups, mpx/_driver/waiters.py, resumes the loop's
    tasks), ``running_thread`` is the loop's thread: a future completed there wakes its
    awaiting task at once, in the loop's thread; one completed anywhere else goes through
    ``add``.
    """

    __slots__ = ("loop", "lock", "batch", "awaiting", "reading", "wakeups", "running_thread")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)  # the registry is keyed by the loop: no cycle
        self.lock = threading.Lock()
        # (each awaiting task's Waiter, its done future, and their source)
        self.batch: list[tuple[Any, concurrent.futures.Future, ReplySource]] = []
        self.awaiting: dict[ReplySource, int] = {}  # futures awaited in this loop, by source
        self.reading: set[ReplySource] = set()      # sources this loop reads now
        self.wakeups: Any = None  # the core's batch of its tasks' wake-ups (made on first use)
        # the ident of the thread that runs a callback of mpx's for this loop right now
        # (_step, the core's LoopWakeups.run), else 0: written only there, in the loop's
        # thread, so that it equals a thread's ident only while that thread runs the loop
        # (the core's runs_here)
        self.running_thread = 0

    def forget(self, source: ReplySource) -> None:
        """A future of ``source`` awaited in this loop was handed to its awaiting task (or
        that task gave up on it); in the loop's thread."""
        left = self.awaiting[source] - 1
        if left:
            self.awaiting[source] = left
        else:
            del self.awaiting[source]

    def add(self, target: Any, done: concurrent.futures.Future,
            source: ReplySource) -> None:
        """Hand ``done``'s outcome to ``target`` in the loop's thread, from any thread:
        batched, one wake-up per batch. Never blocks, never raises: a loop that has closed
        (or is gone) drops it, since nobody awaits there any more."""
        loop = self.loop()
        if loop is None:
            return
        with self.lock:
            first = not self.batch
            self.batch.append((target, done, source))
        if runs_here(self):  # (where the loop runs now, not where it was made)
            if first:
                loop.call_soon(self.deliver)  # (a step delivers before that)
            return
        if loop.is_closed():
            self._drop()
            return
        if loop.is_running():  # (in another thread: it reads for its futures from now)
            source.lease_to_loop()
        if first:
            try:
                loop.call_soon_threadsafe(self.deliver)  # (wakes the loop)
            except RuntimeError:  # closed meanwhile
                self._drop()

    def _drop(self) -> None:
        with self.lock:
            self.batch.clear()

    def deliver(self) -> None:
        """Set the Waiters of the completed ones (in the loop's thread), then read
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
        outer, self.running_thread = self.running_thread, threading.get_ident()
        try:
            got = source.read_ready()  # (this loop runs here, now)
        finally:
            self.running_thread = outer
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


_last = threading.local()  # this thread's last loop's delivery, the common case's lookup


def loop_delivery(loop: asyncio.AbstractEventLoop) -> _LoopDelivery:
    """The delivery of ``loop``, made on first use (the futures core is given this:
    ``CoreSettings.delivery_of``, mpx/_driver/registry.py)."""
    found = getattr(_last, "delivery", None)
    if found is not None and found.loop() is loop:
        return found
    found = _deliveries.get(loop)
    if found is None:
        with _deliveries_lock:
            found = _deliveries.setdefault(loop, _LoopDelivery(loop))
    _last.delivery = found
    return found


class RPCFuture(FutureCore, concurrent.futures.Future):  # type: ignore[misc,override]
    """The future of one ``collective_rpc(..., non_block=True)`` call.

    It completes when the call's replies arrive, whether or not anyone calls ``result()``:
    done callbacks run (on the executor's callback thread, in completion order), and
    ``concurrent.futures.wait``/``as_completed`` work. It is awaitable as it is
    (``await ex.collective_rpc(..., non_block=True)``), and asyncio's functions take it:
    ``gather``, ``wait`` (any ``return_when``, timeouts), ``as_completed``, ``wait_for``,
    ``shield``, ``ensure_future``, ``wrap_future``, under asyncio's loop or uvloop. It is
    an awaitable, not an asyncio future (it belongs to no loop), so asyncio wraps it in a
    task where it needs one; ``asyncio.wait`` uses its ``add_done_callback`` and
    ``remove_done_callback``, and the callback asyncio adds runs in its loop (every other
    one where concurrent.futures would run it).

    A call is running from the moment it is sent, so ``cancel()`` returns False, as it does
    for a running ``concurrent.futures`` call. Cancelling a task that awaits the future (or an
    ``asyncio.wait_for`` timeout) leaves the call to finish; its reply is then dropped.
    """

    # Synchronisation. concurrent.futures.Future builds a threading.Condition (pure Python,
    # an RLock and a waiter deque: ~2 us) for every future; most RPCFutures are only awaited
    # or only done-called, and no thread ever sleeps on them. Here every state change and
    # every read that must not miss one (state, result, callbacks, waiters, the awaiting
    # loop's future) happens under ``_lock``, a plain lock (compiled a CLock, else a
    # threading.Lock); the Condition is built on that same lock, on first use, by
    # whichever thread is about to sleep on it (``_condition``).
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
    # ``FutureCore`` (mpx/_driver/future_core.py) holds the state and does the completing
    # and the awaiting; it is made with its executor's ``CoreSettings``.

    # (its fields, for the type checker: annotations only, no class attributes)
    _lock: Any  # (threading.Lock's acquire, release, locked and `with`)
    _cond: threading.Condition | None
    _state: str
    _result: Any
    _exception: BaseException | None
    _call: Any
    _source: ReplySource

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        # (concurrent.futures.wait and as_completed sleep on it: mpx/_interp.py's
        # FUTURE_FIELDS; in a forked child, never woken: NotOwnerError there instead)
        self._check_owner()
        cond = self._cond
        if cond is None:  # (a thread inside ``with cond`` finds it: no re-entry of _lock)
            with self._lock:
                if self._cond is None:
                    self._cond = threading.Condition(self._lock)
                cond = self._cond
        return cond

    def result(self, timeout: float | None = None) -> Any:
        """The call's result; ``TimeoutError`` after ``timeout`` seconds (the call goes on).
        The waiting thread reads the replies itself when no other thread does.
        NotOwnerError in any process but the one that made it (a forked child)."""
        self._check_owner()
        if self._state != FINISHED:
            call = self._call
            if call is not None:
                self._source.wait(call, timeout)
            if self._state != FINISHED:  # set by another thread just now: wait for it
                self._sleep(timeout)
        exc = self._exception
        if exc is not None:
            try:
                raise exc
            finally:
                exc = None  # no cycle through the traceback's frame
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's exception, or None; waits as :meth:`result` does."""
        self._check_owner()
        if self._state != FINISHED:
            call = self._call
            if call is not None:
                self._source.wait(call, timeout)
            if self._state != FINISHED:
                self._sleep(timeout)
        return self._exception

    def _sleep(self, timeout: float | None) -> None:
        """Sleep until another thread finishes it; TimeoutError after ``timeout`` s. (Not
        the base class's result(): it enters the Condition, whose __enter__ is Python, so
        an interrupt can leave ``_lock`` held; see mpx/_driver/pump.py.)"""
        cond = self._condition
        with self._lock:
            if self._state != FINISHED:
                cond.wait(timeout)
        if self._state != FINISHED:  # (raised here: the repr takes the lock)
            raise TimeoutError(f"{self!r} is not done after {timeout} s")

    def __repr__(self) -> str:
        # (the base class's takes _condition: a repr works in every process)
        state = self._state
        if state == FINISHED:
            outcome = (f"raised {type(self._exception).__name__}" if self._exception is not None
                       else f"returned {type(self._result).__name__}")
            return f"<{type(self).__name__} at {id(self):#x} state=finished {outcome}>"
        return f"<{type(self).__name__} at {id(self):#x} state={state.lower()}>"

    def set_result(self, result: Any) -> None:
        """Complete it by hand: its awaiting tasks and done callbacks are told here."""
        self._set(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        """Fail it by hand: its awaiting tasks and done callbacks are told here."""
        self._set(None, exception)

def _set_target(target: Any, done: concurrent.futures.Future) -> None:
    """Hand a done call's outcome to the Waiter a task awaits (in its loop's thread)."""
    if target.done():
        return  # the awaiting task gave up (wait_for, cancel): the reply is dropped
    exc = done._exception  # type: ignore[attr-defined]
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(done._result)  # type: ignore[attr-defined]
