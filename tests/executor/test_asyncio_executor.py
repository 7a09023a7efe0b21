"""asyncio over RPCFutures across real worker processes: asyncio.wait (FIRST_COMPLETED,
ALL_COMPLETED, timeouts), as_completed, gather, wait_for, shield, ensure_future; a loop that
closed while its futures were out; a loop that moved threads; uvloop; and the awaitable
forms of the executor's blocking methods (shutdown_async, check_health_async,
wait_for_failure / failure_future)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import sys
import threading
import time

import pytest

import mpx
from mpx import errors


def split(done, pending, want_done, want_pending=()):
    """Whether asyncio.wait's ``(done, pending)`` split the futures so: the futures themselves
    (Python 3.11 on); 3.10's asyncio.wait wraps each awaitable in a task of its own, so there
    the numbers and the futures' own states tell."""
    if sys.version_info >= (3, 11):
        return done == set(want_done) and pending == set(want_pending)
    return len(done) == len(set(want_done)) and len(pending) == len(set(want_pending)) and \
        all(f.done() for f in want_done) and not any(f.done() for f in want_pending)


@pytest.fixture
def errors_logged(caplog):
    """The records logged at ERROR or above while the test ran."""
    caplog.set_level(logging.ERROR)
    return lambda: [r for r in caplog.records if r.levelno >= logging.ERROR]


async def ticking(coro, period=0.01):
    """``(coro's result, how many times a ticker task ran meanwhile)``: a loop that blocks
    while coro runs makes few ticks."""
    ticks = 0
    stop = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(period)

    t = asyncio.ensure_future(ticker())
    try:
        return await coro, ticks
    finally:
        stop.set()
        await t


# ----------------------------------------------------------------- asyncio's functions

def test_asyncio_wait_over_a_fast_and_a_slow_call(executor):
    e = executor()

    async def main():
        fast = e.collective_rpc("ident", args=("fast",), non_block=True)
        slow = e.collective_rpc("sleep", args=(0.6,), non_block=True)  # (after fast: in order)
        t0 = time.monotonic()
        done, pending = await asyncio.wait([slow, fast], return_when=asyncio.FIRST_COMPLETED)
        first = time.monotonic() - t0
        assert split(done, pending, [fast], [slow]) and first < 0.5
        assert fast.result(0) == ["fast", "fast"]
        done, pending = await asyncio.wait([slow, fast], timeout=0.05)
        assert split(done, pending, [fast], [slow])
        done, pending = await asyncio.wait([slow, fast], timeout=10)
        assert split(done, pending, [slow, fast]) and slow.result(0) == [0, 1]
        many = [e.collective_rpc("mul", args=(i,), non_block=True) for i in range(50)]
        done, pending = await asyncio.wait(many)  # ALL_COMPLETED, no timeout
        assert split(done, pending, many) and [f.result(0) for f in many] == [[i, 2 * i] for i in range(50)]
        failing = e.collective_rpc("fail", non_block=True)
        later = e.collective_rpc("sleep", args=(0.3,), non_block=True)
        done, pending = await asyncio.wait([later, failing],
                                           return_when=asyncio.FIRST_EXCEPTION)
        assert split(done, pending, [failing], [later])
        assert isinstance(failing.exception(0), errors.RPCError)
        await later

    asyncio.run(asyncio.wait_for(main(), 30))


def test_as_completed_yields_in_completion_order(executor):
    slow_ex, fast_ex = executor(n=1), executor(n=1)

    async def main():
        slow = slow_ex.collective_rpc("sleep", args=(0.5,), non_block=True)
        fast = fast_ex.collective_rpc("ident", args=("fast",), non_block=True)
        got = [await c for c in asyncio.as_completed([slow, fast], timeout=10)]
        assert got == [["fast"], [0]]
        slow = slow_ex.collective_rpc("sleep", args=(0.5,), non_block=True)
        fast = fast_ex.collective_rpc("ident", args=("fast",), non_block=True)
        done, pending = await asyncio.wait([slow, fast], return_when=asyncio.FIRST_COMPLETED)
        assert split(done, pending, [fast], [slow])  # two executors: fast overtakes slow
        await slow

    asyncio.run(asyncio.wait_for(main(), 30))


