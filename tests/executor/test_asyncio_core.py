"""RPCFuture's completion in three steps (``_complete``, ``_hand_off``, ``_run_callbacks``,
and ``complete_each`` with its ``due`` list), and asyncio over it, in one process, against
the core compiled and as plain Python (mpx/_driver/future_core.py and waiters.py):
asyncio.wait, as_completed, shield, a loop that closed, a loop that moved threads, uvloop.
tests/executor/test_asyncio_executor.py runs the same across real worker processes."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import sys
import threading
import time
import types

import pytest
import test_future_core

from mpx._driver import futures as F


def split(done, pending, want_done, want_pending=()):
    """Whether asyncio.wait's ``(done, pending)`` split the futures so: the futures themselves
    (Python 3.11 on); 3.10's asyncio.wait wraps each awaitable in a task of its own, so there
    the numbers and the futures' own states tell."""
    if sys.version_info >= (3, 11):
        return done == set(want_done) and pending == set(want_pending)
    return len(done) == len(set(want_done)) and len(pending) == len(set(want_pending)) and \
        all(f.done() for f in want_done) and not any(f.done() for f in want_pending)


# the fixtures: ``core``, the compiled core or the plain one, and ``make(value)``, a future
# of that core
core, make = test_future_core.core, test_future_core.make


def settled(fut, value=None, error=None):
    """A settled call of the call table, as complete_each takes it."""
    return types.SimpleNamespace(future=fut, value=value, error=error)


@pytest.fixture
def errors_logged(caplog):
    """The records logged at ERROR or above while the test ran (mpx, asyncio,
    concurrent.futures)."""
    caplog.set_level(logging.ERROR)
    return lambda: [r for r in caplog.records if r.levelno >= logging.ERROR]


# ----------------------------------------------------------------- completion in three steps

def test_complete_runs_no_user_code_and_says_what_is_left(make):
    plain = make()
    assert plain._complete(1, None) is False  # nothing left: no hand-off, no callbacks
    plain._hand_off()
    plain._run_callbacks()
    assert plain.result() == 1
    with pytest.raises(concurrent.futures.InvalidStateError):
        plain._complete(2, None)

    fut, ran = make(), []
    fut.add_done_callback(lambda f: ran.append(threading.get_ident()))
    woken = threading.Event()
    t = threading.Thread(target=lambda: (concurrent.futures.wait([fut], 5), woken.set()))
    t.start()
    time.sleep(0.05)  # the thread sleeps in concurrent.futures.wait
    assert fut._complete(5, None) is True
    assert woken.wait(5) and fut.result() == 5 and ran == []  # woken, no callback run
    t.join()
    runner = threading.Thread(target=fut._run_callbacks)
    runner.start()
    runner.join()
    assert ran == [runner.ident]  # in the thread that runs them
    fut._run_callbacks()
    assert ran == [runner.ident]  # once


def test_run_callbacks_logs_what_each_raises_and_runs_the_others(make, caplog):
    fut, ran = make(), []
    fut.add_done_callback(lambda f: 1 / 0)
    fut.add_done_callback(lambda f: ran.append(1))
    fut.add_done_callback(lambda f: (_ for _ in ()).throw(KeyboardInterrupt))
    fut.add_done_callback(lambda f: ran.append(2))
    fut.add_done_callback(lambda f: sys.exit(3))
    fut.add_done_callback(lambda f: ran.append(3))
    try:
        fut._complete(None, None)
        with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
            fut._run_callbacks()  # the callback thread must live on: nothing propagates
    except (KeyboardInterrupt, SystemExit) as e:
        pytest.fail(f"{e!r} propagated")
    assert ran == [1, 2, 3]
    assert [r.exc_info[0] for r in caplog.records] == \
        [ZeroDivisionError, KeyboardInterrupt, SystemExit]


