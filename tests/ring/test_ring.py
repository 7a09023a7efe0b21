"""The ring mechanism itself, in one process (threads as peers), for both implementations."""

from __future__ import annotations

import importlib
import mmap
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import _procs
import pytest
from _env import IMPLS

from mpx import _impl
from mpx.mechanism import layout

# Kinds are the caller's; the ring looks only at KIND_AS_BYTES.
BYTES = 7 | layout.KIND_AS_BYTES  # delivered as bytes
ARRAY = 9                    # delivered as a writable bytearray


def make_ring(n_readers=1, chunk=256, nchunks=4, spin_ns=20_000, yield_ns=200_000,
              poll_ns=20_000_000):
    mod = _impl.ring_module()
    mm = mmap.mmap(-1, layout.segment_size(chunk, nchunks, n_readers))
    layout.init_header(mm, chunk, nchunks, n_readers, 1234, os.getpid())
    kw = dict(spin_ns=spin_ns, yield_ns=yield_ns, poll_ns=poll_ns)
    w = mod.RingWriter(mm, **kw)
    rs = [mod.RingReader(mm, i, **kw) for i in range(n_readers)]
    return mm, w, rs


def read_ok(r, deadline_ns=-1):
    st, kind, data = r.read(deadline_ns if deadline_ns < 0 else time.monotonic_ns() + deadline_ns)
    assert st == layout.OK, st
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
    assert w.write(BYTES, (payload,), in_s(2)) == layout.OK
    kind, data = read_ok(r)
    assert kind == BYTES and data == payload


def test_message_larger_than_ring_streams(ring):
    w, (r,) = ring(chunk=256, nchunks=2)
    payload = os.urandom(256 * 40 + 17)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", read_ok(r, int(5e9))))
    t.start()
    assert w.write(ARRAY, (payload[:100], payload[100:]), in_s(5)) == layout.OK
    t.join(5)
    kind, data = out["v"]
    assert kind == ARRAY and isinstance(data, bytearray) and bytes(data) == payload


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
        assert w.write(BYTES, (m,), in_s(5)) == layout.OK
    for t in ts:
        t.join(10)
    assert got[0] == msgs and got[1] == msgs


def test_writer_times_out_on_full_ring_and_recovers(ring):
    w, (r,) = ring(chunk=64, nchunks=2)
    assert w.write(BYTES, (b"a",), in_s(1)) == layout.OK
    assert w.write(BYTES, (b"b",), in_s(1)) == layout.OK
    t0 = time.monotonic()
    assert w.write(BYTES, (b"c",), in_s(0.2)) == layout.TIMEOUT
    assert 0.15 < time.monotonic() - t0 < 2
    assert read_ok(r)[1] == b"a"
    assert w.write(BYTES, (b"c",), in_s(1)) == layout.OK
    assert [read_ok(r)[1] for _ in range(2)] == [b"b", b"c"]


def test_half_written_message_is_aborted(ring):
    w, (r,) = ring(chunk=64, nchunks=2)
    # 3 slots' worth into a 2-slot ring with nobody reading: the writer gives up mid-message
    assert w.write(BYTES, (b"x" * 64 * 3,), in_s(0.2)) == layout.TIMEOUT
    out = []
    t = threading.Thread(target=lambda: out.extend(read_ok(r, int(5e9))[1] for _ in range(1)))
    t.start()
    assert w.write(BYTES, (b"next",), in_s(5)) == layout.OK
    t.join(5)
    assert out == [b"next"]


def test_reader_timeout_and_slice_then_resume(ring):
    w, (r,) = ring(chunk=64, nchunks=4)
    st, _, _ = r.read(in_s(0.1))
    assert st == layout.TIMEOUT
    assert r.read(-1, 20_000_000)[0] == layout.SLICE
    w.write(BYTES, (b"y" * 64 * 2,), in_s(1))
    st, kind, data = r.read(-1, 20_000_000)
    assert st == layout.OK and data == b"y" * 128


def test_interrupt_wakes_parked_reader(ring):
    w, (r,) = ring(poll_ns=5_000_000_000)
    res = []
    t = threading.Thread(target=lambda: res.append(r.read(in_s(10))[0]))
    t.start()
    time.sleep(0.3)  # long past spin and yield: parked
    t0 = time.monotonic()
    r.interrupt()
    t.join(5)
    assert res == [layout.INTERRUPTED]
    assert time.monotonic() - t0 < 1.0


