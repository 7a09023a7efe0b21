"""A timeout, a cancel or a nudge never consumes part of a message: the next read resumes
it (both rings, ZeroMQ), and ``nudge()`` ends a reader's wait at once, once.

The writers run in child processes: one stopped (SIGSTOP) with its message half written,
one that streams its message slowly (``enqueue_stream`` of a slow generator), one that
waits for the test's word halfway. The readers are this process's.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time

import _procs
import pytest

import mpx
from mpx.errors import WaitNudged
from mpx.protocol import serde

KEY = "test-key-" + "p" * 20
CHUNK = 64 << 10   # ring slots (and ZeroMQ chunks) of 64 KiB ...
SLOTS = 4          # ... four of them: a 40-slot message is ten rings' worth
SLACK = 0.05       # the scheduler's share, on top of the 50 ms a deadline may take


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


# ---------------------------------------------------------------- child processes


def whole_writer(size, seed, chunk, slots, conn):
    """Enqueue one message of ``size`` bytes (the test stops this process while it waits
    for ring space), then hold the queue open until the test says "bye"."""
    q = mpx.MessageQueue(1, 1, max_chunk_bytes=chunk, max_chunks=slots)
    try:
        conn.send((q.export_handle(), os.getpid()))
        q.wait_until_ready(30)
        q.enqueue(payload(seed, size), timeout=60)
        conn.send("sent")
        conn.recv()
    finally:
        q.close()


def trickling_writer(n_pieces, gap_s, seed, conn):
    """Stream one message of ``n_pieces`` slots, a slot every ``gap_s`` seconds."""
    q = mpx.MessageQueue(1, 1, max_chunk_bytes=CHUNK, max_chunks=SLOTS)
    try:
        conn.send((q.export_handle(), os.getpid()))
        q.wait_until_ready(30)
        data = payload(seed, n_pieces * CHUNK)

        def pieces():
            for i in range(n_pieces):
                yield data[i * CHUNK:(i + 1) * CHUNK]
                time.sleep(gap_s)

        conn.recv()  # "go": the reader waits
        q.enqueue_stream(serde.K_BYTES, len(data), pieces(), timeout=60)
        conn.send("sent")
        conn.recv()
    finally:
        q.close()


def halting_zmq_writer(n_pieces, seed, conn):
    """Send one message of ``n_pieces`` chunks to a remote reader: half of them, then
    "half", then the rest once the test says "go"."""
    q = mpx.MessageQueue(1, 0, max_chunk_bytes=CHUNK, max_chunks=SLOTS)
    try:
        conn.send((q.export_handle(), os.getpid()))
        q.wait_until_ready(30)
        data = payload(seed, n_pieces * CHUNK)

        def pieces():
            for i in range(n_pieces):
                if i == n_pieces // 2:
                    conn.send("half")
                    conn.recv()
                yield data[i * CHUNK:(i + 1) * CHUNK]

        q.enqueue_stream(serde.K_BYTES, len(data), pieces(), timeout=60)
        conn.send("sent")
        conn.recv()
    finally:
        q.close()


def one_slot_messages(seed):
    """Messages that fit one slot: small ones (copied out of the slot) and ones of
    8 KiB and up (decoded in place)."""
    return [("small", i) for i in range(10)] + [payload(seed + i, 20_000) for i in range(10)]


def mixed_writer(seed, conn):
    """One-slot messages, then one of 20 slots that pauses for a second half way, then
    the one-slot messages again."""
    q = mpx.MessageQueue(1, 1, max_chunk_bytes=CHUNK, max_chunks=SLOTS)
    try:
        conn.send((q.export_handle(), os.getpid()))
        q.wait_until_ready(30)
        big = payload(seed, 20 * CHUNK)

        def pieces():
            yield big[:10 * CHUNK]
            time.sleep(1)
            yield big[10 * CHUNK:]

        for m in one_slot_messages(seed):
            q.enqueue(m, timeout=60)
        q.enqueue_stream(serde.K_BYTES, len(big), pieces(), timeout=60)
        for m in one_slot_messages(seed):
            q.enqueue(m, timeout=60)
        conn.send("sent")
        conn.recv()
    finally:
        q.close()


# ---------------------------------------------------------------- helpers


class Writer:
    """A writer child and the reader queue of this process attached to it."""

    def __init__(self, ctx, target, *args, config=None, key=None):
        if key is None:
            self.proc, self.conn = _procs.start(ctx, target, *args)
        else:
            self.proc, self.conn = _procs.start(ctx, _procs.with_key, key, target, *args)
        assert self.conn.poll(60), "the writer never sent its handle"
        handle, self.pid = self.conn.recv()
        self.q = mpx.MessageQueue.create_from_handle(handle, 0, config=config)
        self.q.wait_until_ready(30)
        self.stopped = False

    def stop(self):
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self):
        if self.stopped:
            os.kill(self.pid, signal.SIGCONT)
            self.stopped = False

    def expect(self, what, timeout=60):
        assert self.conn.poll(timeout), f"the writer never said {what!r}"
        assert self.conn.recv() == what

    def close(self):
        self.cont()
        try:
            self.conn.send("bye")
        except OSError:
            pass
        self.q.close()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


@pytest.fixture
def writers(ctx):
    made = []

    def make(*args, **kw):
        w = Writer(ctx, *args, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def timed(fn, *args, **kw):
    """``(exception or None, result, seconds)`` of ``fn(*args, **kw)``."""
    t0 = time.monotonic()
    try:
        out = fn(*args, **kw)
    except Exception as e:
        return e, None, time.monotonic() - t0
    return None, out, time.monotonic() - t0


def later(seconds, fn):
    """Run ``fn`` in a thread after ``seconds``; the thread, to join."""
    t = threading.Timer(seconds, fn)
    t.start()
    return t


def stopped_half_way(writers, size, seed, chunk=CHUNK, slots=SLOTS):
    """A writer stopped with ``size`` bytes half written, none of it read yet: the ring
    is full (``slots`` slots of a message of many) when it stops."""
    w = writers(whole_writer, size, seed, chunk, slots)
    ring = w.q._reader._ring
    assert _procs.until(lambda: ring.published() >= slots, 30), "the writer never filled the ring"
    w.stop()
    return w


# ---------------------------------------------------------------- (a) rings: deadlines


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunk, slots", [(CHUNK, SLOTS), (1 << 20, 16)],
                         ids=["small-ring", "default-ring"])
def test_a_deadline_holds_over_a_stopped_writer_and_the_next_read_resumes(impl, writers,
                                                                          chunk, slots):
    """A 40-slot message whose writer stops once the ring is full; at the default
    geometry, the issue's case: 40 MiB through 16 slots of 1 MiB."""
    size = 40 * chunk
    w = stopped_half_way(writers, size, 1, chunk, slots)
    for timeout in (0.3, 0.2):  # the second read resumes the first's message, and stops too
        err, _, took = timed(w.q.dequeue, timeout=timeout)
        assert type(err) is mpx.QueueTimeout, err
        assert timeout <= took < timeout + 0.05 + SLACK, took
    w.cont()
    err, got, _ = timed(w.q.dequeue, timeout=30)
    assert err is None, err
    assert got == payload(1, size)  # every byte, in order: nothing was lost to the timeouts
    w.expect("sent")


