"""MessageQueue across real processes, for both ring implementations."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import random
import stat
import threading
import time
import weakref
import zlib

import _procs
import numpy as np
import pytest

import mpx
from mpx.mechanism import segments
from mpx.protocol import serde

pytestmark = pytest.mark.usefixtures("impl")


def join_all(procs, timeout=20):
    for p in procs:
        p.join(timeout)
        assert p.exitcode is not None, f"{p} did not exit"


def test_order_and_no_loss_three_readers_random_sizes(ctx):
    rnd = random.Random(7)
    n = 1500
    msgs = []
    for i in range(n):
        r = rnd.random()
        if r < 0.4:
            msgs.append(os.urandom(rnd.randrange(0, 200)))
        elif r < 0.7:
            msgs.append(os.urandom(rnd.randrange(0, 3 * 256 + 50)))
        elif r < 0.9:
            msgs.append(np.frombuffer(os.urandom(8 * rnd.randrange(0, 100)), dtype=np.float64))
        else:
            msgs.append(("tuple", i, b"x" * rnd.randrange(0, 600)))
    with mpx.MessageQueue(3, 3, max_chunk_bytes=256, max_chunks=2) as q:
        h = q.export_handle()
        procs = [_procs.start(ctx, _procs.checking_reader, h, r, n, 1) for r in range(3)]
        q.wait_until_ready(30)
        for m in msgs:
            if rnd.random() < 0.02:
                time.sleep(rnd.random() * 0.003)
            q.enqueue(m, timeout=30)
        expect = [_procs.summary(m) for m in msgs]
        for _, conn in procs:
            assert conn.poll(60)
            tag, got = conn.recv()
            assert tag == "done", got
            assert got == expect
        join_all([p for p, _ in procs])


@pytest.mark.parametrize("size_delta", [None, -1, 0, 1])
def test_boundaries(ctx, size_delta):
    chunk = 4096
    with mpx.MessageQueue(1, 1, max_chunk_bytes=chunk, max_chunks=4) as q:
        p, conn = _procs.start(ctx, _procs.echo_reader, q.export_handle(), 0)
        q.wait_until_ready(30)
        assert conn.recv()[0] == "ready"
        if size_delta is None:
            payloads = [b"", bytearray(), np.zeros(0, dtype=np.uint8)]
        else:
            # a raw bytes message fills the slot exactly at delta 0
            payloads = [os.urandom(chunk + size_delta), os.urandom(2 * chunk + size_delta)]
        for m in payloads:
            q.enqueue(m, timeout=10)
            assert conn.poll(30)
            assert conn.recv() == _procs.summary(m)
        q.enqueue(None)
        join_all([p])


def test_wake_readers_wakes_a_parked_reader_in_another_process(ctx):
    with mpx.MessageQueue(1, 1) as q:
        # the reader polls 0.3 s after a wake before it parks again
        p, conn = _procs.start(ctx, _procs.echo_reader_yielding, q.export_handle(), 0, 300_000)
        q.wait_until_ready(30)
        assert conn.recv()[0] == "ready"
        mm = q.writing_end()._mm

        def parked():
            return _procs.reader_parked(mm)

        assert _procs.until(parked, 10)
        q.wake_readers()
        assert _procs.until(lambda: not parked(), 0.25)  # woken ahead of any message
        assert _procs.until(parked, 10)                  # nothing came: parked again
        q.enqueue("then the message", timeout=10)
        assert conn.poll(30) and conn.recv() == _procs.summary("then the message")
        q.enqueue(None)
        join_all([p])
    with mpx.MessageQueue(1, 1) as q2, \
            mpx.MessageQueue.create_from_handle(q2.export_handle(), 0) as reader, \
            pytest.raises(mpx.RoleError, match="wake_readers"):
        reader.wake_readers()


def test_larger_than_whole_ring_50mib(ctx):
    big = np.frombuffer(os.urandom(50 << 20), dtype=np.uint8)
    raw = os.urandom(50 << 20)
    with mpx.MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=4) as q:
        p, conn = _procs.start(ctx, _procs.echo_reader, q.export_handle(), 0)
        q.wait_until_ready(30)
        conn.recv()
        for m in (big, raw):
            q.enqueue(m, timeout=60)
            assert conn.poll(60)
            assert conn.recv() == _procs.summary(m)
        q.enqueue(None)
        join_all([p])


def test_inband_object_unpickled_from_its_slot_is_owned_while_ring_laps(ctx):
    chunk, nchunks = 1 << 16, 4
    payload = os.urandom(40_000)  # in band, one slot, above the in-place size
    assert serde.encode(("first", payload), True)[0] == serde.K_PICKLE
    with mpx.MessageQueue(1, 1, max_chunk_bytes=chunk, max_chunks=nchunks) as q:
        p, conn = _procs.start(ctx, _procs.keep_inband_reader, q.export_handle(),
                               3 * chunk * nchunks)
        q.wait_until_ready(30)
        q.enqueue(("first", payload), timeout=30)
        for i in range(3 * nchunks * 2):
            q.enqueue((i, bytes([i % 256]) * 40_000), timeout=30)
        assert conn.poll(60)
        assert conn.recv() == ("unchanged", True, "first")
        join_all([p])


def test_received_array_is_owned_while_ring_laps(ctx):
    chunk, nchunks = 4096, 4
    with mpx.MessageQueue(1, 1, max_chunk_bytes=chunk, max_chunks=nchunks) as q:
        p, conn = _procs.start(ctx, _procs.keep_array_reader, q.export_handle(), 3 * chunk * nchunks)
        q.wait_until_ready(30)
        first = np.arange(chunk // 8, dtype=np.int64)
        q.enqueue(first, timeout=10)
        for i in range(3 * nchunks + 2):
            q.enqueue(np.full(chunk // 8, -i, dtype=np.int64), timeout=10)
        assert conn.poll(30)
        tag, unchanged, writeable, total = conn.recv()
        assert unchanged and writeable and total == int(first.sum())
        join_all([p])


def test_dequeue_timeout_and_cancel_and_shutdown_in_process(ctx):
    with mpx.MessageQueue(1, 1) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        try:
            t0 = time.monotonic()
            with pytest.raises(mpx.QueueTimeout):
                r.dequeue(timeout=0.2)
            assert 0.15 < time.monotonic() - t0 < 2
            assert isinstance(mpx.QueueTimeout("x"), TimeoutError)

            ev = threading.Event()
            errs = []

            def wait_cancel():
                try:
                    r.dequeue(cancel=ev, timeout=10)
                except Exception as e:
                    errs.append((e, time.monotonic()))

            t = threading.Thread(target=wait_cancel)
            t.start()
            time.sleep(0.3)
            t0 = time.monotonic()
            ev.set()
            t.join(5)
            assert isinstance(errs[0][0], mpx.Cancelled)
            assert errs[0][1] - t0 < 0.5

            # the queue is still usable after a timeout and a cancel
            q.enqueue("after")
            assert r.dequeue(timeout=5) == "after"

            t = threading.Thread(target=wait_cancel)
            errs.clear()
            ev.clear()
            t.start()
            time.sleep(0.3)  # parked
            t0 = time.monotonic()
            r.shutdown()
            t.join(5)
            assert isinstance(errs[0][0], mpx.Cancelled)
            assert isinstance(errs[0][0], RuntimeError)
            assert errs[0][1] - t0 < 0.5
        finally:
            r.close()


def test_writer_shutdown_leaves_readers_waiting_and_close_tells_them(ctx):
    # vLLM's meaning: a writer's shutdown() flags its own end only; close() tells readers
    q = mpx.MessageQueue(1, 1)
    try:
        p, conn = _procs.start(ctx, _procs.idle_reader, q.export_handle())
        assert conn.recv()[0] == "ready"
        q.wait_until_ready(10)
        time.sleep(0.3)
        q.shutdown()
        assert q.shutting_down
        assert not conn.poll(0.5)  # the parked reader keeps waiting
        t0 = time.monotonic()
        q.close()
        assert conn.poll(5)
        tag, etype, msg, t1 = conn.recv()
        assert (tag, etype) == ("error", "PeerDiedError"), msg
        assert "closed the queue" in msg
        assert t1 - t0 < 0.5
        join_all([p])
    finally:
        q.close()


def test_messages_before_writer_close_are_delivered_then_peer_died(ctx):
    parent, child = ctx.Pipe()
    w = ctx.Process(target=_procs.writer_process, args=(1, child, ["a", b"b" * 5000, "c"], "close"))
    w.start()
    h = parent.recv()
    r = mpx.MessageQueue.create_from_handle(h, 0)
    try:
        assert parent.poll(30) and parent.recv() == "sent"
        w.join(10)
        assert [r.dequeue(timeout=5) for _ in range(3)] == ["a", b"b" * 5000, "c"]
        with pytest.raises(mpx.PeerDiedError, match=f"pid {w.pid}"):
            r.dequeue(timeout=5)
    finally:
        r.close()


def test_messages_before_writer_shutdown_and_exit_then_peer_died(ctx):
    parent, child = ctx.Pipe()
    w = ctx.Process(target=_procs.writer_process, args=(1, child, [1, 2], "shutdown"))
    w.start()
    r = mpx.MessageQueue.create_from_handle(parent.recv(), 0)
    try:
        assert parent.poll(30) and parent.recv() == "sent"
        w.join(10)
        assert [r.dequeue(timeout=5), r.dequeue(timeout=5)] == [1, 2]
        with pytest.raises(mpx.PeerDiedError, match=f"pid {w.pid}"):
            r.dequeue(timeout=5)
    finally:
        r.close()


def test_segment_is_0600_and_unlinked_once_readers_attach(ctx):
    q = mpx.MessageQueue(2, 2)
    try:
        name = q.export_handle().shm["shm_name"]
        path = "/dev/shm" + name
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert name.startswith(f"/mpx-{os.getpid()}-")
        r0 = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        assert os.path.exists(path)
        with pytest.raises(mpx.HandleError, match="rank 0 cannot attach: reader 0 is already attached"):
            mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        r1 = mpx.MessageQueue.create_from_handle(q.export_handle(), 1)
        assert not os.path.exists(path)
        q.wait_until_ready(5)
        q.enqueue("still works")
        assert r0.dequeue(timeout=5) == r1.dequeue(timeout=5) == "still works"
        r0.close()
        r1.close()
    finally:
        q.close()


def test_keep_name_lets_another_process_take_a_dead_readers_place(ctx):
    """With keep_name (the executor's broadcast queues) the name outlives the readers'
    attaching: a reader that attached and was killed is replaced by a new process that
    attaches by name (reopen_reader); the writer's wait_until_ready unlinks it."""
    q = mpx.MessageQueue(2, 2, keep_name=True)
    procs = []
    try:
        path = "/dev/shm" + q.export_handle().shm["shm_name"]
        r0 = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        p, conn = _procs.start(ctx, _procs.echo_reader, q.export_handle(), 1)
        procs.append(p)
        assert conn.recv()[0] == "ready"
        assert os.path.exists(path)  # (every reader attached: kept all the same)
        os.kill(p.pid, 9)
        p.join(10)
        q.writing_end().reopen_reader(1)
        p, conn = _procs.start(ctx, _procs.echo_reader, q.export_handle(), 1)
        procs.append(p)
        assert conn.recv()[0] == "ready"
        q.wait_until_ready(5)
        assert not os.path.exists(path)
        q.enqueue(b"after")
        assert r0.dequeue(timeout=5) == b"after"
        assert conn.recv() == _procs.summary(b"after")
        q.enqueue(None)
        r0.close()
    finally:
        q.close()
        join_all(procs)


def test_a_kept_name_goes_with_the_last_reader_of_a_writer_killed(ctx):
    """A writer with keep_name SIGKILLed before it unlinked the name: the reader that
    closes after it did so unlinks it, and nothing is left in /dev/shm."""
    p, conn = _procs.start(ctx, _procs.keep_name_writer)
    try:
        handle = conn.recv()
        path = "/dev/shm" + handle.shm["shm_name"]
        r = mpx.MessageQueue.create_from_handle(handle, 0)
        assert os.path.exists(path)
        os.kill(p.pid, 9)
        p.join(10)
        r.close()
        assert not os.path.exists(path)
    finally:
        p.kill()
        p.join(10)


def test_wait_until_ready_names_missing_readers():
    with mpx.MessageQueue(3, 3) as q:
        r1 = mpx.MessageQueue.create_from_handle(q.export_handle(), 1)
        with pytest.raises(mpx.QueueTimeout, match=r"ranks \[0, 2\]"):
            q.wait_until_ready(timeout=0.2)
        r1.close()


def test_bad_input_typed_errors_and_queue_stays_usable():
    q = mpx.MessageQueue(1, 1)
    r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
    try:
        with pytest.raises(mpx.SerializationError, match="lock"):
            q.enqueue(threading.Lock())
        with pytest.raises(ValueError, match="reader rank"):
            mpx.MessageQueue.create_from_handle(q.export_handle(), 1)
        with pytest.raises(ValueError):
            mpx.MessageQueue.create_from_handle(q.export_handle(), -1)
        # every reader attached, so the name is gone: the error says why
        with pytest.raises(mpx.ShmError, match="already attached"):
            mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        import dataclasses
        old = dataclasses.replace(q.export_handle(), layout_version=999)
        with pytest.raises(mpx.HandleError, match="version"):
            mpx.MessageQueue.create_from_handle(old, 0)
        with pytest.raises(mpx.HandleError):
            mpx.MessageQueue.create_from_handle("not a handle", 0)
        with pytest.raises(mpx.RoleError):
            q.dequeue(timeout=0.1)
        with pytest.raises(mpx.RoleError):
            r.enqueue("x")
        assert r.export_handle() == q.export_handle()  # vLLM: a reader has its handle too
        with pytest.raises(ValueError):
            q.enqueue("x", timeout=-1)
        # nothing was half-written: the next message is the first one the reader sees
        q.enqueue({"ok": True})
        assert r.dequeue(timeout=5) == {"ok": True}
        # a lambda travels by cloudpickle
        q.enqueue(lambda x: x * 3)
        assert r.dequeue(timeout=5)(2) == 6
        # the handle is small and picklable
        assert len(pickle.dumps(q.export_handle())) < 1024
    finally:
        r.close()
        q.close()
    with pytest.raises(mpx.QueueClosedError):
        q.enqueue("x")
    with pytest.raises(mpx.QueueClosedError):
        r.dequeue()
    q.close()  # idempotent


def test_unpicklable_on_the_reader_side_leaves_queue_usable():
    with mpx.MessageQueue(1, 1) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        try:
            q.enqueue(Unloadable())
            with pytest.raises(mpx.DeserializationError):
                r.dequeue(timeout=5)
            q.enqueue("next")
            assert r.dequeue(timeout=5) == "next"
        finally:
            r.close()


class Unloadable:
    def __reduce__(self):
        return (_fail, ())


def _fail():
    raise RuntimeError("cannot rebuild")


def test_constructor_argument_errors():
    with pytest.raises(ValueError, match="authentication key"):
        mpx.MessageQueue(2, 1, config=mpx.Config(auth_key=""))
    with pytest.raises(ValueError, match="one node only"):
        mpx.MessageQueue(2, 1, config=mpx.Config(transport="shm"))
    with pytest.raises(ValueError):
        mpx.MessageQueue(1, 2)
    with pytest.raises(ValueError):
        mpx.MessageQueue(2, 2, local_reader_ranks=[0, 0])
    with pytest.raises(ValueError):
        mpx.MessageQueue(1, 1, max_chunk_bytes=100)
    with pytest.raises(ValueError):
        mpx.MessageQueue(1, 1, max_chunks=0)
    with pytest.raises(ValueError, match="local_reader_ranks"):
        mpx.MessageQueue(3, 2, local_reader_ranks=[0, 4])


def test_shm_error_when_ring_does_not_fit():
    free = segments.free_bytes()
    too_many = free // (1 << 30) + 2
    with pytest.raises(mpx.ShmError, match=r"free") as ei:
        mpx.MessageQueue(1, 1, max_chunk_bytes=1 << 30, max_chunks=too_many,
                         config=mpx.Config(transport="shm"))
    assert f"only {free} bytes free" in str(ei.value) or "bytes free" in str(ei.value)


def test_auto_transport_falls_back_to_zmq_when_shm_is_too_small():
    free = segments.free_bytes()
    cfg = mpx.Config(auth_key="k" * 16, max_chunk_bytes=1 << 30, max_chunks=free // (1 << 30) + 2)
    with pytest.warns(RuntimeWarning, match="ZeroMQ"):
        q = mpx.MessageQueue(1, 1, config=cfg)
    with q:
        h = q.export_handle()
        assert h.shm is None and h.zmq["zmq_ranks"] == (0,)
        r = mpx.MessageQueue.create_from_handle(h, 0, config=mpx.Config(auth_key="k" * 16))
        q.wait_until_ready(10)
        q.enqueue("over zmq")
        assert r.dequeue(timeout=5) == "over zmq"
        r.close()


def test_local_reader_ranks_map_to_global_ranks(ctx):
    with mpx.MessageQueue(2, 2, local_reader_ranks=[1, 0]) as q:
        r1 = mpx.MessageQueue.create_from_handle(q.export_handle(), 1)
        r0 = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        q.enqueue(zlib.crc32(b"x"))
        assert r0.dequeue(timeout=5) == r1.dequeue(timeout=5)
        assert r1.rank == 1
        r0.close()
        r1.close()


def test_broadcast_object_and_repr():
    with mpx.MessageQueue(1, 1) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        assert q.broadcast_object({"a": 1}) == {"a": 1}
        assert r.broadcast_object() == {"a": 1}
        assert "writer" in repr(q) and "rank=0" in repr(r)
        assert q.ring_implementation == mpx.ring_implementation()
        r.close()


def test_handle_with_other_geometry_is_refused():
    import dataclasses
    with mpx.MessageQueue(1, 1) as q:
        h = q.export_handle()
        bad = dataclasses.replace(h, shm={**h.shm, "max_chunks": 99})
        with pytest.raises(mpx.HandleError, match="max_chunks is 16, the handle says 99"):
            mpx.MessageQueue.create_from_handle(bad, 0)
        bad = dataclasses.replace(h, shm={**h.shm, "token": 1})
        with pytest.raises(mpx.HandleError, match="token"):
            mpx.MessageQueue.create_from_handle(bad, 0)
        # the real handle still attaches afterwards
        mpx.MessageQueue.create_from_handle(h, 0).close()


def test_missing_extension_falls_back_with_one_warning(tmp_path):
    import subprocess
    import sys
    # as without a C compiler: none of the extensions was built (the ring is missing, every
    # module of one source, a .py beside its extension, is its .py); importing mpx and using
    # it warns once in all
    code = (
        "import importlib.machinery as m, os, sys, warnings\n"
        "sys.modules['mpx._ring'] = None\n"
        "class SourceOnly:  # the modules of one source as their .py alone\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith('mpx.') and path:\n"
        "            spec = m.FileFinder(path[0], (m.SourceFileLoader, ['.py'])).find_spec(name)\n"
        "            if spec and any(os.path.exists(spec.origin[:-3] + x)\n"
        "                            for x in m.EXTENSION_SUFFIXES):\n"
        "                return spec\n"
        "sys.meta_path.insert(0, SourceOnly())\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import mpx, mpx._impl\n"
        "    a = mpx.ring_implementation(); b = mpx.ring_implementation()\n"
        "    from mpx._driver import future_core\n"
        "    c = future_core.IMPLEMENTATION\n"
        "    q = mpx.MessageQueue(1, 1); r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)\n"
        "    q.enqueue('x'); assert r.dequeue(timeout=5) == 'x'; r.close(); q.close()\n"
        "print(a, b, c, len(w), w[0].message if w else '')\n")
    env = {k: v for k, v in os.environ.items() if k != "MPX_PURE_PYTHON"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    a, b, c, n, msg = out.stdout.split(" ", 4)
    assert (a, b, c, n) == ("python", "python", "python", "1")
    assert "pip install" in msg


class _Alarm(Exception):
    pass


@pytest.mark.parametrize("delay", [0.0003, 0.3])  # during the sched_yield phase / parked
def test_signal_handler_runs_while_dequeue_waits(delay):
    import signal

    def on_alarm(signum, frame):
        raise _Alarm()

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        with mpx.MessageQueue(1, 1) as q:
            r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
            try:
                t0 = time.monotonic()
                with pytest.raises(_Alarm):  # (armed inside: 0.3 ms may end before a call)
                    signal.setitimer(signal.ITIMER_REAL, delay)
                    r.dequeue(timeout=10, indefinite=True)
                assert time.monotonic() - t0 < delay + 0.5
                q.enqueue("still usable")
                assert r.dequeue(timeout=5) == "still usable"
            finally:
                r.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_signal_handler_runs_while_enqueue_waits_for_space():
    import signal

    def on_alarm(signum, frame):
        raise _Alarm()

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        with mpx.MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2) as q:
            r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
            try:
                q.enqueue(1)
                q.enqueue(2)
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                with pytest.raises(_Alarm):
                    q.enqueue(b"x" * 10000, timeout=10)  # 3 slots: nothing fits
                assert [r.dequeue(timeout=5), r.dequeue(timeout=5)] == [1, 2]
                q.enqueue("after")
                assert r.dequeue(timeout=5) == "after"
            finally:
                r.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def _ready_pair(transport):
    """A writer and its one reader over ``transport``, both ready; closed after."""
    cfg = mpx.Config(transport=transport, allow_insecure=transport == "zmq")
    with mpx.MessageQueue(1, 1, config=cfg) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=cfg)
        try:
            q.wait_until_ready(timeout=10)
            r.wait_until_ready(timeout=10)
            yield q, r
        finally:
            r.close()


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_dequeue_ready_returns_the_published_batch_and_marks_the_undecodable(transport):
    with _ready_pair(transport) as (q, r):
        assert r.dequeue_ready(lambda e: e) == []
        for obj in ("a", Unloadable(), {"b": 2}, bytes(3 << 20)):
            q.enqueue(obj)
        deadline = time.monotonic() + 10
        got: list = []
        while len(got) < 4 and time.monotonic() < deadline:
            got += r.dequeue_ready(lambda e: ("undecodable", e))
        assert got[0] == "a" and got[2] == {"b": 2} and got[3] == bytes(3 << 20)
        assert got[1][0] == "undecodable"
        assert isinstance(got[1][1], mpx.DeserializationError)
        q.enqueue("next")  # the queue goes on
        assert r.dequeue(timeout=5) == "next"


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_transport_ends_carry_what_enqueue_and_dequeue_do(transport):
    with _ready_pair(transport) as (q, r):
        out, into = q.writing_end(), r.reading_end()

        def soon():
            return time.monotonic_ns() + 5_000_000_000

        out.write(*serde.encode({"a": 1}, out.shares_memory), soon())
        q.enqueue(Unloadable())
        out.write(*serde.encode(("big", bytes(1 << 20)), out.shares_memory), soon())
        assert into.read_into(soon(), None, False, serde.decode_lent) == {"a": 1}
        with pytest.raises(mpx.DeserializationError):
            into.read_into(soon(), None, False, serde.decode_lent)
        assert r.dequeue(timeout=5) == ("big", bytes(1 << 20))  # the queue goes on
        with pytest.raises(mpx.QueueTimeout):
            into.read_into(time.monotonic_ns() + 50_000_000, None, False, serde.decode_lent)
        with pytest.raises(mpx.RoleError, match="reading_end"):
            q.reading_end()
        with pytest.raises(mpx.RoleError, match="writing_end"):
            r.writing_end()
    with pytest.raises(mpx.QueueClosedError):
        r.reading_end()
    with pytest.raises(mpx.Cancelled):  # ends kept past close() refuse to work
        into.read_into(-1, None, False, serde.decode_lent)
    with pytest.raises(mpx.Cancelled):
        out.write(*serde.encode("late", out.shares_memory), -1)


def test_a_long_dequeue_warns_at_each_warning_period_naming_the_writer(monkeypatch, caplog):
    from mpx.transport import shm as shm_transport
    monkeypatch.setattr(shm_transport, "WAIT_WARNING_NS", 100_000_000)  # before the reader
    with mpx.MessageQueue(1, 1) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        try:
            with caplog.at_level("WARNING", logger="mpx"), pytest.raises(mpx.QueueTimeout):
                r.dequeue(timeout=0.45)
            warned = [rec.getMessage() for rec in caplog.records if "has waited" in rec.getMessage()]
            assert 3 <= len(warned) <= 5, warned  # at 0.1, 0.2, 0.3 and 0.4 s
            assert f"(pid {os.getpid()})" in warned[0] and "waited 0.1 s" in warned[0]
            caplog.clear()
            q.enqueue("late")
            assert r.dequeue(timeout=5) == "late"
            assert not caplog.records
        finally:
            r.close()


def test_closed_and_dropped_queue_ends_are_freed_without_the_cycle_collector():
    gc.disable()
    try:
        q = mpx.MessageQueue(1, 1)
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        ends = [weakref.ref(e) for e in (q.writing_end(), r.reading_end())]
        r.close()
        q.close()
        del q, r
        assert [e() for e in ends] == [None, None]
    finally:
        gc.enable()


def test_dequeue_ready_after_the_writer_closed_returns_the_rest_then_nothing():
    q = mpx.MessageQueue(1, 1)
    r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
    try:
        q.wait_until_ready(timeout=10)
        for i in range(3):
            q.enqueue(i)
        q.close()
        assert r.dequeue_ready(lambda e: e) == [0, 1, 2]
        assert r.dequeue_ready(lambda e: e) == []  # it never waits, so it never finds out
        with pytest.raises(mpx.PeerDiedError):
            r.dequeue(timeout=5)
    finally:
        r.close()
        q.close()