def test_interrupt_wakes_writer_waiting_for_space(ring):
    w, (r,) = ring(chunk=64, nchunks=2)
    w.write(BYTES, (b"1",), -1)
    w.write(BYTES, (b"2",), -1)
    res = []
    t = threading.Thread(target=lambda: res.append(w.write(BYTES, (b"3",), in_s(10))))
    t.start()
    time.sleep(0.3)
    w.interrupt()
    t.join(5)
    assert res == [layout.INTERRUPTED]


def test_shutdown_state_delivers_pending_then_reports(ring):
    w, (r,) = ring()
    w.write(BYTES, (b"last",), -1)
    w.set_state(layout.S_SHUTDOWN)
    assert read_ok(r)[1] == b"last"
    assert r.read(in_s(1))[0] == layout.SHUTDOWN


def test_closed_writer_reports_peer_gone_after_drain(ring):
    w, (r,) = ring()
    w.write(BYTES, (b"m",), -1)
    w.set_state(layout.S_CLOSED)
    assert read_ok(r)[1] == b"m"
    assert r.read(in_s(1))[0] == layout.PEER_GONE


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
    w.write(BYTES, (b"wake",), -1)
    t.join(5)
    assert res[0][1] == b"wake"
    assert res[1] - t0 < 1.0  # a futex wake, not the 5 s liveness poll


def test_the_yield_budget_shrinks_for_long_waits_and_grows_back_for_short_ones(ring):
    """A reader whose messages come later than its yield window parks at once after a few
    waits (halving its yield budget each time), and one whose messages come within the
    window yields again: the budget doubles until its yield phase finds them."""
    window = 50_000_000  # 50 ms: wide, so that the host's load cannot blur the two cases
    w, (r,) = ring(spin_ns=0, yield_ns=window)
    assert r.yield_budget_ns == window

    def one_after(seconds):
        t = threading.Timer(seconds, w.write, args=(BYTES, (b"x",), -1))
        t.start()
        read_ok(r, int(10e9))
        t.join()

    for _ in range(5):
        one_after(0.12)  # > the window: yielding could not have found it
    assert r.yield_budget_ns <= window // 32
    r.read(0)  # a read that waits for nothing leaves the budget as it is
    assert r.yield_budget_ns <= window // 32
    grown = [r.yield_budget_ns]
    for _ in range(14):
        one_after(0.002)  # well within the window: a yield phase would have found it
        grown.append(r.yield_budget_ns)
    assert all(a <= b <= window for a, b in zip(grown, grown[1:])), grown
    assert grown[-1] >= 2_000_000 and grown[-1] > grown[0], grown


def test_wake_readers_wakes_a_parked_reader_ahead_of_the_message(impl):
    # a 5 s liveness poll: only the early wake can end the park; then the reader polls
    # for its yield time (0.3 s), parks again, and still gets the message
    mm, w, (r,) = make_ring(yield_ns=300_000_000, poll_ns=5_000_000_000)
    res = []
    t = threading.Thread(target=lambda: res.append(read_ok(r, int(10e9))))
    try:
        w.wake_readers()  # nobody parked: nothing happens
        t.start()
        assert _procs.until(lambda: _procs.reader_parked(mm), 2.0)
        w.wake_readers()
        assert _procs.until(lambda: not _procs.reader_parked(mm), 0.25)  # awake, polling
        assert _procs.until(lambda: _procs.reader_parked(mm), 2.0)       # nothing came: parked again
        assert not res
    finally:
        w.write(BYTES, (b"after",), -1)
        t.join(5)
        assert res[0][1] == b"after"
        w.release()
        r.release()
        mm.close()
    w.wake_readers()  # released: nothing to wake, nothing raised


def test_closed_reader_unblocks_writer(ring):
    w, (r,) = ring(chunk=64, nchunks=2)
    w.write(BYTES, (b"1",), -1)
    w.write(BYTES, (b"2",), -1)
    res = []
    t = threading.Thread(target=lambda: res.append(w.write(BYTES, (b"3",), in_s(10))))
    t.start()
    time.sleep(0.2)
    r.mark_closed()
    t.join(5)
    assert res == [layout.PEER_GONE] and w.gone_index == 0