@pytest.mark.timeout(120)
def test_dequeue_ready_takes_no_wait_for_the_rest_of_a_message(impl, writers):
    size = 40 * CHUNK
    w = stopped_half_way(writers, size, seed=2)
    for timeout in (0.0, 0.2):  # (the reads that came before: none, or one that timed out)
        if timeout:
            with pytest.raises(mpx.QueueTimeout):
                w.q.dequeue(timeout=timeout)
        rescue = later(3, w.cont)  # (the old code waited for the writer: bound that wait)
        try:
            err, got, took = timed(w.q.dequeue_ready, lambda e: e)
        finally:
            rescue.cancel()
            rescue.join()
        assert err is None and not got and took < 1, (err, took, len(got or ()))
    w.cont()
    assert w.q.dequeue(timeout=30) == payload(2, size)


@pytest.mark.timeout(120)
def test_a_deadline_holds_over_a_trickling_writer(impl, writers):
    n = 60
    w = writers(trickling_writer, n, 0.01, 3)
    w.conn.send("go")
    err, _, took = timed(w.q.dequeue, timeout=0.25)
    assert type(err) is mpx.QueueTimeout, err
    assert took < 0.25 + 0.05 + SLACK, took
    assert w.q.dequeue(timeout=30) == payload(3, n * CHUNK)
    w.expect("sent")