def test_gather_wait_for_shield_and_ensure_future(executor):
    e = executor()

    async def main():
        futs = [e.collective_rpc("ident", args=(i,), non_block=True) for i in range(20)]
        assert await asyncio.gather(*futs) == [[i, i] for i in range(20)]
        assert await asyncio.wait_for(e.collective_rpc("noop", non_block=True), 10) == \
            [None, None]
        slow = e.collective_rpc("sleep", args=(0.4,), non_block=True)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(slow), 0.05)
        assert not slow.done()
        task = asyncio.ensure_future(slow)
        assert isinstance(task, asyncio.Task) and await task == [0, 1]
        # every future that was awaited was handed over, none is left counted
        assert not mpx._driver.futures.loop_delivery(asyncio.get_running_loop()).awaiting

    asyncio.run(asyncio.wait_for(main(), 30))


# ----------------------------------------------------------------- loops closed or moved

def test_a_future_awaited_in_a_loop_that_closed_still_completes(executor, errors_logged):
    e = executor()
    fut = e.collective_rpc("sleep", args=(0.4,), non_block=True)
    ran = []
    fut.add_done_callback(lambda f: ran.append("thread"))

    async def main():
        fut.add_done_callback(lambda f: ran.append("added in the loop"))
        done, pending = await asyncio.wait([fut], timeout=0.01)  # (adds and removes its own)
        assert not done
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(fut, 0.05)
        asyncio.ensure_future(fut)  # still awaiting when asyncio.run returns

    asyncio.run(main())
    assert fut.result(timeout=10) == [0, 1]  # read in this thread, the loop's
    deadline = time.monotonic() + 5
    while len(ran) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(ran) == ["added in the loop", "thread"]
    # another one whose loop closed, completed by the background reader, then shutdown
    other = e.collective_rpc("sleep", args=(0.2,), non_block=True)

    async def gives_up():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(other, 0.01)

    asyncio.run(gives_up())
    pending = e.collective_rpc("sleep", args=(0.3,), non_block=True)

    async def awaits_pending():
        asyncio.ensure_future(pending)
        await asyncio.sleep(0)

    asyncio.run(awaits_pending())
    assert other.result(timeout=10) == [0, 1]
    e.shutdown()  # fails `pending`, whose loop closed, with no error logged
    assert isinstance(pending.exception(5), errors.ExecutorFailed) or pending.result(0)
    assert errors_logged() == []


def test_a_loop_that_awaited_in_one_thread_is_woken_in_another(executor):
    e = executor()
    loop = asyncio.new_event_loop()
    fut = e.collective_rpc("sleep", args=(0.3,), non_block=True)
    resumed = []

    async def awaiting():
        resumed.append((await fut, threading.get_ident(), time.monotonic()))

    task = loop.create_task(awaiting())
    loop.run_until_complete(asyncio.sleep(0.01))  # here: the task awaits the future
    assert not task.done()

    def run_elsewhere():
        loop.call_later(10, lambda: None)  # (a bound on the test: the loop wakes by then)
        loop.run_until_complete(task)

    other = threading.Thread(target=run_elsewhere)
    other.start()
    try:
        time.sleep(0.05)  # the loop sleeps in the other thread
        assert e.collective_rpc("noop") == [None, None]  # this thread reads `fut`'s reply
        done_at = time.monotonic()
        other.join(15)
        assert resumed and resumed[0][:2] == ([0, 1], other.ident)
        assert resumed[0][2] - done_at < 2.0, "the loop was not woken"
    finally:
        other.join(15)
        loop.close()


# ----------------------------------------------------------------- uvloop

def test_under_uvloop(executor):
    uvloop = pytest.importorskip("uvloop")
    e = executor()

    async def main():
        assert await e.collective_rpc("ident", args=(1,), non_block=True) == [1, 1]
        futs = [e.collective_rpc("ident", args=(i,), non_block=True) for i in range(64)]
        assert await asyncio.gather(*futs) == [[i, i] for i in range(64)]
        fast = e.collective_rpc("noop", non_block=True)
        slow = e.collective_rpc("sleep", args=(0.4,), non_block=True)
        done, pending = await asyncio.wait([slow, fast], return_when=asyncio.FIRST_COMPLETED,
                                           timeout=10)
        assert split(done, pending, [fast], [slow])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slow, 0.05)
        task = asyncio.ensure_future(slow)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.wait_for(e.collective_rpc("ident", args=("after",),
                                                       non_block=True), 10) == ["after"] * 2
        assert slow.done() and slow.result(0) == [0, 1]  # the call went on, in order
        (result, ticks) = await ticking(e.collective_rpc("sleep", args=(0.3,), non_block=True))
        assert result == [0, 1] and ticks >= 5

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(main(), 30))
    finally:
        loop.close()


