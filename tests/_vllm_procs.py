"""Child-process functions for tests/queue/test_vllm_compat.py (module level, so every start method
finds them). Each reports to the test over ``conn`` and never raises out of the process."""

from __future__ import annotations

import os
import threading
import time
import traceback

import numpy as np

from mpx import MessageQueue


def arrays(n: int, seed: int) -> list[np.ndarray]:
    """``n`` int64 arrays of 1..10k elements (40 kB on average), the same for a seed."""
    rnd = np.random.default_rng(seed)
    return [rnd.integers(1, 100, int(size)) for size in rnd.integers(1, 10_000, n)]


def _report(conn, fn, *args) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as e:  # report to the test
        conn.send(("error", type(e).__name__, f"{e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def array_reader(handle, rank, n, seed, pause_s, conn):
    """Attach as group rank ``rank``, read ``n`` arrays with ``broadcast_object``, pausing
    up to ``pause_s`` after each, and check them against ``arrays(n, seed)``."""
    def run():
        q = MessageQueue.create_from_handle(handle, rank)
        try:
            q.wait_until_ready(30)
            rnd = np.random.default_rng(rank)
            bad = 0
            for x in arrays(n, seed):
                y = q.broadcast_object(None)
                bad += not np.array_equal(x, y)
                if pause_s:
                    time.sleep(rnd.random() * pause_s)
            return dict(bad=bad, local=q._is_local_reader, remote=q._is_remote_reader,
                        local_reader_rank=q.local_reader_rank,
                        n_remote_reader=q.n_remote_reader)
        finally:
            q.close()
    _report(conn, run)


def timing_reader(handle, conn):
    """Report ``(message, time.monotonic() at receipt)`` for each message until None."""
    def run():
        q = MessageQueue.create_from_handle(handle, 0)
        try:
            q.wait_until_ready(30)
            try:
                q.dequeue(timeout=0.01)
            except TimeoutError:
                pass
            else:
                raise AssertionError("dequeue on an empty queue returned")
            conn.send("ready")
            while True:
                obj = q.dequeue(timeout=30)
                now = time.monotonic()
                if obj is None:
                    return "done"
                conn.send((obj, now))
        finally:
            q.close()
    _report(conn, run)


def shutdown_reader(handle, mode, conn):
    """vLLM's shutdown scenario in a reader: a thread calls ``shutdown()`` while this
    reader waits in ``dequeue``, busy (just read a message) or idle (parked a while)."""
    def run():
        q = MessageQueue.create_from_handle(handle, 0)
        try:
            q.wait_until_ready(30)
            go = threading.Event()
            woke = []

            def shut():
                go.wait(10)
                time.sleep(0.2)
                woke.append(time.monotonic())
                q.shutdown()

            t = threading.Thread(target=shut)
            t.start()
            try:
                first = q.dequeue(timeout=30)  # busy: the writer sent one
                if mode == "idle":
                    try:
                        q.dequeue(timeout=0.6)  # parks on the futex
                    except TimeoutError:
                        pass
                go.set()
                try:
                    q.dequeue(timeout=10)
                except RuntimeError as e:
                    err = (type(e).__name__, str(e), time.monotonic() - woke[0])
                else:
                    err = None
            finally:
                go.set()
                t.join(10)
            return dict(first=first, err=err, shutting_down=q.shutting_down)
        finally:
            q.close()
    _report(conn, run)


def slot_reader(handle, conn):
    """acquire_read: an exception in the block releases the slot; then read a raw slot."""
    def run():
        q = MessageQueue.create_from_handle(handle, 0)
        out = {}
        try:
            q.wait_until_ready(30)
            try:
                with q.acquire_read(timeout=10):
                    raise RuntimeError("reader failed")
            except RuntimeError as e:
                out["raised"] = str(e)
            conn.send("released")
            with q.acquire_read(timeout=10, indefinite=True) as buf:
                out["first_byte"] = buf[0]
                out["len"] = len(buf)
            out["next"] = q.dequeue(timeout=10)
            return out
        finally:
            q.close()
    _report(conn, run)


def stalled_reader(handle, rank, conn):
    """Attach and read nothing until told to go; then read everything, and report."""
    def run():
        q = MessageQueue.create_from_handle(handle, rank)
        try:
            conn.send("attached")
            conn.recv()  # go
            got = []
            while True:
                obj = q.dequeue(timeout=10)
                if obj is None:
                    return got
                got.append(obj if isinstance(obj, int) else len(obj))
        finally:
            q.close()
    _report(conn, run)


def round_robin_reader(handles, n, conn):
    """Attach to each of ``handles`` as rank 0 and read ``n`` messages from each, in turn."""
    def run():
        qs = [MessageQueue.create_from_handle(h, 0) for h in handles]
        try:
            for q in qs:
                q.wait_until_ready(30)
            got = [[] for _ in qs]
            for _ in range(n):
                for i, q in enumerate(qs):
                    got[i].append(q.dequeue(timeout=30))
            return got
        finally:
            for q in qs:
                q.close()
    _report(conn, run)


def replying_worker(n, then, conn):
    """A worker's response queue: enqueue ``n`` replies (the last a big one spanning many
    slots) as soon as the reader attached, then exit at once: 'return' (no close) or
    'close'."""
    q = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=40)  # room for every reply
    conn.send(q.export_handle())
    q.wait_until_ready(30)
    for i in range(n - 1):
        q.enqueue(("reply", i))
    q.enqueue(("reply", n - 1, bytes(range(256)) * 200))
    if then == "close":
        q.close()
    conn.send("sent")
    conn.close()
    os._exit(0)  # no atexit, no finalizers: the replies must already be in the ring


def handle_then_wait(n_reader, conn):
    """A writer that hands out its handle, then waits (to be killed)."""
    q = MessageQueue(n_reader, n_reader)
    conn.send(q.export_handle())
    conn.recv()
    q.close()


def pg_worker(rank, world, port, conn):
    """One rank of a gloo group: vLLM's process-group constructors end to end."""
    def run():
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        out = {}
        try:
            pg = dist.group.WORLD
            # a) writer_rank=1, neither first nor last: readers are group ranks 0 and 2
            mq = MessageQueue.create_from_process_group(pg, 40 * 1024, 2, writer_rank=1)
            try:
                out["a_writer"] = mq._is_writer
                out["a_ranks"] = list(mq.local_reader_ranks)
                n = 120
                for x in arrays(n, 7):
                    y = mq.broadcast_object(x if rank == 1 else None)
                    assert np.array_equal(x, y)
                    if rank == 2:
                        time.sleep(0.002)  # a slower reader
                dist.barrier()
            finally:
                mq.close()
            # b) large bf16 tensors, no aliasing of ring memory (writer_rank=0)
            mq = MessageQueue.create_from_process_group(pg, 8 << 20, 4, writer_rank=0)
            try:
                torch.manual_seed(42)
                payload = {"mid": torch.randn(1024, 512),
                           "big": torch.randn(4096, 2048, dtype=torch.bfloat16),
                           "nested": ["plain", 123, {"inner": torch.arange(5)}]}
                if rank == 0:
                    mq.enqueue(payload)
                    for i in range(12):
                        mq.enqueue({"junk": torch.full((1024, 512), float(i))})
                else:
                    got = mq.dequeue(timeout=60)
                    for key in ("mid", "big"):
                        assert got[key].dtype == payload[key].dtype, key
                        assert torch.equal(got[key], payload[key]), key
                    assert torch.equal(got["nested"][2]["inner"], torch.arange(5))
                    snapshot = got["mid"].clone()
                    for i in range(12):
                        junk = mq.dequeue(timeout=60)
                        assert torch.equal(junk["junk"], torch.full((1024, 512), float(i)))
                    assert torch.equal(got["mid"], snapshot)  # no aliasing of ring slots
                    got["mid"] += 1.0  # writable, like any tensor
                    got["big"][0, 0] = 1.0
                    out["b_ok"] = True
                dist.barrier()
            finally:
                mq.close()
            # c) one reader (group rank 0), every rank a writer
            mq, handles = MessageQueue.create_from_process_group_single_reader(
                pg, 1 << 20, 2, reader_rank=0)
            readers = []
            try:
                out["c_handles"] = len(handles)
                if rank == 0:
                    readers = [MessageQueue.create_from_handle(h, 0) for h in handles]
                dist.barrier()
                mq.wait_until_ready(30)
                mq.enqueue(("from", rank))
                if rank == 0:
                    out["c_got"] = [r.dequeue(timeout=30) for r in readers]
                dist.barrier()
            finally:
                for r in readers:
                    r.close()
                mq.close()
        finally:
            dist.destroy_process_group()
        return out
    _report(conn, run)