def test_set_result_by_hand_runs_everything_here_and_a_ctrl_c_still_propagates(make):
    fut, ran = make(), []
    fut.add_done_callback(lambda f: ran.append(("a", threading.get_ident())))
    fut.add_done_callback(lambda f: (_ for _ in ()).throw(KeyboardInterrupt))
    fut.add_done_callback(lambda f: ran.append(("b", threading.get_ident())))
    try:
        fut.set_result(1)
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail("the KeyboardInterrupt did not propagate")
    me = threading.get_ident()
    assert ran == [("a", me), ("b", me)] and fut.result() == 1  # none lost


def test_complete_each_hands_back_the_futures_whose_callbacks_are_due(make):
    futs = [make() for _ in range(5)]
    ran = []
    for i in (0, 2, 3):
        futs[i].add_done_callback(lambda f, i=i: ran.append(i))
    futs[3].set_result("by hand")  # already set: left alone
    ran.clear()
    completed = collections.deque(settled(f, i) for i, f in enumerate(futs))
    completed[4].error = KeyError("k")
    due = []
    make.core.complete_each(completed, due)
    assert not completed and ran == [] and due == [futs[0], futs[2]]
    assert [f.result() for f in futs[:4]] == [0, 1, 2, "by hand"]
    assert isinstance(futs[4].exception(), KeyError)
    for f in due:
        f._run_callbacks()
    assert ran == [0, 2]


def test_complete_each_wakes_the_awaiting_tasks_but_runs_no_callback(make):
    async def main():
        loop = asyncio.get_running_loop()
        futs = [make() for _ in range(3)]
        futs[1].add_done_callback(lambda f: ran.append("thread"))
        tasks = [asyncio.ensure_future(f) for f in futs]
        await asyncio.sleep(0)
        due = []

        def complete():  # another thread, as the reply pump is
            make.core.complete_each(collections.deque(settled(f, i) for i, f in
                                                      enumerate(futs)), due)

        t = threading.Thread(target=complete)
        t.start()
        t.join()
        assert due == [futs[1]] and ran == []  # the tasks are woken, the callback is due
        assert await asyncio.wait_for(asyncio.gather(*tasks), 5) == [0, 1, 2]
        assert ran == []
        futs[1]._run_callbacks()
        assert ran == ["thread"]
        assert not F.loop_delivery(loop).awaiting

    ran = []
    asyncio.run(main())


def test_an_interrupt_in_the_middle_of_completing_loses_no_callback_nor_call(make):
    class Interrupting:  # a concurrent.futures waiter, woken as the future completes
        def add_result(self, fut):
            raise KeyboardInterrupt

        add_exception = add_result

    first, second, ran = make(), make(), []
    first.add_done_callback(lambda f: ran.append("first"))
    second.add_done_callback(lambda f: ran.append("second"))
    first._waiters.append(Interrupting())
    completed, due = collections.deque([settled(first, 1), settled(second, 2)]), []
    with pytest.raises(KeyboardInterrupt):
        make.core.complete_each(completed, due)
    # the future it was completing is complete, its callbacks due; the next call waits
    assert first.result() == 1 and due == [first] and len(completed) == 1
    assert completed[0].future is second and not second.done()
    make.core.complete_each(completed, due)
    assert not completed and due == [first, second]
    for f in due:
        f._run_callbacks()
    assert ran == ["first", "second"]

    class Exploding:  # a loop's delivery that an interrupt hits
        def add(self, *args):
            raise KeyboardInterrupt

    async def main():
        fut = make()

        def of_asyncio(f):
            ran.append("asyncio's")

        of_asyncio.__module__ = "asyncio.tasks"
        fut.add_done_callback(of_asyncio)
        fut._loop_waits.insert(0, (Exploding(), None))  # a second awaiter, first in line
        with pytest.raises(KeyboardInterrupt):
            fut.set_result(3)
        await asyncio.sleep(0)
        assert ran[-1] == "asyncio's"  # scheduled all the same

    asyncio.run(main())


