"""The driver's rules (mpx/_driver/calls.py's docstring), each across real worker processes:
no user code under an mpx lock, no caller waiting for ring room, every deadline kept, no
half-read message lost, and an interrupt in the pump failing at most its own call."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import _env
import pytest
from _env import START_METHOD
from _rules_workers import Journal

import mpx
from mpx.errors import WaitNudged

TESTS = _env.TESTS


# ----------------------------------------------------------------- rule 2: never wait for room

def test_non_blocking_calls_never_wait_for_ring_room_and_run_in_order(executor):
    e = executor(Journal, max_chunks=4)
    t0 = time.monotonic()
    futs = [e.collective_rpc("log", args=(i, 0.02), non_block=True) for i in range(40)]
    took = time.monotonic() - t0
    assert took < 0.5, f"40 non-blocking calls took {took:.2f} s to return"
    pending = e.pending_calls()
    assert pending.queued > 0 and pending.in_flight > 0
    assert pending.in_flight + pending.queued <= 40
    assert [f.result(timeout=30) for f in futs] == [[i, i] for i in range(40)]
    assert e.collective_rpc("journal") == [list(range(40))] * 2
    assert e.pending_calls() == (0, 0)


def test_an_event_loop_stays_responsive_while_the_ring_is_full(executor):
    """Handlers of a server send more calls than the ring holds: the loop keeps ticking."""
    e = executor(Journal, max_chunks=2)

    async def main():
        gaps, last = [], time.monotonic()
        stop = False

        async def ticker():
            nonlocal last
            while not stop:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        futs = [e.collective_rpc("log", args=(i, 0.05), non_block=True) for i in range(20)]
        out = await asyncio.gather(*futs)
        stop = True
        await tick
        return out, max(gaps)

    out, worst = asyncio.run(main())
    assert out == [[i, i] for i in range(20)]
    assert worst < 0.25, f"the event loop froze for {worst:.2f} s"


def test_a_blocking_call_behind_queued_ones_keeps_its_deadline_and_its_order(executor):
    e = executor(Journal, max_chunks=2)
    futs = [e.collective_rpc("log", args=(i, 0.1), non_block=True) for i in range(6)]
    t0 = time.monotonic()
    with pytest.raises(mpx.RPCTimeoutError) as ei:
        e.collective_rpc("log", args=("late",), timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 0.5
    assert "could take the call" in str(ei.value)
    assert e.collective_rpc("log", args=("after",), timeout=10) == ["after", "after"]
    assert [f.result(timeout=10) for f in futs] == [[i, i] for i in range(6)]
    assert e.collective_rpc("journal") == [list(range(6)) + ["after"]] * 2


def test_a_large_non_blocking_call_queued_streams_in_order(executor):
    """A call larger than the whole ring goes out from the sender thread, in order."""
    e = executor(Journal, max_chunks=2, max_chunk_bytes=1 << 16)
    blob = bytes(range(256)) * 4096  # 1 MiB: 8 rings' worth
    futs = [e.collective_rpc("log", args=(i, 0.01), non_block=True) for i in range(3)]
    big = e.collective_rpc("ident", args=(blob,), non_block=True)
    after = e.collective_rpc("log", args=("after",), non_block=True)
    assert big.result(timeout=30) == [blob, blob]
    assert after.result(timeout=30) == ["after", "after"]
    assert [f.result(timeout=30) for f in futs] == [[i, i] for i in range(3)]
    assert e.collective_rpc("journal") == [[0, 1, 2, "after"]] * 2


# ----------------------------------------------------------------- rule 1: no user code under a lock

def test_a_done_callback_that_sends_while_another_thread_sends_never_deadlocks(executor):
    e = executor(Journal, max_chunks=2)
    done = threading.Event()
    results: list = []
    errors: list = []

    def again(f):
        try:
            results.append(e.collective_rpc("ident", args=(f.result(),), timeout=20))
            results.append(e.collective_rpc("ident", args=(1,), non_block=True).result(20))
        except BaseException as ex:  # noqa: BLE001 (reported below)
            errors.append(ex)
        finally:
            if len(results) + len(errors) >= 2 * 20:
                done.set()

    def spam():
        for i in range(50):
            e.collective_rpc("log", args=(i,), timeout=20)

    t = threading.Thread(target=spam)
    t.start()
    for i in range(20):
        e.collective_rpc("log", args=(i, 0.005), non_block=True).add_done_callback(again)
    t.join(30)
    assert not t.is_alive()
    assert done.wait(30), "callbacks that call again deadlocked"
    assert not errors, errors


def test_a_done_callback_may_wait_on_a_later_future(executor):
    e = executor(Journal)
    later: list = []
    got = threading.Event()
    values: list = []

    def wait_for_later(f):
        values.append(later[0].result(timeout=10))
        got.set()

    first = e.collective_rpc("log", args=("first", 0.05), non_block=True)
    first.add_done_callback(wait_for_later)
    later.append(e.collective_rpc("log", args=("later", 0.2), non_block=True))
    assert got.wait(10), "a callback waiting on another future held its reply up"
    assert values == [["later", "later"]]


def test_a_blocking_callback_holds_up_no_reply(executor):
    """A callback that blocks (here until the test lets it go) holds up later callbacks,
    never the replies: result() of other futures and blocking calls go on."""
    e = executor(Journal)
    release = threading.Event()
    first = e.collective_rpc("ident", args=(1,), non_block=True)
    first.add_done_callback(lambda f: release.wait(20))
    first.result(timeout=10)
    more = [e.collective_rpc("ident", args=(i,), non_block=True) for i in range(10)]
    assert [f.result(timeout=10) for f in more] == [[i, i] for i in range(10)]
    assert e.collective_rpc("ident", args=(2,), timeout=10) == [2, 2]
    ran = threading.Event()
    more[0].add_done_callback(lambda f: ran.set())  # done already: runs here, at once
    assert ran.is_set()
    release.set()


def test_done_callbacks_run_on_the_callback_thread_in_completion_order(executor):
    e = executor(Journal)
    seen: list = []
    all_done = threading.Event()

    def note(i):
        def cb(f):
            seen.append((i, threading.current_thread().name))
            if len(seen) == 30:
                all_done.set()
        return cb

    # (a future done already runs its callback at once, here: the calls wait behind a sleep
    # until every callback is added)
    e.collective_rpc("sleep", args=(0.5,), non_block=True)
    for i in range(30):
        e.collective_rpc("ident", args=(i,), non_block=True).add_done_callback(note(i))
    assert all_done.wait(20)
    assert [i for i, _ in seen] == list(range(30))
    assert {name for _, name in seen} == {"mpx-callbacks"}


# ----------------------------------------------------------------- rule 3: every deadline holds

def test_a_later_call_with_an_earlier_deadline_shortens_the_readers_wait(executor):
    """Nobody waits: the background reader reads for an older call without a deadline, and
    a newer one's deadline still fires on time."""
    e = executor(Journal)
    slow = e.collective_rpc("sleep", args=(3.0,), non_block=True)
    time.sleep(0.1)  # the background reader parks on the slow call
    failed_at: list = []
    t0 = time.monotonic()
    fut = e.collective_rpc("ident", args=(1,), timeout=0.3, non_block=True)
    fut.add_done_callback(lambda f: failed_at.append(time.monotonic()))
    deadline = time.monotonic() + 5
    while not failed_at and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failed_at, "the deadline never fired"
    assert failed_at[0] - t0 < 0.3 + 0.1, f"fired after {failed_at[0] - t0:.2f} s"
    assert isinstance(fut.exception(0), mpx.RPCTimeoutError)
    assert slow.result(timeout=10) == [0, 1]