# ---------------------------------------------------------------- (b) rings: cancel, nudge


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["cancel", "nudge"])
def test_a_cancel_or_nudge_between_slots_keeps_the_message(impl, writers, how):
    """The writer streams a slot every 10 ms, faster than the reader's cancel slice:
    the cancel (or the nudge) still ends the read at once, in the middle of the message."""
    n = 150
    w = writers(trickling_writer, n, 0.01, 4)
    cancel = threading.Event()
    w.conn.send("go")
    t = later(0.3, cancel.set if how == "cancel" else w.q.nudge)
    try:
        err, _, took = timed(w.q.dequeue, timeout=30, cancel=cancel if how == "cancel" else None)
    finally:
        t.join()
    expected = mpx.Cancelled if how == "cancel" else WaitNudged
    assert type(err) is expected, err
    assert 0.28 <= took < 0.3 + 0.05 + SLACK, took  # (the timer started first)
    assert w.q.dequeue(timeout=30) == payload(4, n * CHUNK)
    w.expect("sent")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["cancel", "nudge"])
def test_a_cancel_or_nudge_over_a_stopped_writer_keeps_the_message(impl, writers, how):
    size = 40 * CHUNK
    w = stopped_half_way(writers, size, seed=5)
    cancel = threading.Event()
    t = later(0.2, cancel.set if how == "cancel" else w.q.nudge)
    try:
        err, _, took = timed(w.q.dequeue, timeout=30, cancel=cancel if how == "cancel" else None)
    finally:
        t.join()
    assert type(err) is (mpx.Cancelled if how == "cancel" else WaitNudged), err
    assert 0.18 <= took < 0.2 + 0.05 + SLACK, took  # (the timer started first)
    w.cont()
    assert w.q.dequeue(timeout=30) == payload(5, size)


# ---------------------------------------------------------------- (c) ZeroMQ


@pytest.fixture
def cfg():
    return mpx.Config(auth_key=KEY, heartbeat_s=5.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["timeout", "cancel", "nudge", "ready"])
def test_zmq_a_read_stopped_part_way_is_resumed_whole(writers, cfg, how):
    n = 12
    w = writers(halting_zmq_writer, n, 6, config=cfg, key=KEY)
    w.expect("half")
    time.sleep(0.2)  # (the first half arrives)
    cancel = threading.Event()
    if how == "ready":
        go = later(3, lambda: w.conn.send("go"))  # (the old code waited for the rest)
        try:
            err, got, took = timed(w.q.dequeue_ready, lambda e: e)
        finally:
            go.cancel()
            go.join()
        assert err is None and not got and took < 1, (err, took, len(got or ()))
    else:
        t = later(0.3, {"timeout": int, "cancel": cancel.set, "nudge": w.q.nudge}[how])
        try:
            err, _, took = timed(w.q.dequeue, timeout=0.3 if how == "timeout" else 30,
                                 cancel=cancel if how == "cancel" else None)
        finally:
            t.join()
        expected = {"timeout": mpx.QueueTimeout, "cancel": mpx.Cancelled,
                    "nudge": WaitNudged}[how]
        assert type(err) is expected, err
        # (the timer started first; a remote reader polls every 20 ms)
        assert 0.28 <= took < 0.3 + 0.05 + SLACK, took
    w.conn.send("go")
    assert w.q.dequeue(timeout=30) == payload(6, n * CHUNK)
    w.expect("sent")
    assert w.q._reader.drops.count == 0  # no chunk was taken for a stray


# ---------------------------------------------------------------- (d) nudge


@pytest.fixture(params=["shm", "zmq"])
def pair(request, impl, cfg):
    """A writer queue and its reader, in this process, over shared memory or ZeroMQ;
    ``pair(**reader_config)``."""
    made = []

    def make(**kw):
        zmq = request.param == "zmq"
        wcfg = dataclasses.replace(cfg, transport="zmq") if zmq else cfg
        w = mpx.MessageQueue(1, 1, config=wcfg)
        made.append(w)
        r = mpx.MessageQueue.create_from_handle(w.export_handle(), 0,
                                                config=dataclasses.replace(cfg, **kw))
        made.append(r)
        w.wait_until_ready(30)
        r.wait_until_ready(30)
        return w, r, zmq

    yield make
    for q in reversed(made):
        q.close()