def test_no_callback_is_lost_or_run_twice_when_added_while_the_future_completes(make):
    n = 3000
    futs = [make() for _ in range(n)]
    counts = [0] * n
    lock = threading.Lock()

    def cb(f, i):
        with lock:
            counts[i] += 1

    start = threading.Barrier(3)
    due = []

    def complete():
        start.wait()
        for i, f in enumerate(futs):
            batch = []
            make.core.complete_each(collections.deque([settled(f, i)]), batch)
            due.extend(batch)

    def add():
        start.wait()
        for i, f in enumerate(futs):
            f.add_done_callback(lambda f, i=i: cb(f, i))

    def run_due():
        start.wait()
        while not (len(done_adding) and all(f.done() for f in futs)) or due:
            while due:
                due.pop(0)._run_callbacks()
            time.sleep(0)

    done_adding = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as it can
    try:
        threads = [threading.Thread(target=complete), threading.Thread(target=add)]
        runner = threading.Thread(target=run_due)
        for t in threads + [runner]:
            t.start()
        for t in threads:
            t.join(60)
        done_adding.append(True)
        runner.join(60)
    finally:
        sys.setswitchinterval(old)
    assert counts == [1] * n
    assert [f.result() for f in futs] == list(range(n))


# ----------------------------------------------------------------- asyncio over the futures

def test_asyncio_wait_first_completed_all_completed_and_timeouts(make):
    async def main():
        slow, fast = make(), make()
        threading.Timer(0.02, fast.set_result, args=("fast",)).start()  # another thread
        t0 = time.monotonic()
        done, pending = await asyncio.wait([slow, fast], return_when=asyncio.FIRST_COMPLETED)
        assert split(done, pending, [fast], [slow]) and time.monotonic() - t0 < 2
        done, pending = await asyncio.wait([slow, fast], timeout=0.05)
        assert split(done, pending, [fast], [slow])
        threading.Timer(0.02, slow.set_exception, args=(KeyError("slow"),)).start()
        done, pending = await asyncio.wait([slow, fast], timeout=5)
        assert split(done, pending, [slow, fast])
        failing = [make() for _ in range(3)]
        threading.Timer(0.02, failing[1].set_exception, args=(ValueError(),)).start()
        done, pending = await asyncio.wait(failing, return_when=asyncio.FIRST_EXCEPTION,
                                           timeout=5)
        assert split(done, pending, [failing[1]], [failing[0], failing[2]])
        # asyncio.wait removed its callbacks from the futures it left pending
        assert all(f.remove_done_callback(print) == 0 and not f._loop_waits
                   for f in (failing[0], failing[2]))

    asyncio.run(asyncio.wait_for(main(), 20))