# ----------------------------------------------------------------- the executor's async forms

def test_shutdown_async_keeps_the_loop_running_and_is_idempotent(executor):
    e = executor()

    async def main():
        busy = e.collective_rpc("sleep", args=(0.5,), non_block=True)
        t0 = time.monotonic()
        (_, ticks) = await ticking(asyncio.gather(e.shutdown_async(), e.shutdown_async()))
        took = time.monotonic() - t0
        assert ticks >= 10 and took >= 0.3  # the loop ran all along the shutdown
        assert isinstance(busy.exception(0), errors.ExecutorFailed) or busy.result(0)
        await e.shutdown_async()  # once more: at once
        with pytest.raises(errors.ExecutorFailed):
            e.collective_rpc("noop")

    asyncio.run(asyncio.wait_for(main(), 30))
    for t in threading.enumerate():
        if t.name == "mpx-shutdown":  # (it may still be returning from its last line)
            t.join(5)
            assert not t.is_alive()


def test_check_health_async_awaits_the_ping_without_blocking_the_loop(executor):
    e = executor()

    async def main():
        await e.check_health_async(timeout=5)
        e.collective_rpc("sleep", args=(0.4,), non_block=True)  # the ping waits behind it
        (_, ticks) = await ticking(e.check_health_async(timeout=5))
        assert ticks >= 10
        e.collective_rpc("sleep", args=(2,), non_block=True)
        t0 = time.monotonic()
        with pytest.raises(errors.RPCTimeoutError):  # (WorkerStalledError is a subclass)
            await e.check_health_async(timeout=0.3)
        assert time.monotonic() - t0 < 1.9

    asyncio.run(asyncio.wait_for(main(), 30))


def test_check_health_async_raises_what_check_health_raises_for_a_dead_worker(executor):
    e = executor()
    os.kill(e.worker_pids[1], signal.SIGKILL)

    async def main():
        with pytest.raises(errors.ExecutorFailed):
            for _ in range(50):
                await e.check_health_async(timeout=5)
                await asyncio.sleep(0.05)

    asyncio.run(asyncio.wait_for(main(), 30))
    with pytest.raises(errors.ExecutorFailed):
        e.check_health(timeout=5)


def test_wait_for_failure_and_failure_future(executor):
    e = executor()
    failure = e.failure_future()
    assert failure is e.failure_future() and not failure.done()
    assert failure.cancel() is False  # nobody cancels it for the others

    async def main():
        waiter = asyncio.ensure_future(e.wait_for_failure())
        gives_up = asyncio.ensure_future(e.wait_for_failure())
        await asyncio.sleep(0.05)
        gives_up.cancel()  # cancelling one waiter leaves the others waiting
        assert e.collective_rpc("noop") == [None, None] and not waiter.done()
        os.kill(e.worker_pids[0], signal.SIGKILL)
        (err, ticks) = await ticking(asyncio.wait_for(waiter, 10))
        assert ticks >= 1
        return err

    err = asyncio.run(asyncio.wait_for(main(), 30))
    assert isinstance(err, errors.WorkerDiedError) and err.rank == 0
    assert failure.result(0) is err and e.is_failed
    # once failed: at once, from a thread or a loop
    assert asyncio.run(e.wait_for_failure()) is err
    got = []
    e.failure_future().add_done_callback(lambda f: got.append(f.result()))
    assert got == [err]


def test_failure_future_in_a_thread(executor):
    e = executor()
    fut = e.failure_future()
    threading.Timer(0.2, os.kill, args=(e.worker_pids[1], signal.SIGKILL)).start()
    err = fut.result(timeout=10)
    assert isinstance(err, errors.WorkerDiedError) and err.rank == 1
    assert isinstance(concurrent.futures.wait([fut], 0).done.pop().result(), errors.ExecutorFailed)
