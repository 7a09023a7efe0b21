"""The ring mechanism itself, in one process (threads as peers), for both implementations."""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest

from mpx import _impl
from mpx import layout as L


def make_ring(n_readers=1, chunk=256, nchunks=4, spin_ns=20_000, yield_ns=200_000,
              poll_ns=20_000_000):
    mod = _impl.ring_module()
    mm = mmap.mmap(-1, L.segment_size(chunk, nchunks, n_readers))
    L.init_header(mm, chunk, nchunks, n_readers, 1234, os.getpid())
    kw = dict(spin_ns=spin_ns, yield_ns=yield_ns, poll_ns=poll_ns)
    w = mod.Ring(mm, -1, **kw)
    rs = [mod.Ring(mm, i, **kw) for i in range(n_readers)]
    return mm, w, rs


def read_ok(r, deadline_ns=-1):
    st, kind, data = r.read(deadline_ns if deadline_ns < 0 else time.monotonic_ns() + deadline_ns)
    assert st == L.OK, st
    return kind, data


def in_s(seconds):
    return time.monotonic_ns() + int(seconds * 1e9)


@pytest.fixture
def ring(impl):
    made = []

    def factory(**kw):
        mm, w, rs = make_ring(**kw)
        made.append((mm, w, rs))
        return w, rs

    yield factory
    for mm, w, rs in made:
        for r in [w, *rs]:
            r.release()
        mm.close()


def test_implementation_matches_request(impl):
    assert _impl.ring_implementation() == ("python" if impl == "python" else "cython")