def test_a_writer_that_releases_gone_readers_writes_past_them(ring):
    """With ``release_gone`` (a follower's relay ring: its dead worker's rank is started
    again elsewhere), a reader that closed while holding the writer up is released, as
    release_reader does, and the write goes on; the other reader reads everything."""
    w, (gone, stays) = ring(n_readers=2, chunk=64, nchunks=2)
    w.release_gone = True
    w.write(BYTES, (b"1",), -1)
    w.write(BYTES, (b"2",), -1)
    assert read_ok(stays, in_s(5))[1] == b"1"
    res = []
    t = threading.Thread(target=lambda: res.append(w.write(BYTES, (b"3",), in_s(10))))
    t.start()
    time.sleep(0.2)
    assert not res  # (held up by the reader that has read nothing)
    gone.mark_closed()
    t.join(5)
    assert res == [layout.OK] and w.released_gone == 1 and w.gone_index == -1
    assert read_ok(stays, in_s(5))[1] == b"2"
    assert w.write(BYTES, (b"4",), in_s(5)) == layout.OK
    assert [read_ok(stays, in_s(5))[1] for _ in range(2)] == [b"3", b"4"]


def _segment(chunk, nchunks, n_readers):
    mm = mmap.mmap(-1, layout.segment_size(chunk, nchunks, n_readers))
    layout.init_header(mm, chunk, nchunks, n_readers, 1, os.getpid())
    return mm


@pytest.mark.parametrize("writer_impl", ["cython", "python"])
def test_cross_implementation_same_layout(writer_impl):
    """A writer of one implementation and a reader of the other share a segment: the
    layouts agree."""
    if "cython" not in IMPLS:  # (a pure run's process cannot load the compiled ring)
        pytest.skip("this run tests the python ring only")
    pytest.importorskip("mpx._ring")
    from mpx import _ring, _ring_py
    wmod, rmod = (_ring, _ring_py) if writer_impl == "cython" else (_ring_py, _ring)
    mm = _segment(128, 3, 1)
    w = wmod.RingWriter(mm)
    r = rmod.RingReader(mm, 0)
    payload = os.urandom(1000)
    got = []
    t = threading.Thread(target=lambda: got.extend([r.read(in_s(5)), r.read(in_s(5))]))
    t.start()
    assert w.write(ARRAY, (payload,), in_s(5)) == layout.OK
    assert w.write(BYTES, (b"back",), in_s(5)) == layout.OK
    t.join(5)
    assert got[0][:2] == (layout.OK, ARRAY) and isinstance(got[0][2], bytearray)
    assert bytes(got[0][2]) == payload
    assert got[1] == (layout.OK, BYTES, b"back")
    assert w.readers()[0][:3] == (os.getpid(), True, False)
    for x in (w, r):
        x.release()
    mm.close()


def test_reader_index_out_of_range(impl):
    mod = _impl.ring_module()
    mm = _segment(64, 2, 1)
    with pytest.raises(ValueError):
        mod.RingReader(mm, 1)
    with pytest.raises(ValueError):
        mod.RingReader(mm, -1)
    mm.close()


def test_attach_claims_the_reader_block_once(impl):
    """Building a reader attaches it (pid, attached): the writer sees who is there, and a
    second reader for the same index is refused."""
    mod = _impl.ring_module()
    mm = _segment(64, 2, 2)
    w = mod.RingWriter(mm)
    assert not w.all_attached()
    r0 = mod.RingReader(mm, 0)
    with pytest.raises(ValueError, match="already attached"):
        mod.RingReader(mm, 0)
    assert [rd[:3] for rd in w.readers()] == [(os.getpid(), True, False), (0, False, False)]
    assert not r0.all_attached()
    r1 = mod.RingReader(mm, 1)
    assert w.all_attached() and r0.all_attached()
    r1.mark_closed()
    assert w.readers()[1][2] is True
    for x in (w, r0, r1):
        x.release()
    mm.close()