@pytest.mark.timeout(60)
def test_nudge_wakes_a_parked_reader_at_once_and_loses_nothing(pair):
    # a 5 s liveness poll: only the nudge's futex wake explains a prompt return
    w, r, zmq = pair(liveness_poll_ms=5000)
    out = {}

    def read():
        out["err"], _, _ = timed(r.dequeue, timeout=30)
        out["at"] = time.monotonic()

    t = threading.Thread(target=read)
    t.start()
    if zmq:
        time.sleep(0.2)
    else:
        assert _procs.until(lambda: _procs.reader_parked(r._reader._mm), 10)
    t0 = time.monotonic()
    r.nudge()
    t.join(10)
    assert type(out["err"]) is WaitNudged, out["err"]
    assert out["at"] - t0 < (0.02 + 0.05 if zmq else 0.05), out["at"] - t0
    w.enqueue("after the nudge")
    assert r.dequeue(timeout=10) == "after the nudge"
    err, _, took = timed(r.dequeue, timeout=0.2)  # the nudge was taken: a plain wait now
    assert type(err) is mpx.QueueTimeout and took >= 0.2, (err, took)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", [dict(spin_us=10_000, yield_us=0),  # spin, then park
                                   dict(yield_us=500_000),            # yield
                                   dict(yield_us=0)])                 # park
def test_a_nudge_with_no_waiter_ends_the_next_wait_once(pair, phase):
    w, r, zmq = pair(liveness_poll_ms=5000, **phase)
    r.nudge()
    w.enqueue("ready")
    assert _procs.until(r.poll, 10)  # (over TCP: once it arrived, the read need not wait)
    assert r.dequeue(timeout=10) == "ready"  # a read that does not wait leaves the nudge
    assert r.dequeue_ready(lambda e: e) == []  # so does one that never waits
    err, _, took = timed(r.dequeue, timeout=10)
    assert type(err) is WaitNudged and took < 0.1, (err, took)  # at once
    err, _, took = timed(r.dequeue, timeout=0.2)
    assert type(err) is mpx.QueueTimeout and not isinstance(err, WaitNudged), err
    assert took >= 0.2  # once
    w.enqueue("still there")
    assert r.dequeue(timeout=10) == "still there"


def test_nudge_is_for_readers_and_nothing_once_closed(impl):
    with mpx.MessageQueue(1, 1) as w:
        r = mpx.MessageQueue.create_from_handle(w.export_handle(), 0)
        with pytest.raises(mpx.RoleError):
            w.nudge()
        r.close()
        r.nudge()  # (a late nudge from another thread is harmless)


@pytest.mark.timeout(60)
def test_acquire_read_is_nudged_too(impl):
    with mpx.MessageQueue(1, 1) as w:
        r = mpx.MessageQueue.create_from_handle(w.export_handle(), 0)
        try:
            w.wait_until_ready(10)
            r.nudge()
            with pytest.raises(WaitNudged):
                with r.acquire_read(timeout=10):
                    pass
            w.enqueue(b"x")
            with r.acquire_read(timeout=10) as view:
                assert len(view) > 0
        finally:
            r.close()


# ---------------------------------------------------------------- (e) the hot path


@pytest.mark.timeout(120)
def test_one_slot_messages_still_round_trip_around_a_resumed_one(impl, writers):
    """Small (copied) and in-place (lent) one-slot messages, before and after a message
    that a timeout left half read."""
    w = writers(mixed_writer, 7)
    for m in one_slot_messages(7):
        assert w.q.dequeue(timeout=30) == m
    with pytest.raises(mpx.QueueTimeout):
        w.q.dequeue(timeout=0.3)  # (the writer pauses half way through the big one)
    assert w.q.dequeue(timeout=30) == payload(7, 20 * CHUNK)
    for m in one_slot_messages(7):
        assert w.q.dequeue(timeout=30) == m
    w.expect("sent")