def test_a_half_written_reply_does_not_hold_a_deadline(executor):
    """A worker stopped part way through writing a large reply: the call still times out
    on time, and once the worker goes on the executor works (the rest is read and
    dropped)."""
    e = executor(Journal, max_chunks=4, max_chunk_bytes=1 << 20)
    pids = e.collective_rpc("pid")
    t0 = time.monotonic()
    try:
        with pytest.raises(mpx.RPCTimeoutError):
            e.collective_rpc("big", args=(256 << 20, 0.02), timeout=1.5)
        took = time.monotonic() - t0
        assert took < 1.5 + 0.3, f"the deadline held for {took:.2f} s"
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert e.collective_rpc("ident", args=(7,), timeout=30) == [7, 7]


# ----------------------------------------------------------------- rule 5: interrupts

class _Interrupt:
    def __init__(self, exc):
        self.exc = exc

    def __call__(self, results):
        raise self.exc


def test_an_interrupt_in_an_aggregator_fails_only_its_call(executor):
    e = executor(Journal)
    with pytest.raises(KeyboardInterrupt):
        e.collective_rpc("ident", args=(1,), aggregator=_Interrupt(KeyboardInterrupt()))
    fut = e.collective_rpc("ident", args=(2,), aggregator=_Interrupt(SystemExit(3)),
                           non_block=True)
    with pytest.raises(SystemExit):
        fut.result(timeout=10)
    futs = [e.collective_rpc("ident", args=(i,), non_block=True) for i in range(5)]
    assert [f.result(timeout=10) for f in futs] == [[i, i] for i in range(5)]
    assert e.collective_rpc("ident", args=(3,), aggregator=sum) == 6
    assert not e.is_failed


