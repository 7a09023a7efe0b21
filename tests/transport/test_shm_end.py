"""The shared-memory end (mpx/transport/shm_end.py), in one process: either build of the end
over either build of the ring (a queue picks its ring when it is made, so a compiled end may
be given the pure twin's), the statuses it answers with, the encoder and decoder it was
given, and the lock it runs every call under (EndLock, of either build)."""

from __future__ import annotations

import importlib
import mmap
import os
import signal
import threading
import time

import pytest
from _builds import plain
from _env import IMPLS

from mpx import _impl
from mpx.mechanism import layout
from mpx.protocol import serde
from mpx.transport import shm_end

BYTES = 5 | layout.KIND_AS_BYTES


def _end_build(name: str):
    if name == "plain":
        return plain("mpx.transport.shm_end")
    if shm_end.IMPLEMENTATION != "cython":
        pytest.skip("the shm end is not compiled in this process")
    return shm_end


def _rings(name: str):
    return importlib.import_module("mpx._ring_py") if name == "python" else \
        pytest.importorskip("mpx._ring", reason="compiled ring not built")


def _free(lock) -> bool:
    """Whether another thread can take ``lock`` now (and give it back)."""
    t = threading.Thread(target=lambda: (lock.acquire(), lock.release()), daemon=True)
    t.start()
    t.join(2)
    return not t.is_alive()


@pytest.fixture(params=[(e, r) for e in ("compiled", "plain") for r in IMPLS],
                ids=lambda p: f"{p[0]}-end-{p[1]}-ring")
def ends(request):
    """(writer end, reader end, their locks, the ring writer, the ring reader) over a fresh
    ring of 4 slots of 256 bytes; released afterwards."""
    mod, rings = _end_build(request.param[0]), _rings(request.param[1])
    mm = mmap.mmap(-1, layout.segment_size(256, 4, 1))
    layout.init_header(mm, 256, 4, 1, 1, os.getpid())
    w = rings.RingWriter(mm, spin_ns=0, yield_ns=0, poll_ns=20_000_000)
    r = rings.RingReader(mm, 0, spin_ns=0, yield_ns=0, poll_ns=20_000_000)
    wl, rl = mod.EndLock(), mod.EndLock()
    yield (mod.WriterEnd(w, wl, serde.encode), mod.ReaderEnd(r, rl, serde.decode_lent, 100),
           (wl, rl), w, r)
    w.release()
    r.release()
    mm.close()


def in_s(seconds: float) -> int:
    return time.monotonic_ns() + int(seconds * 1e9)


def test_objects_and_raw_messages_go_through_with_the_given_codec(ends):
    out, inp, locks, _, _ = ends
    msgs = [("call", 1, None), {"k": [1, 2.5]}, b"x" * 90, b"y" * 200, "z" * 600]
    for m in msgs:
        assert out.send(m, in_s(5)) == layout.OK
        assert inp.recv(in_s(5)) == (layout.OK, serde.encode(m, True)[0], m)
    assert out.write(BYTES, (b"ab", memoryview(b"cd")), in_s(5)) == layout.OK
    assert inp.read_into(lambda kind, data: (kind, bytes(data)), 0, in_s(5), -1) == \
        (layout.OK, BYTES, (BYTES, b"abcd"))
    assert out.write(BYTES, iter([b"e", b"f"]), in_s(5), 2) == layout.OK  # total given
    assert inp.read_into(lambda kind, data: bytes(data), 0, in_s(5), -1)[2] == b"ef"
    assert all(_free(lock) for lock in locks)  # each call gave it back


def test_a_large_one_slot_message_is_decoded_in_place(ends):
    out, inp, _, _, _ = ends
    seen = []

    def decode(kind, data):
        seen.append(type(data))
        return bytes(data)

    out.write(BYTES, (b"m" * 200,), in_s(5))  # from in_place_min (100) up: lent
    assert inp.read_into(decode, 100, in_s(5), -1) == (layout.OK, BYTES, b"m" * 200)
    out.write(BYTES, (b"s" * 50,), in_s(5))  # below it: an owned copy
    assert inp.read_into(decode, 100, in_s(5), -1)[2] == b"s" * 50
    assert seen == [memoryview, bytes]


