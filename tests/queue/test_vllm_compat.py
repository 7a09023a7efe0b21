"""mpx.MessageQueue as a drop-in for vLLM's MessageQueue: the scenarios of vLLM's
tests/distributed/test_shm_broadcast.py and test_mq_tcp_multinode.py, written against
vLLM's names and signatures, across real processes, on both rings (``impl``)."""

from __future__ import annotations

import copyreg
import dataclasses
import threading
import time
import warnings
import zlib

import _procs
import _vllm_procs as V
import numpy as np
import pytest

import mpx
from mpx import MessageQueue
from mpx._procinfo import free_tcp_port
from mpx.mechanism import segments

KEY = "vllm-compat-test-key"


def _result(conn, timeout=60):
    assert conn.poll(timeout), "the child process did not report"
    res = conn.recv()
    assert res[0] == "ok", res
    return res[1]


def _join(procs, timeout=20):
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
            raise AssertionError(f"process {p.pid} did not exit")


def test_random_arrays_to_readers_of_different_speeds(impl, ctx):
    # a vLLM writer of group rank 1: its readers are group ranks 0, 2 and 3
    n, seed = 200, 11
    with MessageQueue(3, 3, [0, 2, 3], 40 * 1024, 2) as mq:
        assert (mq.n_local_reader, mq.n_remote_reader, mq.shutting_down) == (3, 0, False)
        started = [_procs.start(ctx, V.array_reader, mq.export_handle(), rank, n, seed, pause)
                   for rank, pause in ((0, 0.0), (2, 0.001), (3, 0.004))]
        mq.wait_until_ready(30)
        for x in V.arrays(n, seed):
            assert mq.broadcast_object(x) is x
        results = [_result(conn) for _, conn in started]
        _join([p for p, _ in started])
    assert [r["bad"] for r in results] == [0, 0, 0]
    assert [r["local_reader_rank"] for r in results] == [0, 1, 2]
    assert all(r["local"] and not r["remote"] for r in results)


@pytest.mark.parametrize("idle_s", [0.0, 0.4])
def test_idle_and_busy_readers_are_woken(impl, ctx, idle_s):
    with MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=1) as mq:
        p, conn = _procs.start(ctx, V.timing_reader, mq.export_handle())
        mq.wait_until_ready(30)
        assert conn.recv() == "ready"
        lags = []
        for i in range(3):
            time.sleep(idle_s or 0.01)  # idle: the reader has parked on its futex
            t0 = time.monotonic()
            mq.enqueue(("hello", i) if i != 1 else np.arange(1000))  # 8 kB: 8 slots of 1
            msg, t1 = conn.recv()
            lags.append(t1 - t0)
        mq.enqueue(None)
        assert _result(conn) == "done"
        _join([p])
    assert max(lags) < 0.25, lags  # microseconds when the machine is quiet


@pytest.mark.parametrize("mode", ["busy", "idle"])
def test_shutdown_from_another_thread_wakes_the_reader(impl, ctx, mode):
    with MessageQueue(1, 1, max_chunk_bytes=40 * 1024, max_chunks=2) as mq:
        p, conn = _procs.start(ctx, V.shutdown_reader, mq.export_handle(), mode)
        mq.wait_until_ready(30)
        mq.enqueue("first")
        res = _result(conn)
        _join([p])
        # the writer's end is untouched by a reader's shutdown
        assert not mq.shutting_down
    assert res["first"] == "first" and res["shutting_down"]
    etype, msg, after = res["err"]
    assert etype == "Cancelled" and "cancelled" in msg
    assert after < 1.0


def test_writer_shutdown_is_local_and_close_tells_readers(impl, ctx):
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    try:
        p, conn = _procs.start(ctx, _procs.idle_reader, mq.export_handle())
        assert conn.recv()[0] == "ready"
        mq.wait_until_ready(30)
        mq.shutdown()
        assert mq.shutting_down
        mq.enqueue("still goes")  # vLLM: a shut-down writer still writes while there is room
        tag, summary, _ = conn.recv()
        assert (tag, summary) == ("got", ("obj", "'still goes'"))
        _join([p])
    finally:
        mq.close()


def test_process_group_constructors_over_gloo(impl, ctx):
    pytest.importorskip("torch.distributed")
    port = free_tcp_port()
    started = [_procs.start(ctx, V.pg_worker, rank, 3, port) for rank in range(3)]
    results = [_result(conn, timeout=120) for _, conn in started]
    _join([p for p, _ in started], timeout=30)
    assert [r["a_writer"] for r in results] == [False, True, False]
    assert results[1]["a_ranks"] == [0, 2]
    assert results[1]["b_ok"] and results[2]["b_ok"]
    assert [r["c_handles"] for r in results] == [3, 0, 0]
    assert results[0]["c_got"] == [("from", 0), ("from", 1), ("from", 2)]


