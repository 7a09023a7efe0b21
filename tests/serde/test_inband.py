"""Large bytes, bytearray and memoryview objects inside messages: out of band, across real
processes, for both ring implementations."""

from __future__ import annotations

import hashlib
import os
import pickle

import _inband_procs as ip
import _procs
import pytest

import mpx
from mpx.protocol import serde
from mpx.protocol.serde import K_PICKLE, K_PICKLE_OOB

pytestmark = pytest.mark.usefixtures("impl")

T = serde.OOB_MIN_BYTES
SIZES = [64 << 10, T - 1, T, T + 1, 2 * T + 5]


def _payloads(n):
    b = os.urandom(n)
    return [
        b,
        bytearray(b),
        [b, 1, "x", bytearray(b[:7])],
        {"args": (b,), "kw": {"data": bytearray(b)}, "again": b},
        ip.Box(data=b, more=[bytearray(b)], n=n),
        memoryview(b),
        memoryview(bytearray(b)),
        memoryview(bytearray(b[: n - n % 8])).cast("Q"),
        memoryview(b[: n - n % 4]).cast("i"),
    ]


def test_large_bytes_leave_the_pickle_as_they_are():
    """The writer's message holds the caller's own objects (no copy before the ring); small
    ones stay in band."""
    b, ba = os.urandom(T), bytearray(os.urandom(T + 64))
    kind, parts = serde.encode({"b": b, "ba": [ba], "small": b[:100]})
    assert kind == K_PICKLE_OOB
    assert any(p is b for p in parts) and any(p is ba for p in parts)
    kind, parts = serde.encode([b[:T - 1]])
    assert kind == K_PICKLE
    # a large str is the pickler's own chunk: it stays in band, and comes back as str
    s = "é" * T
    kind, parts = serde.encode([s, b])
    got = serde.decode(kind, bytearray(b"".join(bytes(memoryview(p)) for p in parts)))
    assert got == [s, b] and type(got[1]) is bytes


def test_same_object_twice_arrives_as_one():
    b = os.urandom(T * 2)
    kind, parts = serde.encode([b, b])
    assert sum(p is b for p in parts) == 1
    got = serde.decode(kind, bytearray(b"".join(bytes(memoryview(p)) for p in parts)))
    assert got[0] is got[1] and got[0] == b


@pytest.mark.parametrize("n", SIZES)
def test_round_trip_across_processes(ctx, n):
    """Writer -> reader -> back, with sizes around the threshold, nested in lists, dicts
    and objects; types, contents, memoryview shapes and writability survive both ways."""
    with mpx.MessageQueue(1, 1, max_chunk_bytes=64 << 10, max_chunks=8) as q:
        p, conn = _procs.start(ctx, ip.echo_back, q.export_handle())
        assert conn.poll(60)
        back = mpx.MessageQueue.create_from_handle(conn.recv(), 0)
        try:
            q.wait_until_ready(30)
            back.wait_until_ready(30)
            for obj in _payloads(n):
                q.enqueue(obj, timeout=30)
                got = back.dequeue(timeout=60)
                assert ip.same(obj, got), (type(obj), n)
            q.enqueue(None, timeout=30)
            p.join(30)
            assert p.exitcode == 0
        finally:
            back.close()


def test_received_bytes_survive_slot_reuse(ctx):
    """A large bytes and bytearray the reader kept are not overwritten when the writer
    reuses every slot of the ring many times after."""
    first = [os.urandom(T + 100), bytearray(os.urandom(T)), memoryview(os.urandom(T))]
    n = 12
    with mpx.MessageQueue(1, 1, max_chunk_bytes=64 << 10, max_chunks=4) as q:
        p, conn = _procs.start(ctx, ip.keep_first, q.export_handle(), n)
        q.wait_until_ready(30)
        q.enqueue(first, timeout=30)
        for i in range(n - 1):
            q.enqueue([bytes([i % 251]) * (T + 100), bytearray(T), b"z" * T], timeout=30)
        assert conn.poll(60)
        got = conn.recv()
        p.join(30)
    assert got == [(type(x).__name__, hashlib.sha256(x).hexdigest()) for x in first]


def test_executor_args_and_results(impl):
    """Through mpx.Executor: payloads in a call's args come back as its results, and
    results made by the workers arrive whole, for 2 workers."""
    n = T + 264
    with mpx.Executor(ip.Worker, world_size=2, start_method="spawn") as ex:
        for obj in _payloads(n):
            got = ex.collective_rpc("echo", args=(obj,), timeout=60)
            assert all(ip.same(obj, g) for g in got), type(obj)
        made = ex.collective_rpc("make", args=(n - n % 256,), timeout=60)
        for rank, d in enumerate(made):
            assert type(d["b"]) is bytes and d["b"] == bytes(range(256)) * (n // 256)
            assert type(d["ba"]) is bytearray and d["ba"] == b"\x07" * (n - n % 256)
            assert d["mv"].format == "I" and not d["mv"].readonly and d["rank"] == rank


def test_pickle_stream_stays_standard():
    """What the writer sends unpickles with plain pickle once its buffers are given: no
    private opcodes."""
    b = os.urandom(T)
    kind, parts = serde.encode({"x": b})
    mv = memoryview(b"".join(bytes(memoryview(p)) for p in parts))
    n, plen = int.from_bytes(mv[:8], "little"), int.from_bytes(mv[8:16], "little")
    payload = mv[16 + 8 * n:16 + 8 * n + plen]
    assert pickle.loads(payload, buffers=[b]) == {"x": b}
