"""Child-process side of test_inband.py (module level, so every start method finds it)."""

from __future__ import annotations

import hashlib

import mpx


class Box:
    """A user object holding payloads in its attributes."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __eq__(self, other):
        return type(other) is Box and _same(self.__dict__, other.__dict__)


def _same(a, b) -> bool:
    """Equal, and of the same types all the way down (bytes stays bytes...); memoryviews
    also keep their format, shape and read-only flag."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, memoryview):
        return (a.format, a.shape, a.readonly) == (b.format, b.shape, b.readonly) and \
            a.tobytes() == b.tobytes()
    return a == b


same = _same


def echo_back(handle, conn):
    """Dequeue objects and enqueue each back on a queue of our own (its handle goes over
    ``conn`` first) until None; for every bytearray or writable memoryview received, check
    it is writable by writing into it (and undoing that)."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    back = mpx.MessageQueue(1, 1, max_chunk_bytes=64 << 10, max_chunks=8)
    conn.send(back.export_handle())
    try:
        q.wait_until_ready(30)
        back.wait_until_ready(30)
        while True:
            obj = q.dequeue(timeout=60)
            if obj is None:
                break
            _poke(obj)
            back.enqueue(obj, timeout=60)
    finally:
        back.close()
        q.close()
        conn.close()


def _poke(obj):
    if isinstance(obj, (list, tuple)):
        for x in obj:
            _poke(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            _poke(x)
    elif isinstance(obj, Box):
        _poke(obj.__dict__)
    elif isinstance(obj, (bytearray, memoryview)) and not (
            isinstance(obj, memoryview) and obj.readonly) and len(obj):
        flat = memoryview(obj).cast("B")
        flat[0] ^= 0xFF
        flat[0] ^= 0xFF


def keep_first(handle, n, conn):
    """Dequeue ``n`` messages, keep the first, and report its type and sha256 once all
    arrived (the writer has reused every slot many times by then)."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    try:
        q.wait_until_ready(30)
        first = q.dequeue(timeout=60)
        for _ in range(n - 1):
            q.dequeue(timeout=60)
        conn.send([(type(x).__name__, hashlib.sha256(x).hexdigest()) for x in first])
    finally:
        q.close()
        conn.close()


class Worker:
    """An mpx.Executor worker that returns payloads as results."""

    def __init__(self, ctx):
        self.rank = ctx.rank

    def echo(self, obj):
        return obj

    def make(self, n):
        return {"b": bytes(range(256)) * (n // 256), "ba": bytearray(b"\x07" * n),
                "mv": memoryview(bytearray(b"\x09" * n)).cast("I"), "rank": self.rank}