def test_mixed_local_and_tcp_readers(impl, ctx):
    # writer of group rank 1 in a group of 4: ranks 0 and 3 on its node, rank 2 remote
    cfg = mpx.Config(auth_key=KEY)
    n, seed = 60, 5
    with MessageQueue(3, 2, local_reader_ranks=[0, 3], max_chunk_bytes=64 * 1024,
                      max_chunks=4, connect_ip="127.0.0.1", config=cfg) as mq:
        assert (mq.n_local_reader, mq.n_remote_reader) == (2, 1)
        h = mq.export_handle()
        started = [_procs.start(ctx, _procs.with_key, KEY, V.array_reader, h, rank, n, seed,
                                0.001 * rank) for rank in (0, 3, 2)]
        mq.wait_until_ready(30)
        for x in V.arrays(n, seed):
            mq.enqueue(x)
        results = [_result(conn) for _, conn in started]
        _join([p for p, _ in started])
    assert [r["bad"] for r in results] == [0, 0, 0]
    assert [(r["local"], r["remote"]) for r in results] == [(True, False), (True, False),
                                                            (False, True)]


def test_concurrent_writers(impl, ctx):
    # writers made at the same time in threads: four over shared memory, four over TCP
    # (each binds its own port); one reader process reads them all, in turn
    cfg = mpx.Config(auth_key=KEY)
    queues: list = []
    lock = threading.Lock()

    def make(remote):
        q = MessageQueue(1, 0 if remote else 1, max_chunk_bytes=4096, max_chunks=2,
                         connect_ip="127.0.0.1", config=cfg)
        with lock:
            queues.append(q)

    threads = [threading.Thread(target=make, args=(i % 2,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        handles = [q.export_handle() for q in queues]
        endpoints = [h.remote_subscribe_addr for h in handles if h.remote_subscribe_addr]
        assert all(a.startswith("tcp://127.0.0.1:") for a in endpoints)
        assert sum(h.buffer_handle is not None for h in handles) == 4
        assert len(endpoints) == 4 and len(set(endpoints)) == 4
        n = 30
        p, conn = _procs.start(ctx, _procs.with_key, KEY, V.round_robin_reader, handles, n)

        def write(i, q):
            q.wait_until_ready(30)
            for k in range(n):
                q.enqueue((i, k, bytes(k * 300)))  # some span several slots

        writers = [threading.Thread(target=write, args=(i, q)) for i, q in enumerate(queues)]
        for t in writers:
            t.start()
        got = _result(conn)
        for t in writers:
            t.join(30)
        _join([p])
    finally:
        for q in queues:
            q.close()
    assert got == [[(i, k, bytes(k * 300)) for k in range(n)] for i in range(8)]


def test_timeouts_on_a_full_ring(impl, ctx):
    # vLLM's smallest ring: one slot of 1 kB, sizes given positionally as vLLM's tests do
    with MessageQueue(1, 1, None, 2048, 2) as other:
        assert (other.config.max_chunk_bytes, other.config.max_chunks) == (2048, 2)
    with MessageQueue(1, 1, 1024, 1) as mq:
        assert (mq.config.max_chunk_bytes, mq.config.max_chunks) == (1024, 1)
        p, conn = _procs.start(ctx, V.stalled_reader, mq.export_handle(), 0)
        assert conn.recv() == "attached"
        mq.wait_until_ready(30)
        mq.enqueue(1)  # fills the only slot
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=f"rank 0 \\(pid {p.pid}\\)"):
            mq.enqueue(2, timeout=0.2)
        with pytest.raises(TimeoutError):
            with mq.acquire_write(timeout=0.2):
                pass
        assert 0.35 < time.monotonic() - t0 < 5
        conn.send("go")
        mq.enqueue(bytes(10_000))  # ten slots' worth, streamed through the one slot
        mq.enqueue(3)
        mq.enqueue(None)
        assert _result(conn) == [1, 10_000, 3]
        _join([p])


def test_acquire_read_releases_the_slot_when_the_block_raises(impl, ctx):
    with MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024 * 1024,
                      max_chunks=1) as mq:
        p, conn = _procs.start(ctx, V.slot_reader, mq.export_handle())
        mq.wait_until_ready(30)
        mq.enqueue({"payload": "first"})
        assert conn.recv() == "released"
        with mq.acquire_write(timeout=5) as buf:  # the one slot is free again
            assert len(buf) == 1024 * 1024
            buf[0] = 123
        # an exception inside acquire_write publishes nothing
        with pytest.raises(RuntimeError, match="writer failed"):
            with mq.acquire_write(timeout=5) as buf:
                buf[0] = 99
                raise RuntimeError("writer failed")
        mq.enqueue("after")
        res = _result(conn)
        _join([p])
    assert res == {"raised": "reader failed", "first_byte": 123, "len": 1024 * 1024,
                   "next": "after"}


@pytest.mark.parametrize("then", ["return", "close"])
def test_replies_enqueued_just_before_the_worker_exits_arrive(impl, ctx, then):
    parent, child = ctx.Pipe()
    w = ctx.Process(target=V.replying_worker, args=(20, then, child))
    w.start()
    child.close()
    rq = MessageQueue.create_from_handle(parent.recv(), 0)
    try:
        rq.wait_until_ready()  # vLLM calls it without a timeout
        assert parent.poll(30) and parent.recv() == "sent"
        w.join(10)
        got = [rq.dequeue(timeout=5) for _ in range(20)]
        assert [g[1] for g in got] == list(range(20))
        assert got[-1][2] == bytes(range(256)) * 200
        with pytest.raises(mpx.PeerDiedError, match=f"pid {w.pid}"):
            rq.dequeue(timeout=5)
    finally:
        rq.close()


def test_reader_wait_until_ready_has_every_exit(impl, ctx):
    # readers 1 and 2 never attach: rank 0 would wait forever without an exit
    with MessageQueue(3, 3) as mq:
        h = mq.export_handle()
        r0 = MessageQueue.create_from_handle(h, 0)
        r1 = MessageQueue.create_from_handle(h, 1)
        try:
            with pytest.raises(TimeoutError, match=r"ranks \[2\]"):
                r0.wait_until_ready(timeout=0.1)
            ev = threading.Event()
            threading.Timer(0.2, ev.set).start()
            with pytest.raises(mpx.Cancelled):
                r0.wait_until_ready(cancel=ev)
            threading.Timer(0.2, r0.shutdown).start()
            with pytest.raises(RuntimeError, match="cancelled"):
                r0.wait_until_ready()
            threading.Timer(0.2, r1.close).start()
            with pytest.raises(mpx.QueueClosedError):
                r1.wait_until_ready()
        finally:
            r0.close()
            r1.close()
    # the writer dies before every reader attached
    p, conn = _procs.start(ctx, V.handle_then_wait, 2)
    r = MessageQueue.create_from_handle(conn.recv(), 0)
    try:
        threading.Timer(0.3, p.kill).start()
        with pytest.raises(mpx.PeerDiedError, match=f"pid {p.pid}"):
            r.wait_until_ready()
        p.join(10)
    finally:
        r.close()
        segments.reap_stale()  # the dead writer's segment: never every reader attached


class Celsius:
    def __init__(self, degrees):
        self.degrees = degrees
        self.cache = {"derived": degrees * 1.8 + 32}


def _rebuild_celsius(degrees):
    return Celsius(-degrees)  # visibly different from a __dict__ copy


def test_copyreg_reducers_count_with_torch_imported():
    pytest.importorskip("torch")
    with MessageQueue(1, 1) as mq:
        r = MessageQueue.create_from_handle(mq.export_handle(), 0)
        try:
            mq.enqueue(Celsius(10))
            assert r.dequeue(timeout=5).degrees == 10
            # registered after the first message: it must count
            copyreg.pickle(Celsius, lambda c: (_rebuild_celsius, (c.degrees,)))
            try:
                mq.enqueue([Celsius(10), np.arange(3)])
                got = r.dequeue(timeout=5)
                assert got[0].degrees == -10 and got[1].tolist() == [0, 1, 2]
            finally:
                del copyreg.dispatch_table[Celsius]
            mq.enqueue(Celsius(10))
            assert r.dequeue(timeout=5).degrees == 10
        finally:
            r.close()


def test_too_little_shm_names_the_space_and_takes_no_fallback_that_cannot_work():
    free = segments.free_bytes()
    chunks = free // (1 << 30) + 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "falling back to ZeroMQ" warning
        with pytest.raises(mpx.ShmError) as ei:
            MessageQueue(1, 1, max_chunk_bytes=1 << 30, max_chunks=chunks,
                         config=mpx.Config(auth_key="", transport="auto"))
    msg = str(ei.value)
    assert "bytes free" in msg and "needs" in msg and "auth_key" in msg
    assert str(chunks << 30)[:6] in msg


def test_enable_shm_tensor_arena_is_accepted_and_dequeue_takes_indefinite_by_keyword():
    with MessageQueue(1, 1, enable_shm_tensor_arena=True) as mq:
        r = MessageQueue.create_from_handle(mq.export_handle(), rank=0)
        try:
            assert r.export_handle() == mq.export_handle() == r.handle
            with pytest.raises(TimeoutError):
                r.dequeue(timeout=0.01, indefinite=False)
            mq.enqueue(zlib.crc32(b"x"))
            assert r.dequeue(timeout=5, indefinite=True) == zlib.crc32(b"x")
        finally:
            r.close()


def test_remote_reader_wait_until_ready_has_every_exit():
    cfg = mpx.Config(auth_key=KEY)
    with MessageQueue(1, 0, connect_ip="127.0.0.1", config=cfg) as mq:
        h = mq.export_handle()
    # nobody listens where the readers go
    h = dataclasses.replace(h, zmq={**h.zmq,
                                    "endpoint": f"tcp://127.0.0.1:{free_tcp_port()}"})
    r0 = MessageQueue.create_from_handle(h, 0, config=cfg)
    r1 = MessageQueue.create_from_handle(h, 1, config=cfg)  # vLLM's group rank: also remote
    try:
        assert r0._is_remote_reader and r0.n_remote_reader == 1
        with pytest.raises(TimeoutError):
            r0.wait_until_ready(timeout=0.1)
        with pytest.raises(TimeoutError):  # a bool in cancel's place is vLLM's indefinite
            r0.dequeue(0.05, True)
        threading.Timer(0.2, r0.shutdown).start()
        with pytest.raises(RuntimeError, match="cancelled"):
            r0.wait_until_ready()
        threading.Timer(0.2, r1.close).start()
        with pytest.raises(mpx.QueueClosedError):
            r1.wait_until_ready()
    finally:
        r0.close()
        r1.close()


def test_acquire_write_reaches_local_and_remote_readers():
    cfg = mpx.Config(auth_key=KEY)
    with MessageQueue(2, 1, [0], 4096, 2, "127.0.0.1", config=cfg) as mq:
        local = MessageQueue.create_from_handle(mq.export_handle(), 0, config=cfg)
        remote = MessageQueue.create_from_handle(mq.export_handle(), 1, config=cfg)
        try:
            mq.wait_until_ready(10)
            with mq.acquire_write(timeout=5) as buf:
                buf[:5] = b"hello"
            with local.acquire_read(timeout=5) as buf:
                assert bytes(buf[:5]) == b"hello" and len(buf) == 4096
            got = remote.dequeue(timeout=5)
            assert got[:5] == b"hello" and len(got) == 4096
            with pytest.raises(mpx.RoleError, match="remote"):
                with remote.acquire_read(timeout=1):
                    pass
            with pytest.raises(mpx.RoleError):
                with local.acquire_write():
                    pass
        finally:
            local.close()
            remote.close()


def test_acquire_read_refuses_a_message_spanning_slots_and_leaves_it_unread(impl):
    with MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=4) as mq:
        r = MessageQueue.create_from_handle(mq.export_handle(), 0)
        try:
            mq.enqueue(bytes(3000))
            with pytest.raises(ValueError, match="spans several slots"):
                with r.acquire_read(timeout=5):
                    pass
            assert r.dequeue(timeout=5) == bytes(3000)
            mq.enqueue(b"small")
            with r.acquire_read(timeout=5) as buf:  # one slot: the raw message
                assert bytes(buf) == b"small"
        finally:
            r.close()