@pytest.mark.parametrize("kind", [0, 1, 2, 3, 0x7FFF, 0xABCD0000, BYTES, ARRAY])
@pytest.mark.parametrize("size", [10, 700])  # one slot, several
def test_kind_is_opaque_but_for_the_bytes_bit(ring, kind, size):
    w, (r,) = ring(chunk=256, nchunks=4)
    payload = os.urandom(size)
    assert w.write(kind, (payload,), in_s(5)) == layout.OK
    got_kind, data = read_ok(r, int(5e9))
    assert got_kind == kind and bytes(data) == payload
    assert type(data) is (bytes if kind & layout.KIND_AS_BYTES else bytearray)


def test_free_slots_and_has_room(ring):
    w, (r,) = ring(chunk=64, nchunks=3)
    three = (b"x" * 100, bytearray(60), memoryview(b"y" * 32))  # 192 bytes: three slots
    assert w.free_slots() == 3 and w.has_room(three) and w.has_room((b"x" * 1000,))
    w.write(BYTES, (b"x" * 100,), in_s(1))  # two slots
    assert w.free_slots() == 1 and w.has_room((b"x" * 64,)) and w.has_room(())
    assert not w.has_room((b"x" * 65,)) and not w.has_room((b"x" * 10, b"y" * 60))
    assert not w.has_room((b"x" * 1000,))  # larger than the ring: needs every slot free
    read_ok(r)
    assert w.has_room(three) and w.has_room((b"x" * 1000,)) and w.free_slots() == 3


def test_writer_park_interrupted_by_a_signal_waits_on(ring):
    """A signal whose handler returns wakes a writer parked for space; it runs the handler
    and keeps waiting (the write succeeds once a reader frees a slot)."""
    w, (r,) = ring(chunk=64, nchunks=1, spin_ns=0, yield_ns=1000)
    w.write(BYTES, (b"full",), -1)
    seen = []
    old = signal.signal(signal.SIGALRM, lambda *a: seen.append(1))
    t = threading.Timer(0.6, lambda: read_ok(r, int(5e9)))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t.start()
        assert w.write(BYTES, (b"next",), in_s(5)) == layout.OK
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        t.join(5)
    assert seen == [1]
    assert read_ok(r, int(5e9))[1] == b"next"


def _pxi_constants() -> dict[str, int]:
    text = (Path(layout.__file__).parent.parent / "_ring_layout.pxi").read_text()
    body = text.split("cdef enum:", 1)[1]
    out = {}
    for line in body.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, value = (x.strip() for x in line.split("="))
            out[name] = int(value, 0)
    return out


def test_the_pxi_and_layout_py_agree():
    """The compiled ring takes its layout from _ring_layout.pxi, the pure one from
    layout.py: every constant of one is in the other, with the same value."""
    pxi = _pxi_constants()
    assert len(pxi) > 30
    for name, value in pxi.items():
        assert getattr(layout, name) == value, name
    py = {n for n, v in vars(layout).items()
          if n.isupper() and not n.startswith("_") and isinstance(v, int)}
    assert py - set(pxi) == {"MAGIC", "VERSION", "CACHE_LINE"}


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
    assert w.write(BYTES, (p for p in pieces), in_s(5), 1000) == layout.OK

    def broken():
        yield b"x" * 600  # past two slots: published before the failure
        raise RuntimeError("the network stream broke")
    with pytest.raises(RuntimeError, match="broke"):
        w.write(BYTES, broken(), in_s(5), 1000)
    with pytest.raises(ValueError, match="exceed"):
        w.write(BYTES, iter([b"y" * 600, b"y" * 600]), in_s(5), 1000)
    with pytest.raises(ValueError, match="add up to 600"):
        w.write(BYTES, iter([b"z" * 600]), in_s(5), 1000)
    assert w.write(BYTES, iter([b"after"]), in_s(5), 5) == layout.OK
    assert w.write(BYTES, [b"a", b"b"], in_s(5)) == layout.OK  # total from the parts
    reader.join(10)
    assert got == [(BYTES, b"".join(pieces)), (BYTES, b"after"), (BYTES, b"ab")]


