"""The channel on the queues' ends (``send``, ``recv``, ``recv_ready``), which the driver and
the workers use: across real processes, over shared memory, ZeroMQ and both at once, on
both ring implementations; and the rule that makes the code that runs the code a reader
finds: no end carries an instance attribute in place of one of its class's methods."""

from __future__ import annotations

import _channel_procs
import numpy as np
import pytest

import mpx
from mpx import _impl
from mpx.protocol import serde
from mpx.queue import deadline_of
from mpx.transport import shm_end
from mpx.transport.shm import ShmReader, ShmWriter

pytestmark = pytest.mark.usefixtures("impl")

KEY = "channel-test-key"

# (readers, local readers, auth key): shared memory, ZeroMQ, and one of each
LAYOUTS = {"shm": (1, 1, ""), "zmq": (1, 0, KEY), "both": (2, 1, KEY)}


def _shadowed(end) -> list[str]:
    """Instance attributes of ``end`` that hide a method of its class."""
    return [name for name in vars(end) if callable(getattr(type(end), name, None))]


def _start(ctx, layout):
    n, n_local, key = LAYOUTS[layout]
    config = mpx.Config(auth_key=key, heartbeat_s=1.0) if key else mpx.Config()
    q = mpx.MessageQueue(n, n_local, config=config)
    h = q.export_handle()
    procs, answers = [], []
    for rank in range(n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_channel_procs.channel_echo,
                        args=(h, rank, key if rank >= n_local else "", child), daemon=True)
        p.start()
        child.close()
        assert parent.poll(60), "the reader did not start"
        a = mpx.MessageQueue.create_from_handle(parent.recv(), 0, config=config)
        procs.append(p)
        answers.append(a)
    q.wait_until_ready(60)
    for a in answers:
        a.wait_until_ready(60)
    return q, procs, answers


def _stop(q, procs, answers):
    try:
        q.writing_end().send(None, deadline_of(30))
        for a in answers:
            assert a.reading_end().recv(deadline_of(30))[0] == "bye"
    finally:
        for p in procs:
            p.join(30)
            assert p.exitcode == 0, p.exitcode
        for a in answers:
            a.close()
        q.close()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_send_and_recv_carry_objects_both_ways_in_order(ctx, layout):
    q, procs, answers = _start(ctx, layout)
    try:
        out = q.writing_end()
        assert _shadowed(out) == []
        for a in answers:
            assert _shadowed(a.reading_end()) == []
        arr = np.arange(300_000, dtype=np.int64)  # out of band: large enough
        msgs = [("call", 1, None), b"x" * 100, {"k": [1, 2.5]}, arr, "last"]
        for m in msgs:
            out.send(m, deadline_of(30))
        for a in answers:
            end = a.reading_end()
            got = [end.recv(deadline_of(30)) for _ in msgs]
            assert [g[0] for g in got] == ["got"] * len(msgs)
            assert got[0][1] == ("call", 1, None) and got[1][1] == b"x" * 100
            assert got[2][1] == {"k": [1, 2.5]} and got[4][1] == "last"
            np.testing.assert_array_equal(got[3][1], arr)
            assert got[3][1].flags.writeable  # an owned copy, not ring memory
    finally:
        _stop(q, procs, answers)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_object_that_cannot_be_encoded_sends_nothing_and_the_channel_goes_on(ctx, layout):
    q, procs, answers = _start(ctx, layout)
    try:
        out = q.writing_end()

        class Refuses:
            def __reduce__(self):
                raise RuntimeError("no pickling this")

        with pytest.raises(Exception, match="no pickling this"):  # (as serde says it)
            out.send(Refuses(), deadline_of(5))
        out.send("after", deadline_of(30))
        for a in answers:
            assert a.reading_end().recv(deadline_of(30)) == ("got", "after")
    finally:
        _stop(q, procs, answers)


def test_recv_ready_decodes_what_is_there_without_waiting_and_replaces_the_undecodable():
    with mpx.MessageQueue(1, 1) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        try:
            end, out = r.reading_end(), q.writing_end()
            assert end.recv_ready(lambda e: ("bad", e)) == []
            out.send(1)
            # a pickle that fails to load, between two good messages
            out.write(serde.K_PICKLE, (b"\x80\x05cno_such_module\nthing\n.",), deadline_of(5))
            out.send((2, "two"))
            got = end.recv_ready(lambda e: ("bad", type(e).__name__))
            assert got == [1, ("bad", "DeserializationError"), (2, "two")]
            with pytest.raises(mpx.QueueTimeout):
                end.recv(deadline_of(0.05))
        finally:
            r.close()


def test_the_shm_ends_are_composed_statically_over_the_ring_their_queue_picked():
    """A queue's shared-memory ends are ShmWriter and ShmReader themselves (no class made
    at run time), each holding its ring, of the build the queue picked, and its end
    (mpx/transport/shm_end.py) over that ring."""
    with mpx.MessageQueue(1, 1) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        try:
            out, end = q.writing_end(), r.reading_end()
            assert type(out) is ShmWriter and type(end) is ShmReader
            rings = _impl.ring_module()
            assert type(out._ring) is rings.RingWriter and type(end._ring) is rings.RingReader
            assert type(out._end) is shm_end.WriterEnd and type(end._end) is shm_end.ReaderEnd
            out.send(("x", 1))
            assert end.recv(deadline_of(5)) == ("x", 1)
        finally:
            r.close()


def test_the_ends_methods_are_their_classes_own_after_attach_and_close():
    """What runs is what a reader finds: nothing patched onto an end, before or after the
    executor's driver and workers attach to it or it closes."""
    with mpx.Executor(Noop, world_size=2) as ex:
        assert ex.collective_rpc("noop") == [None, None]
        group = ex._group
        ends = [group.broadcast.writing_end()] + [r.reading_end() for r in group.resp]
        assert all(_shadowed(e) == [] for e in ends)
    assert all(_shadowed(e) == [] for e in ends)


class Noop:
    def __init__(self, ctx):
        pass

    def noop(self):
        return None