class _ThreadGroup:
    """A StatelessProcessGroup look-alike whose ranks are threads of this process."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.slots: list = [None] * world_size

    def member(self, rank):
        g = _ThreadGroup.__new__(_ThreadGroup)
        g.__dict__.update(self.__dict__, rank=rank)
        return g

    def broadcast_obj(self, obj, src):
        if self.rank == src:
            self.slots[src] = obj
        self.barrier.wait()
        out = self.slots[src]
        self.barrier.wait()
        return out

    def all_gather_obj(self, obj):
        self.slots[self.rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


def test_process_group_constructors_over_a_stateless_group(impl):
    group = _ThreadGroup(3)
    results: dict = {}
    errors: list = []

    def rank_main(rank):
        pg = group.member(rank)
        try:
            mq = MessageQueue.create_from_process_group(pg, 4096, 2, writer_rank=2)
            try:
                got = [mq.broadcast_object(("m", i) if rank == 2 else None) for i in range(20)]
                pg.barrier.wait()
            finally:
                mq.close()
            mq, handles = MessageQueue.create_from_process_group_single_reader(
                pg, 4096, 2, reader_rank=1)
            readers = [MessageQueue.create_from_handle(h, 0) for h in handles]
            try:
                pg.barrier.wait()
                mq.wait_until_ready(10)
                mq.enqueue(rank)
                single = [r.dequeue(timeout=10) for r in readers]
                pg.barrier.wait()
            finally:
                for r in readers:
                    r.close()
                mq.close()
            results[rank] = (got, single)
        except BaseException as e:
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(results[r][0] == [("m", i) for i in range(20)] for r in range(3))
    assert results[1][1] == [0, 1, 2] and results[0][1] == results[2][1] == []