_STORM = textwrap.dedent("""
    import faulthandler, os, signal, sys, threading, time
    faulthandler.dump_traceback_later(60, exit=True)  # a hang shows where, within the timeout
    sys.path.insert(0, {tests!r})
    import mpx
    from _rules_workers import Journal

    def main():
        hits = 0
        with mpx.Executor(Journal, 2, start_method={start!r}) as ex:
            stop = threading.Event()
            def storm():
                while not stop.wait(0.003):
                    os.kill(os.getpid(), signal.SIGINT)
            t = threading.Thread(target=storm, daemon=True)
            t.start()
            t_end = time.monotonic() + 3
            done = False
            while not done:
                try:
                    while time.monotonic() < t_end:
                        try:
                            i = hits
                            assert ex.collective_rpc("ident", args=(i,), timeout=10) == [i, i]
                            f = ex.collective_rpc("ident", args=(i,), non_block=True,
                                                  timeout=10, aggregator=lambda r: r)
                            assert f.result(timeout=10) == [i, i]
                        except KeyboardInterrupt:
                            hits += 1
                        except mpx.RPCTimeoutError:
                            pass
                    done = True
                except KeyboardInterrupt:  # one that came between two calls, or in a handler
                    hits += 1
            while t.is_alive() or not done:  # the storm's last interrupts, wherever they land
                try:
                    stop.set()
                    t.join()
                    time.sleep(0.05)
                    done = True
                except KeyboardInterrupt:
                    done = False
            assert not ex.is_failed
            for i in range(20):
                assert ex.collective_rpc("ident", args=(i,), timeout=10) == [i, i]
            futs = [ex.collective_rpc("ident", args=(i,), non_block=True) for i in range(20)]
            assert [f.result(timeout=10) for f in futs] == [[i, i] for i in range(20)]
        print("interrupts", hits)

    if __name__ == "__main__":
        main()
""")


def test_a_ctrl_c_storm_leaves_the_executor_usable(tmp_path):
    script = tmp_path / "storm.py"
    script.write_text(_STORM.format(tests=TESTS, start=START_METHOD))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    hits = int(out.stdout.split("interrupts")[1])
    assert hits > 20, out.stdout


def test_a_hand_over_an_interrupt_cut_short_is_made_up(executor):
    """What an interrupt can leave (mpx/_driver/pump.py's rules): a baton its thread still
    holds (where Baton is not compiled), which that thread lets go when it next comes to
    read; and a hand-over whose wake-up never came, which the waiting threads make up by
    looking again (TURN_RECHECK_S), not at their calls' deadlines."""
    e = executor(Journal)
    calls = e._group.calls
    assert calls.baton.take()  # left held, as by a hand-over cut short in this thread
    assert e.collective_rpc("ident", args=(1,), timeout=10) == [1, 1]
    assert not calls.baton.locked()
    assert calls.baton.take()
    got: list = []
    t = threading.Thread(target=lambda: got.append(
        e.collective_rpc("ident", args=(2,), timeout=30)))
    t.start()
    time.sleep(0.3)  # it sleeps on `turn`: another thread holds the baton
    assert not got
    assert calls.baton.let_go()  # let go, and nobody told
    t0 = time.monotonic()
    t.join(10)
    assert got == [[2, 2]] and time.monotonic() - t0 < 5