@pytest.mark.parametrize("size", [0, 1, 255, 256, 257, 511, 512, 513, 1000])
def test_sizes_around_slot_boundaries_single_message(ring, size):
    w, (r,) = ring(chunk=256, nchunks=4)
    payload = bytes(range(256)) * (size // 256 + 1)
    payload = payload[:size]
    assert w.write(L.K_BYTES, (payload,), in_s(2)) == L.OK
    kind, data = read_ok(r)
    assert kind == L.K_BYTES and data == payload


def test_message_larger_than_ring_streams(ring):
    w, (r,) = ring(chunk=256, nchunks=2)
    payload = os.urandom(256 * 40 + 17)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", read_ok(r, int(5e9))))
    t.start()
    assert w.write(L.K_PICKLE_OOB, (payload[:100], payload[100:]), in_s(5)) == L.OK
    t.join(5)
    kind, data = out["v"]
    assert kind == L.K_PICKLE_OOB and isinstance(data, bytearray) and bytes(data) == payload


def test_many_messages_in_order_two_readers(ring):
    w, rs = ring(n_readers=2, chunk=64, nchunks=2)
    msgs = [os.urandom(i % 200) for i in range(500)]
    got = [[], []]

    def reader(i):
        for _ in msgs:
            got[i].append(read_ok(rs[i], int(5e9))[1])

    ts = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for m in msgs:
        assert w.write(L.K_BYTES, (m,), in_s(5)) == L.OK
    for t in ts:
        t.join(10)
    assert got[0] == msgs and got[1] == msgs


def test_writer_times_out_on_full_ring_and_recovers(ring):
    w, (r,) = ring(chunk=64, nchunks=2)
    assert w.write(L.K_BYTES, (b"a",), in_s(1)) == L.OK
    assert w.write(L.K_BYTES, (b"b",), in_s(1)) == L.OK
    t0 = time.monotonic()
    assert w.write(L.K_BYTES, (b"c",), in_s(0.2)) == L.TIMEOUT
    assert 0.15 < time.monotonic() - t0 < 2
    assert read_ok(r)[1] == b"a"
    assert w.write(L.K_BYTES, (b"c",), in_s(1)) == L.OK
    assert [read_ok(r)[1] for _ in range(2)] == [b"b", b"c"]


def test_half_written_message_is_aborted(ring):
    w, (r,) = ring(chunk=64, nchunks=2)
    # 3 slots' worth into a 2-slot ring with nobody reading: the writer gives up mid-message
    assert w.write(L.K_BYTES, (b"x" * 64 * 3,), in_s(0.2)) == L.TIMEOUT
    out = []
    t = threading.Thread(target=lambda: out.extend(read_ok(r, int(5e9))[1] for _ in range(1)))
    t.start()
    assert w.write(L.K_BYTES, (b"next",), in_s(5)) == L.OK
    t.join(5)
    assert out == [b"next"]


def test_reader_timeout_and_slice_then_resume(ring):
    w, (r,) = ring(chunk=64, nchunks=4)
    st, _, _ = r.read(in_s(0.1))
    assert st == L.TIMEOUT
    assert r.read(-1, 20_000_000)[0] == L.SLICE
    w.write(L.K_BYTES, (b"y" * 64 * 2,), in_s(1))
    st, kind, data = r.read(-1, 20_000_000)
    assert st == L.OK and data == b"y" * 128


def test_interrupt_wakes_parked_reader(ring):
    w, (r,) = ring(poll_ns=5_000_000_000)
    res = []
    t = threading.Thread(target=lambda: res.append(r.read(in_s(10))[0]))
    t.start()
    time.sleep(0.3)  # long past spin and yield: parked
    t0 = time.monotonic()
    r.interrupt()
    t.join(5)
    assert res == [L.INTERRUPTED]
    assert time.monotonic() - t0 < 1.0


def test_interrupt_wakes_writer_waiting_for_space(ring):
    w, (r,) = ring(chunk=64, nchunks=2)
    w.write(L.K_BYTES, (b"1",), -1)
    w.write(L.K_BYTES, (b"2",), -1)
    res = []
    t = threading.Thread(target=lambda: res.append(w.write(L.K_BYTES, (b"3",), in_s(10))))
    t.start()
    time.sleep(0.3)
    w.interrupt()
    t.join(5)
    assert res == [L.INTERRUPTED]


def test_shutdown_state_delivers_pending_then_reports(ring):
    w, (r,) = ring()
    w.write(L.K_BYTES, (b"last",), -1)
    w.set_state(L.S_SHUTDOWN)
    assert read_ok(r)[1] == b"last"
    assert r.read(in_s(1))[0] == L.SHUTDOWN


def test_closed_writer_reports_peer_gone_after_drain(ring):
    w, (r,) = ring()
    w.write(L.K_BYTES, (b"m",), -1)
    w.set_state(L.S_CLOSED)
    assert read_ok(r)[1] == b"m"
    assert r.read(in_s(1))[0] == L.PEER_GONE


def test_parked_reader_wakes_fast_on_publish(ring):
    # a 5 s liveness poll: only the futex wake can explain a prompt return
    w, (r,) = ring(poll_ns=5_000_000_000)
    res = []

    def reader():
        res.append(read_ok(r, int(5e9)))
        res.append(time.monotonic())

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    w.write(L.K_BYTES, (b"wake",), -1)
    t.join(5)
    assert res[0][1] == b"wake"
    assert res[1] - t0 < 1.0  # a futex wake, not the 5 s liveness poll


def test_closed_reader_unblocks_writer(ring):
    w, (r,) = ring(chunk=64, nchunks=2)
    w.write(L.K_BYTES, (b"1",), -1)
    w.write(L.K_BYTES, (b"2",), -1)
    res = []
    t = threading.Thread(target=lambda: res.append(w.write(L.K_BYTES, (b"3",), in_s(10))))
    t.start()
    time.sleep(0.2)
    r.mark_reader_closed()
    t.join(5)
    assert res == [L.PEER_GONE] and w.gone_index == 0


def test_cross_implementation_same_layout():
    """A Cython writer and a pure-Python reader share a segment: the layouts agree."""
    pytest.importorskip("mpx._ring")
    from mpx import _ring, _ring_py
    mm = mmap.mmap(-1, L.segment_size(128, 3, 1))
    L.init_header(mm, 128, 3, 1, 1, os.getpid())
    w = _ring.Ring(mm, -1)
    r = _ring_py.Ring(mm, 0)
    payload = os.urandom(1000)
    got = []
    t = threading.Thread(target=lambda: got.append(r.read(in_s(5))))
    t.start()
    assert w.write(L.K_PICKLE_OOB, (payload,), in_s(5)) == L.OK
    t.join(5)
    assert got[0][0] == L.OK and bytes(got[0][2]) == payload
    w2 = _ring_py.Ring(mm, -1)
    r2 = _ring.Ring(mm, 0)
    assert w2.write(L.K_BYTES, (b"back",), in_s(5)) == L.OK
    assert r2.read(in_s(5))[2] == b"back"
    for x in (w, r, w2, r2):
        x.release()
    mm.close()


def test_reader_index_out_of_range(impl):
    mod = _impl.ring_module()
    mm = mmap.mmap(-1, L.segment_size(64, 2, 1))
    L.init_header(mm, 64, 2, 1, 1, os.getpid())
    with pytest.raises(ValueError):
        mod.Ring(mm, 1)
    mm.close()


def test_streamed_write_takes_pieces_as_they_come(ring):
    """With ``total``, parts may be a generator: a relay forwards chunks as they arrive.
    Pieces that overrun or fall short of ``total``, or an exception from the generator,
    abort the message (after some of its slots were published): readers never see it."""
    w, (r,) = ring(chunk=256, nchunks=4)
    got = []
    reader = threading.Thread(target=lambda: got.extend(read_ok(r, 5_000_000_000)
                                                        for _ in range(3)))
    reader.start()
    pieces = [bytes([i]) * 100 for i in range(10)]  # 1000 bytes over 4 slots of 256
    assert w.write(L.K_BYTES, (p for p in pieces), in_s(5), 1000) == L.OK

    def broken():
        yield b"x" * 600  # past two slots: published before the failure
        raise RuntimeError("the network stream broke")
    with pytest.raises(RuntimeError, match="broke"):
        w.write(L.K_BYTES, broken(), in_s(5), 1000)
    with pytest.raises(ValueError, match="exceed"):
        w.write(L.K_BYTES, iter([b"y" * 600, b"y" * 600]), in_s(5), 1000)
    with pytest.raises(ValueError, match="add up to 600"):
        w.write(L.K_BYTES, iter([b"z" * 600]), in_s(5), 1000)
    assert w.write(L.K_BYTES, iter([b"after"]), in_s(5), 5) == L.OK
    assert w.write(L.K_BYTES, [b"a", b"b"], in_s(5)) == L.OK  # total from the parts
    reader.join(10)
    assert got == [(L.K_BYTES, b"".join(pieces)), (L.K_BYTES, b"after"), (L.K_BYTES, b"ab")]