def test_waits_end_with_the_rings_statuses(ends):
    out, inp, _, w, r = ends
    assert inp.recv(in_s(0.05)) == (layout.TIMEOUT, 0, None)
    before = time.monotonic_ns()
    assert inp.read_into(serde.decode_lent, 100, -1, 10_000_000)[0] == layout.SLICE
    assert before <= inp.began_ns <= time.monotonic_ns()  # when the sliced read began
    for i in range(4):
        assert out.send(i, in_s(1)) == layout.OK
    assert out.send(4, in_s(0.05)) == layout.TIMEOUT  # the ring is full
    w.interrupt()
    assert out.send(4, in_s(5)) == layout.INTERRUPTED
    r.nudge()
    assert [inp.recv(in_s(5))[2] for _ in range(4)] == [0, 1, 2, 3]  # the nudge waits
    assert inp.recv(in_s(5))[0] == layout.NUDGED


def test_an_object_that_does_not_encode_writes_nothing(ends):
    out, inp, locks, _, _ = ends

    class Refuses:
        def __reduce__(self):
            raise RuntimeError("no pickling this")

    with pytest.raises(Exception, match="no pickling this"):
        out.send(Refuses(), in_s(5))
    assert inp.recv(0) == (layout.TIMEOUT, 0, None)
    assert _free(locks[0])


def test_a_closed_end_answers_closed_without_its_ring(ends):
    out, inp, locks, w, r = ends
    out.send("before", in_s(5))
    out.close()
    inp.close()
    w.release()  # (as the Python side does after close(): the end must not touch it)
    r.release()
    assert out.send("after", in_s(5)) == layout.CLOSED
    assert out.write(BYTES, (b"x",), in_s(5)) == layout.CLOSED
    assert inp.recv(in_s(5)) == (layout.CLOSED, 0, None)
    assert inp.read_into(serde.decode_lent, 0, in_s(5), 1000) == (layout.CLOSED, 0, None)
    assert all(_free(lock) for lock in locks)


def test_a_call_waits_for_the_lock_it_was_given(ends):
    out, _, locks, _, _ = ends
    done = []
    locks[0].acquire()  # (as close() holds it while it releases the ring)
    t = threading.Thread(target=lambda: done.append(out.send("x", in_s(5))))
    t.start()
    time.sleep(0.1)
    assert done == []
    locks[0].release()
    t.join(5)
    assert done == [layout.OK]


def test_the_end_is_compiled_where_mpx_was_built():
    if _impl.pure_requested():  # (as this process started: the finder serves the .py)
        assert shm_end.IMPLEMENTATION == "python"
    elif "cython" in IMPLS:
        assert shm_end.IMPLEMENTATION == _rings("cython").IMPLEMENTATION == "cython"
    assert plain("mpx.transport.shm_end").IMPLEMENTATION == "python"


@pytest.mark.parametrize("build", ["compiled", "plain"])
def test_the_end_lock_excludes_under_contention(build):
    """Threads that switch while they hold it (sleep(0)) lose no update: the fast path (a
    flag, where compiled) and the slow one (a condition) exclude each other."""
    lock = _end_build(build).EndLock()
    count = [0]

    def bump():
        for _ in range(300):
            with lock:
                seen = count[0]
                time.sleep(0)
                count[0] = seen + 1

    ts = [threading.Thread(target=bump) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert count == [1200] and _free(lock)
    with pytest.raises(RuntimeError, match="not held"):
        lock.release()


class _Alarm(Exception):
    pass


def _raise_alarm(*args):
    raise _Alarm()


@pytest.mark.parametrize("build", ["compiled", "plain"])
def test_a_signal_handlers_exception_ends_a_wait_for_the_end_lock(build):
    """As threading.Lock's: the main thread waiting for the lock runs a signal handler,
    whose exception ends the wait; the lock stays usable, and the holder's release wakes
    the next waiter."""
    lock = _end_build(build).EndLock()
    lock.acquire()  # (another thread's, in effect: this one cannot take it again)
    old = signal.signal(signal.SIGALRM, _raise_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(_Alarm):
            lock.acquire()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    got = []
    waiter = threading.Thread(target=lambda: (lock.acquire(), got.append(1), lock.release()))
    waiter.start()
    time.sleep(0.1)
    assert got == []
    lock.release()
    waiter.join(5)
    assert got == [1] and _free(lock)