@pytest.mark.parametrize("as_bytes", [True, False])
def test_assembler_builds_an_owned_message(impl, as_bytes):
    out = importlib.import_module("mpx.mechanism.codec").Assembler(10, as_bytes)
    out.add(b"abc")
    assert not out.complete
    with pytest.raises(ValueError, match="incomplete"):
        out.result()
    with pytest.raises(ValueError, match="overruns"):
        out.add(b"x" * 8)
    out.add(memoryview(bytearray(b"defghij")))
    assert out.complete
    data = out.result()
    assert data == b"abcdefghij" and type(data) is (bytes if as_bytes else bytearray)
    with pytest.raises(ValueError, match="already taken"):
        out.result()


def test_read_ready_takes_every_published_message_without_waiting(ring):
    w, (r,) = ring(chunk=64, nchunks=8)
    t0 = time.monotonic()
    assert r.read_ready() == (layout.OK, [])
    assert w.write(BYTES, (b"a",), in_s(1)) == layout.OK
    assert w.write(ARRAY, (b"y" * 150,), in_s(1)) == layout.OK  # three slots
    assert w.write(BYTES, (b"c",), in_s(1)) == layout.OK
    st, got = r.read_ready()
    assert st == layout.OK
    assert got == [(BYTES, b"a"), (ARRAY, bytearray(b"y" * 150)), (BYTES, b"c")]
    assert type(got[1][1]) is bytearray
    assert r.read_ready() == (layout.OK, [])
    assert time.monotonic() - t0 < 1  # nothing waited for the next message
    assert w.write(BYTES, (b"d",), in_s(1)) == layout.OK
    assert read_ok(r) == (BYTES, b"d")  # read() goes on where read_ready() stopped


def test_read_ready_skips_an_aborted_message_at_the_end(ring):
    w, (r,) = ring(chunk=64, nchunks=2)
    assert w.write(BYTES, (b"x" * 64 * 3,), in_s(0.2)) == layout.TIMEOUT  # gives up mid-way
    t0 = time.monotonic()
    st, got = r.read_ready()
    assert (st, got) == (layout.OK, [])
    assert time.monotonic() - t0 < 1
    assert w.write(BYTES, (b"next",), in_s(1)) == layout.OK
    assert r.read_ready() == (layout.OK, [(BYTES, b"next")])


def test_read_with_lends_a_large_single_slot_message_then_releases_it(ring):
    w, (r,) = ring(chunk=256, nchunks=4)
    got = []

    def keep_type(kind, data):
        got.append((kind, type(data), bytes(data), getattr(data, "readonly", None)))
        return len(data)

    w.write(BYTES, (b"x" * 200,), -1)
    assert r.read_with(keep_type, 100) == (layout.OK, BYTES, 200)
    assert got[-1] == (BYTES, memoryview, b"x" * 200, True)  # lent, read-only
    assert w.free_slots() == 4  # the slot went back once consume returned
    w.write(BYTES, (b"y" * 50,), -1)  # below in_place_min: an owned copy
    assert r.read_with(keep_type, 100)[2] == 50 and got[-1][1] is bytes
    w.write(ARRAY, (b"z" * 200,), -1)  # not KIND_AS_BYTES: an owned bytearray
    assert r.read_with(keep_type, 100)[2] == 200 and got[-1][1] is bytearray
    w.write(BYTES, (b"m" * 600,), -1)  # spans slots: an owned copy
    assert r.read_with(keep_type, 100)[2] == 600 and got[-1][1] is bytes


def test_read_with_consume_errors_and_kept_views(ring):
    w, (r,) = ring(chunk=256, nchunks=2)
    kept = []

    def fail(kind, data):
        kept.append(data)
        raise KeyError("bad message")

    w.write(BYTES, (b"a" * 200,), -1)
    with pytest.raises(KeyError):
        r.read_with(fail, 100)
    with pytest.raises(ValueError):
        kept[0][0]  # the view was released: it cannot alias the slot the writer reuses
    w.write(BYTES, (b"b" * 200,), -1)
    with pytest.raises(RuntimeError, match="kept a view"):
        r.read_with(lambda kind, data: kept.append(pickle.PickleBuffer(data)), 100)
    kept.clear()
    w.write(BYTES, (b"c" * 200,), -1)  # the ring goes on
    assert r.read_with(lambda kind, data: bytes(data), 100)[2] == b"c" * 200
