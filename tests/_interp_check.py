"""The checks of mpx/_interp.py: each private part of CPython's standard library that it
names still exists and behaves as mpx assumes. Imports nothing but the standard library,
so that tests/tree/test_interp.py runs it under every Python it finds, as a script:

    python tests/_interp_check.py mpx/_interp.py

loads mpx/_interp.py by its path, runs every check and prints ``ok``. In a test process,
``CHECKS`` holds them, each taking the adapter module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures._base as futures_base
import importlib.util
import logging
import sys
import threading
from types import ModuleType
from typing import Any


def check_future_states(interp: ModuleType) -> None:
    # the module's own objects, and a real future goes through them as mpx assumes
    for name in ("PENDING", "RUNNING", "CANCELLED", "CANCELLED_AND_NOTIFIED", "FINISHED"):
        assert getattr(interp, name) is getattr(futures_base, name) == name, name
    f: concurrent.futures.Future = concurrent.futures.Future()
    assert f._state == interp.PENDING
    assert f.set_running_or_notify_cancel() and f._state == interp.RUNNING
    f.set_result(1)
    assert f._state == interp.FINISHED


class _Duck:
    """A future that is no concurrent.futures.Future: only the fields mpx says the module's
    functions read, each read recorded."""

    __slots__ = ("_condition", "_state", "_waiters", "seen")

    def __init__(self, state: str) -> None:
        self._condition = threading.Condition()
        self._state = state
        self._waiters: list = []
        self.seen: set[str] = set()

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_") and not name.startswith("__"):
            object.__getattribute__(self, "seen").add(name)
        return object.__getattribute__(self, name)

    def finish(self, interp: ModuleType, how: str) -> None:
        """Complete it as a future does: FINISHED, then each waiter told, under the lock."""
        with self._condition:
            self._state = interp.FINISHED
            for waiter in self._waiters:
                getattr(waiter, how)(self)


def check_future_fields_and_waiters(interp: ModuleType) -> None:
    assert set(interp.FUTURE_FIELDS) <= set(dir(concurrent.futures.Future()))
    done = _Duck(interp.FINISHED)
    assert concurrent.futures.wait([done], timeout=0).done == {done}
    assert list(concurrent.futures.as_completed([done], timeout=5)) == [done]
    for how in interp.WAITER_METHODS:
        late = _Duck(interp.RUNNING)
        threading.Timer(0.02, late.finish, args=(interp, how)).start()
        got = concurrent.futures.wait([late], timeout=5)
        assert got.done == {late}, how  # (woken by the waiter's method, not the timeout)
        assert late._waiters == []  # (the waiter removed, under the condition)
        slow = _Duck(interp.RUNNING)
        threading.Timer(0.02, slow.finish, args=(interp, how)).start()
        assert list(concurrent.futures.as_completed([slow], timeout=5)) == [slow]
        for duck in (done, late, slow):
            assert duck.seen <= set(interp.FUTURE_FIELDS), duck.seen


def check_futures_logger(interp: ModuleType) -> None:
    assert interp.FUTURES_LOGGER is logging.getLogger("concurrent.futures")
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append
    interp.FUTURES_LOGGER.addHandler(handler)
    try:
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_result(None)
        f.add_done_callback(lambda _: 1 / 0)  # (a done future runs it here, and logs)
    finally:
        interp.FUTURES_LOGGER.removeHandler(handler)
    assert len(logged) == 1 and logged[0].exc_info and \
        logged[0].exc_info[0] is ZeroDivisionError


class _BareLock:
    """A lock with nothing but what interp.CONDITION_LOCK_NEEDS names (as a C lock has)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()


def check_condition_on_a_bare_lock(interp: ModuleType) -> None:
    assert set(dir(_BareLock)) >= set(interp.CONDITION_LOCK_NEEDS)
    lock = _BareLock()
    cond = threading.Condition(lock)
    try:
        cond.wait(0)
        raise AssertionError("waited on a lock not held")
    except RuntimeError:
        pass  # (ownership judged by a non-blocking acquire)
    woken: list[bool] = []
    with cond:
        def notify() -> None:
            with cond:
                cond.notify_all()
        threading.Timer(0.02, notify).start()
        woken.append(cond.wait(5))
    assert woken == [True] and lock.acquire(False)  # (released by the wait, then by `with`)
    lock.release()


