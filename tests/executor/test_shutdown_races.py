"""Shutdown racing a sender at every stage of a call: while its arguments are pickled (a
slow ``__reduce__``, user code), while it waits in the driver for ring room, while the
sender thread streams it through a ring too small for it. Shutdown ends within its grace
whatever the sender does, and the call fails with "the executor was shut down".

And the class behind the first: a call's pickling holds up nothing but the calls sent
after it (the readers, the death watch and shutdown go on meanwhile)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import mpx

SLOW_S = 6.0   # how long a slow __reduce__ takes
BOUND_S = 3.0  # what shutdown (or a death report) may take meanwhile: well under SLOW_S


class SlowPickle:
    """An argument whose pickling takes SLOW_S (and says when it starts)."""

    def __init__(self) -> None:
        self.started = threading.Event()

    def __reduce__(self):
        self.started.set()
        time.sleep(SLOW_S)
        return (int, (1,))


class _Caller(threading.Thread):
    """A thread that makes one call and keeps what it returned or raised."""

    def __init__(self, call) -> None:
        super().__init__(daemon=True)
        self._call, self.result, self.error = call, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self._call()
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            self.error = e


def _timed_shutdown(e) -> float:
    t0 = time.monotonic()
    e.shutdown()
    return time.monotonic() - t0


def _shut_down_error(err) -> bool:
    return isinstance(err, mpx.ExecutorFailed) and "shut down" in str(err)


def test_shutdown_while_a_call_is_pickled(executor, impl):
    e = executor()
    slow = SlowPickle()
    caller = _Caller(lambda: e.collective_rpc("ident", args=(slow,)))
    assert slow.started.wait(10)
    follower = _Caller(lambda: e.collective_rpc("ident", args=(2,)))  # waits for its turn
    took = _timed_shutdown(e)
    assert took < BOUND_S, f"shutdown waited {took:.1f} s for a call's pickling"
    caller.join(SLOW_S + 10)
    follower.join(10)
    assert _shut_down_error(caller.error), caller.error
    assert _shut_down_error(follower.error), follower.error


def test_a_call_sent_while_another_pickles_goes_out_after_it(executor, impl):
    """Calls go out in the order they were numbered: a small call (no pickler) made while
    another thread's call pickles waits for it, and reaches the workers after it."""
    e = executor()
    slow = SlowPickle()
    first = _Caller(lambda: e.collective_rpc("mul", args=(slow,)))  # counts its calls
    assert slow.started.wait(10)
    second = _Caller(lambda: e.collective_rpc("count"))
    time.sleep(0.2)
    assert second.is_alive()  # waiting for the first call's number to be used
    first.join(SLOW_S + 10)
    second.join(10)
    assert first.error is None and first.result == [1, 2]
    assert second.error is None and second.result == [1, 1]  # mul ran first, on each rank


def test_a_pickling_call_holds_up_neither_the_readers_nor_the_death_watch(executor, impl):
    e = executor()
    in_flight = e.collective_rpc("sleep", args=(0.5,), non_block=True)
    slow = SlowPickle()
    caller = _Caller(lambda: e.collective_rpc("ident", args=(slow,)))
    assert slow.started.wait(10)
    # replies are read (by the background reader) while the other call pickles
    assert in_flight.result(timeout=BOUND_S) == [0, 1]
    # a death is reported while it pickles
    os.kill(e.worker_pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    while not e.is_failed and time.monotonic() - t0 < BOUND_S:
        time.sleep(0.02)
    assert e.is_failed, "the death watch waited for a call's pickling"
    caller.join(SLOW_S + 10)
    assert isinstance(caller.error, mpx.ExecutorFailed)


class _Reentrant:
    def __init__(self, e) -> None:
        self.e = e
        self.raised = None

    def __reduce__(self):
        try:
            self.e.collective_rpc("ident", args=(1,))
        except RuntimeError as err:
            self.raised = err
        return (int, (0,))


def test_a_reduce_that_calls_the_executor_gets_an_error_not_a_deadlock(executor, impl):
    e = executor()
    arg = _Reentrant(e)
    assert e.collective_rpc("ident", args=(arg,), timeout=10) == [0, 0]
    assert arg.raised is not None and "would wait for itself" in str(arg.raised)
    assert e.collective_rpc("ident", args=(3,)) == [3, 3]  # usable as before


def test_shutdown_while_calls_wait_for_ring_room(executor, impl):
    e = executor(max_chunk_bytes=64 << 10, max_chunks=4)
    busy = e.collective_rpc("sleep", args=(30,), non_block=True)  # the workers take no call
    queued = [e.collective_rpc("ident", args=(b"x" * (40 << 10),), non_block=True)
              for _ in range(12)]
    assert e.pending_calls().queued > 0
    blocking = _Caller(lambda: e.collective_rpc("ident", args=(b"y" * (40 << 10),)))
    time.sleep(0.2)
    took = _timed_shutdown(e)
    cfg = e.config
    assert took < cfg.shutdown_grace_s + cfg.terminate_grace_s + BOUND_S
    blocking.join(10)
    assert _shut_down_error(blocking.error), blocking.error
    for fut in [busy, *queued]:
        assert _shut_down_error(fut.exception(timeout=5)), fut.exception()


def test_shutdown_while_the_sender_streams_a_call_larger_than_the_ring(executor, impl):
    e = executor(max_chunk_bytes=64 << 10, max_chunks=4)  # a 256 KiB ring
    busy = e.collective_rpc("sleep", args=(30,), non_block=True)
    large = e.collective_rpc("ident", args=(b"z" * (4 << 20),), non_block=True)
    t0 = time.monotonic()
    while not any(t.name == "mpx-sender" for t in threading.enumerate()):
        assert time.monotonic() - t0 < 10, "the sender thread never started"
        time.sleep(0.01)
    time.sleep(0.2)  # it writes part of the message, then waits for the readers
    took = _timed_shutdown(e)
    cfg = e.config
    assert took < cfg.shutdown_grace_s + cfg.terminate_grace_s + BOUND_S
    assert _shut_down_error(large.exception(timeout=5)), large.exception()
    assert _shut_down_error(busy.exception(timeout=5)), busy.exception()


@pytest.mark.parametrize("stage", ["pickling", "queued", "streaming"])
def test_the_async_form_fails_the_same_way(executor, stage):
    """The awaiting task gets the same error as a blocking caller."""
    import asyncio
    e = executor(max_chunk_bytes=64 << 10, max_chunks=4)

    async def main():
        if stage == "pickling":
            slow = SlowPickle()
            fut = asyncio.get_running_loop().run_in_executor(
                None, lambda: e.collective_rpc("ident", args=(slow,)))
            await asyncio.get_running_loop().run_in_executor(None, slow.started.wait, 10)
            await e.shutdown_async()
            with pytest.raises(mpx.ExecutorFailed, match="shut down"):
                await fut
            return
        e.collective_rpc("sleep", args=(30,), non_block=True)
        size = (40 << 10) if stage == "queued" else (4 << 20)
        futs = [e.collective_rpc("ident", args=(b"q" * size,), non_block=True)
                for _ in range(6 if stage == "queued" else 1)]
        await asyncio.sleep(0.2)
        await e.shutdown_async()
        for f in futs:
            with pytest.raises(mpx.ExecutorFailed, match="shut down"):
                await f

    asyncio.run(asyncio.wait_for(main(), SLOW_S + 20))