def test_as_completed_gather_shield_and_ensure_future(make):
    async def main():
        futs = [make() for _ in range(4)]
        for delay, i in ((0.08, 0), (0.02, 1), (0.05, 2), (0.11, 3)):
            threading.Timer(delay, futs[i].set_result, args=(i,)).start()
        assert [await c for c in asyncio.as_completed(futs, timeout=5)] == [1, 2, 0, 3]
        g = [make() for _ in range(3)]
        for i, f in enumerate(g):
            threading.Timer(0.01, f.set_result, args=(i,)).start()
        assert await asyncio.gather(*g) == [0, 1, 2]
        shielded = make()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(shielded), 0.02)
        threading.Timer(0.01, shielded.set_result, args=("s",)).start()
        task = asyncio.ensure_future(shielded)
        assert await task == "s"

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_callback_runs_where_concurrent_futures_runs_it_but_asyncios_own_in_its_loop(make):
    async def main():
        fut, seen = make(), []
        fut.add_done_callback(lambda f: seen.append(("user", threading.get_ident())))

        def of_asyncio(f):
            seen.append(("asyncio", threading.get_ident()))

        of_asyncio.__module__ = "asyncio.tasks"  # (as asyncio.wait's own callback is)
        fut.add_done_callback(of_asyncio)
        t = threading.Thread(target=fut.set_result, args=(1,))
        t.start()
        t.join()
        # a user's callback runs in the completing thread, even one added in a coroutine
        # (the loop's thread may be blocked: tests/executor/test_driver.py); asyncio's in its loop,
        # which the other thread woke
        assert seen == [("user", t.ident)]
        await asyncio.sleep(0.01)
        assert seen == [("user", t.ident), ("asyncio", threading.get_ident())]
        fut.add_done_callback(lambda f: seen.append("now"))  # done: at once, here
        assert seen[-1] == "now"

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_future_awaited_in_a_loop_that_closed_still_completes(make, errors_logged):
    awaited, ran = make(), []

    def of_asyncio(f):  # (stands for asyncio.wait's callback, left behind by a dead loop)
        ran.append("asyncio's, in a closed loop")

    of_asyncio.__module__ = "asyncio.tasks"

    async def main():
        awaited.add_done_callback(lambda f: ran.append("in the loop"))
        awaited.add_done_callback(of_asyncio)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(awaited, 0.01)
        asyncio.ensure_future(awaited)  # still awaited when asyncio.run cancels it

    awaited.add_done_callback(lambda f: ran.append("thread"))
    asyncio.run(main())
    # completed in the thread that ran the loop (a blocking caller reading replies)...
    assert awaited._complete("late", None)
    awaited._hand_off()
    awaited._run_callbacks()
    assert awaited.result() == "late"
    assert sorted(ran) == ["in the loop", "thread"]  # asyncio's went with its loop
    # ...and from another thread, by hand
    other = make()

    async def await_other():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(other, 0.01)

    asyncio.run(await_other())
    t = threading.Thread(target=other.set_result, args=(2,))
    t.start()
    t.join()
    assert other.result() == 2 and errors_logged() == []


def test_a_loop_that_awaited_in_one_thread_is_woken_in_another(make):
    loop = asyncio.new_event_loop()
    fut = make()
    resumed = []

    async def awaiting():
        got = await fut
        resumed.append((got, threading.get_ident(), time.monotonic()))

    task = loop.create_task(awaiting())
    loop.run_until_complete(asyncio.sleep(0.01))  # here: the task awaits the future
    assert not task.done()

    def run_elsewhere():
        loop.call_later(5, lambda: None)  # (a bound on the test: the loop wakes by then)
        loop.run_until_complete(task)

    other = threading.Thread(target=run_elsewhere)
    other.start()
    time.sleep(0.1)  # the loop now sleeps in the other thread
    completed_at = time.monotonic()
    fut.set_result("moved")  # here, in the thread where the loop awaited first
    other.join(10)
    try:
        assert resumed and resumed[0][:2] == ("moved", other.ident)
        assert resumed[0][2] - completed_at < 1.0, "the loop was not woken"
    finally:
        loop.close()


def test_under_uvloop(make):
    uvloop = pytest.importorskip("uvloop")

    async def main():
        futs = [make() for _ in range(20)]
        for i, f in enumerate(futs):
            if i % 2:
                asyncio.get_running_loop().call_soon(f.set_result, i)  # in the loop
            else:
                threading.Timer(0.005, f.set_result, args=(i,)).start()
        assert await asyncio.gather(*futs) == list(range(20))
        slow, fast = make(), make()
        threading.Timer(0.01, fast.set_result, args=("f",)).start()
        done, pending = await asyncio.wait([slow, fast], return_when=asyncio.FIRST_COMPLETED,
                                           timeout=5)
        assert split(done, pending, [fast], [slow])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slow, 0.01)
        task = asyncio.ensure_future(slow)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        slow.set_result("late")  # dropped by the cancelled tasks
        await asyncio.sleep(0)
        assert slow.result() == "late"
        done_first = make()
        done_first.set_result("d")
        assert await done_first == "d"
        assert [await c for c in asyncio.as_completed([done_first, fast])] in \
            (["d", "f"], ["f", "d"])

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(main(), 20))
    finally:
        loop.close()