# ----------------------------------------------------------------- rule 4: no half-read message lost

@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_large_reply_survives_the_background_reader_giving_way(executor, transport):
    """The background reader is part way through a large reply when a thread starts to
    wait for it (the reader gives way, nudged): the reply arrives whole, once."""
    e = executor(Journal, transport=transport, max_chunk_bytes=1 << 20)
    for _ in range(3):
        fut = e.collective_rpc("big", args=(48 << 20,), non_block=True)
        time.sleep(0.02)  # the background reader starts on it
        got = fut.result(timeout=60)
        assert [len(b) for b in got] == [48 << 20] * 2
    assert e.collective_rpc("ident", args=(1,), timeout=10) == [1, 1]


def _read_as_the_pump(q, timeout):
    """The next message of ``q``, read as the baton's holder reads: a wait nudged by a sender
    (a new call with a deadline: mpx/_driver/pump.py) is looked at again, not an error."""
    until = time.monotonic() + timeout
    while True:
        try:
            return q.dequeue(timeout=max(0.0, until - time.monotonic()))
        except WaitNudged:
            continue


def test_a_reply_read_and_lost_fails_its_call_alone(executor):
    """Every rank answers every call in order, so a reply read and never recorded (an
    interrupt between the two) shows as a gap at that rank's next reply: the call that
    lost it fails with ReplyLostError naming the rank, the later ones get their results.
    (The reply is taken here behind the table's back, holding its baton meanwhile.)"""
    e = executor(Journal)
    calls = e._group.calls
    assert calls.baton.take(5)
    try:
        first = e.collective_rpc("ident", args=(1,), non_block=True)
        second = e.collective_rpc("ident", args=(2,), non_block=True)
        blocking_later = []
        t = threading.Thread(target=lambda: blocking_later.append(
            e.collective_rpc("ident", args=(3,), timeout=20)))
        t.start()
        assert _read_as_the_pump(e._group.resp[1], 10)[0] == first._call.seq  # lost
    finally:
        assert calls.baton.let_go()
    with pytest.raises(mpx.ReplyLostError) as ei:
        first.result(timeout=10)
    assert ei.value.rank == 1 and "rank 1" in str(ei.value)
    assert second.result(timeout=10) == [2, 2]
    t.join(20)
    assert blocking_later == [[3, 3]]
    assert not e.is_failed and e.pending_calls() == (0, 0)


def test_done_callbacks_keep_completion_order_while_other_threads_complete_calls(executor):
    """Callers' blocking calls, the background reader and a caller's send each set the
    futures of the calls they settled: whichever thread takes a batch, the callbacks run in
    the order the calls were settled (call order here: replies come in order)."""
    e = executor(Journal)
    seen: list = []
    stop = threading.Event()

    def blocking_caller():
        while not stop.is_set():
            e.collective_rpc("ident", args=(-1,), timeout=10)

    others = [threading.Thread(target=blocking_caller) for _ in range(2)]
    for t in others:
        t.start()
    try:
        futures = []
        for i in range(400):
            f = e.collective_rpc("ident", args=(i,), non_block=True)
            f.add_done_callback(
                lambda f, i=i: seen.append((i, threading.current_thread().name)))
            futures.append(f)
        for f in futures:
            f.result(timeout=30)
    finally:
        stop.set()
        for t in others:
            t.join(30)
    deadline = time.monotonic() + 10
    while len(seen) < 400 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(i for i, _ in seen) == list(range(400))
    # (a callback added to a future already finished runs at once in the caller)
    on_thread = [i for i, name in seen if name == "mpx-callbacks"]
    assert on_thread == sorted(on_thread)