class _Awaited:
    """What a Task awaits when it awaits an RPCFuture (mpx's Waiter): the part of an
    asyncio.Future that asyncio uses, each use recorded."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interp: ModuleType) -> None:
        setattr(self, interp.ASYNCIO_BLOCKING, False)
        self.loop = loop
        self.callbacks: list[tuple[Any, Any]] = []
        self.added: list[Any] = []  # (every callback ever added)
        self.cancelled_with: list[Any] = []
        self.outcome: Any = None
        self.blocking_name = interp.ASYNCIO_BLOCKING

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self.loop

    def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
        self.callbacks.append((fn, context))
        self.added.append(fn)

    def remove_done_callback(self, fn: Any) -> int:
        before = len(self.callbacks)
        self.callbacks = [(f, c) for f, c in self.callbacks if f != fn]
        return before - len(self.callbacks)

    def cancel(self, msg: Any = None) -> bool:
        self.cancelled_with.append(msg)
        return True

    def done(self) -> bool:
        return self.outcome is not None

    def cancelled(self) -> bool:
        return False

    def result(self) -> Any:
        return self.outcome

    def exception(self) -> Any:
        return None

    def complete(self, value: Any) -> None:
        self.outcome = value
        for fn, context in self.callbacks:
            self.loop.call_soon(fn, self, context=context)

    def __await__(self) -> Any:
        return self

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        if self.outcome is None:
            setattr(self, self.blocking_name, True)
            return self
        raise StopIteration(self.outcome)


def check_asyncio_future_protocol(interp: ModuleType) -> None:
    name = interp.ASYNCIO_BLOCKING

    class Flagged:
        pass

    setattr(Flagged, name, None)
    flagged = Flagged()
    assert not asyncio.isfuture(flagged)  # (None: not a future)
    setattr(flagged, name, False)
    assert asyncio.isfuture(flagged)
    assert not asyncio.isfuture(type("Plain", (), {})())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        awaited = _Awaited(loop, interp)

        async def step() -> Any:
            return await awaited

        task = asyncio.ensure_future(step())
        await asyncio.sleep(0)
        # the task took it for a future: flag reset, its wake-up added with its context
        assert getattr(awaited, name) is False and len(awaited.callbacks) == 1
        assert awaited.callbacks[0][1] is not None
        awaited.complete("done")
        assert await task == "done"
        stuck = _Awaited(loop, interp)

        async def stuck_step() -> Any:
            return await stuck

        task = asyncio.ensure_future(stuck_step())
        await asyncio.sleep(0)
        task.cancel("why")
        await asyncio.sleep(0)
        assert stuck.cancelled_with == ["why"]  # (cancel(msg=...): the Task's protocol)
        stuck.complete("ignored")
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            pass  # (3.10 to 3.13 differ on whether a finished awaitable cancels the task)

    asyncio.run(main())


def check_asyncio_wait_callbacks(interp: ModuleType) -> None:
    assert not interp.is_asyncio_callback(print) and not interp.is_asyncio_callback(len)
    assert not interp.is_asyncio_callback(lambda f: None)
    assert interp.is_asyncio_callback(asyncio.sleep)

    async def main() -> list:
        loop = asyncio.get_running_loop()
        awaited = _Awaited(loop, interp)
        loop.call_later(0.02, awaited.complete, "x")
        done, _ = await asyncio.wait([awaited], timeout=5)
        assert len(done) == 1
        return awaited.added

    added = asyncio.run(main())
    if sys.version_info >= (3, 11):  # (3.10 wraps what it waits for in a task of its own)
        assert added and all(interp.is_asyncio_callback(fn) for fn in added), added


class _Writes:
    """A pickler's file: each write as it came, and its reference count then."""

    def __init__(self) -> None:
        self.parts: list = []
        self.refs: list[int] = []

    def write(self, b: Any) -> None:
        self.refs.append(sys.getrefcount(b))
        self.parts.append(b)


def check_pickler_hands_large_bytes_over(interp: ModuleType) -> None:
    import copyreg
    import pickle
    import struct
    n = interp.PICKLER_HANDS_OVER_FROM
    for obj, opcode, size in ((bytes(n), pickle.BINBYTES, "<I"),
                              (bytes(5 << 20), pickle.BINBYTES, "<I"),
                              (bytearray(n), pickle.BYTEARRAY8, "<Q")):
        out = _Writes()
        pickle.Pickler(out, protocol=5).dump([obj])
        at = [i for i, part in enumerate(out.parts) if part is obj]
        assert len(at) == 1, f"the pickler copied a {type(obj).__name__} of {len(obj)}"
        head = out.parts[at[0] - 1]
        width = struct.calcsize(size)
        assert head[-1 - width] == opcode[0] and \
            struct.unpack(size, head[-width:])[0] == len(obj)
        # its own chunks are fresh, held by the pickler alone as it writes them: a count
        # below the caller's object's, which its container holds too
        assert max(r for i, r in enumerate(out.refs) if i != at[0]) < out.refs[at[0]]
    small = _Writes()
    pickle.Pickler(small, protocol=5).dump([bytes(n // 4)])
    assert not any(len(p) == n // 4 and type(p) is bytes for p in small.parts[1:] if p)
    pickler = pickle.Pickler(_Writes(), protocol=5)
    setattr(pickler, interp.PICKLER_MEMO, {})
    pickler.dump((1, "a"))
    table_id = id(copyreg.dispatch_table)
    copyreg.pickle(_Writes, lambda w: (_Writes, ()))
    try:
        assert id(copyreg.dispatch_table) == table_id
        assert type(pickle.loads(pickle.dumps(_Writes()))) is _Writes
    finally:
        del copyreg.dispatch_table[_Writes]


def check_builtin_sha256(interp: ModuleType) -> None:
    import hashlib
    make = interp.SHA256_BUILTIN
    if make is None:  # (a Python built without it: mpx.auth hashes with hashlib's alone)
        return
    state = make(b"a" * 100)
    assert state.block_size == 64 and state.digest_size == 32
    copy = state.copy()
    copy.update(memoryview(b"b" * 10))
    assert copy.digest() == hashlib.sha256(b"a" * 100 + b"b" * 10).digest()
    assert state.digest() == hashlib.sha256(b"a" * 100).digest()


CHECKS = [check_future_states, check_future_fields_and_waiters, check_futures_logger,
          check_condition_on_a_bare_lock, check_asyncio_future_protocol,
          check_asyncio_wait_callbacks, check_pickler_hands_large_bytes_over,
          check_builtin_sha256]


def load(path: str) -> ModuleType:
    """mpx/_interp.py, loaded by its path alone (no mpx package)."""
    spec = importlib.util.spec_from_file_location("mpx_interp_under_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    adapter = load(sys.argv[1])
    for check in CHECKS:
        check(adapter)
    print("ok", ".".join(map(str, sys.version_info[:3])))
