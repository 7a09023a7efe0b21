"""A ZeroMQ queue's link outlives its TCP connection (mpx/transport/zmq_link.py): a reader
reached through a proxy that resets every connection (tests/_tcp_proxy.py) gets every
message once, in order; a link broken past the grace is the peer lost, at both ends; the
writer holds a bounded window of frames for resends."""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time

import pytest
from _tcp_proxy import Proxy

import mpx
from mpx.transport.zmq_link import WINDOW_PER_CHUNKS

KEY = "link-test-key-0123456789abcdef"


def _config(**kw) -> mpx.Config:
    return mpx.Config(auth_key=KEY, transport="zmq", heartbeat_s=1.0, **kw)


class _Pair:
    """A writer and its one remote reader, which reaches it through a Proxy."""

    def __init__(self, cfg: mpx.Config) -> None:
        self.writer = mpx.MessageQueue(1, 0, config=cfg)
        h = self.writer.export_handle()
        port = int(h.zmq["endpoint"].rsplit(":", 1)[1])
        self.proxy = Proxy(port)
        through = dataclasses.replace(h, zmq={**h.zmq, "endpoint": self.proxy.endpoint})
        self.reader = mpx.MessageQueue.create_from_handle(through, 0, config=cfg)
        self.writer.wait_until_ready(10)

    def close(self) -> None:
        self.reader.close()
        self.writer.close()
        self.proxy.close()


@pytest.fixture
def pair(request):
    made = _Pair(_config(**getattr(request, "param", {})))
    yield made
    made.close()


def _message(i: int):
    # every 50th: 2.5 chunks of 1 MiB, so that resets also fall inside a message
    return os.urandom((5 << 20) // 2) if i % 50 == 7 else ("small", i)


def test_resets_lose_double_and_reorder_nothing(pair):
    n = 600
    sent = [_message(i) for i in range(n)]
    got: list = []
    errors: list = []

    def read():
        try:
            for _ in range(n):
                got.append(pair.reader.dequeue(timeout=30))
        except BaseException as e:  # (reported below)
            errors.append(e)

    t = threading.Thread(target=read)
    t.start()
    rng = random.Random(5)
    resets_at = sorted(rng.sample(range(20, n - 20), 6))
    for i, m in enumerate(sent):
        if resets_at and i == resets_at[0]:
            resets_at.pop(0)
            pair.proxy.reset()
        try:
            pair.writer.enqueue(m, timeout=30)
        except mpx.QueueTimeout:
            raise AssertionError(f"message {i} could not be sent; the reader: {errors}") from None
    t.join(60)
    assert not errors, errors
    assert len(got) == n
    for i, (a, b) in enumerate(zip(got, sent)):
        assert a == b, f"message {i} differs"
    reader = pair.reader._reader
    assert reader.resumes >= 1 and reader.link_counts() == (0, reader.resumes, 0)
    assert pair.writer.link_counts()[1] == reader.resumes


@pytest.mark.parametrize("pair", [{"link_grace_s": 0.5}], indirect=True)
def test_a_link_broken_past_the_grace_is_the_peer_lost_at_both_ends(pair):
    pair.writer.enqueue("first")
    assert pair.reader.dequeue(timeout=5) == "first"
    pair.proxy.reset(refuse=True)
    t0 = time.monotonic()
    with pytest.raises(mpx.PeerDiedError, match=r"lost the writer .*\(link_grace_s"):
        pair.reader.dequeue(timeout=10)
    assert 0.5 <= time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    with pytest.raises(mpx.PeerDiedError, match="reader rank 0 disconnected") as ei:
        while time.monotonic() - t0 < 10:
            pair.writer.enqueue("into the void", timeout=1)
            time.sleep(0.05)
    assert ei.value.rank == 0
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("pair", [{"max_chunks": 2, "link_grace_s": 30.0}], indirect=True)
def test_a_writer_holds_a_bounded_window_for_a_reader_that_is_away(pair):
    window = WINDOW_PER_CHUNKS * 2
    pair.writer.enqueue(-1)
    assert pair.reader.dequeue(timeout=5) == -1
    pair.proxy.reset(refuse=True)
    time.sleep(0.3)  # (the writer's next send finds the reader's connection gone)
    for i in range(window - 1):  # (the window holds one unacknowledged frame already)
        pair.writer.enqueue(i, timeout=5)
    with pytest.raises(mpx.QueueTimeout, match="rank 0 has not acknowledged"):
        pair.writer.enqueue("one too many", timeout=0.3)
    pair.proxy.allow()
    assert [pair.reader.dequeue(timeout=10) for _ in range(window - 1)] == list(range(window - 1))
    pair.writer.enqueue("after", timeout=5)
    assert pair.reader.dequeue(timeout=5) == "after"


@pytest.mark.parametrize("ready_by", ["wait_until_ready", "missing_readers"])
def test_an_idle_writer_lets_its_reader_back_in_however_it_became_ready(ready_by):
    """A reader whose link broke is let back in and answered while its writer writes
    nothing, whichever call took the readers' HELLOs: wait_until_ready, or a look at who is
    missing (the executor's; then the first write finds the writer ready)."""
    cfg = _config()
    writer = mpx.MessageQueue(1, 0, config=cfg)
    h = writer.export_handle()
    proxy = Proxy(int(h.zmq["endpoint"].rsplit(":", 1)[1]))
    through = dataclasses.replace(h, zmq={**h.zmq, "endpoint": proxy.endpoint})
    reader = mpx.MessageQueue.create_from_handle(through, 0, config=cfg)
    try:
        if ready_by == "wait_until_ready":
            writer.wait_until_ready(10)
        else:
            deadline = time.monotonic() + 10
            while writer.writing_end().missing_readers():
                assert time.monotonic() < deadline, "the reader never said HELLO"
                time.sleep(0.01)
        writer.enqueue("first", timeout=10)
        assert reader.dequeue(timeout=10) == "first"
        proxy.reset()
        with pytest.raises(mpx.QueueTimeout):
            reader.dequeue(timeout=1.5)  # (reading: it reconnects and asks to resume)
        assert reader._reader.resumes == 1, reader._reader.link_state()
        assert reader._reader.link_state() == ""
        writer.enqueue("after", timeout=5)
        assert reader.dequeue(timeout=5) == "after"
    finally:
        reader.close()
        writer.close()
        proxy.close()


def test_a_reader_whose_hello_went_with_a_broken_connection_joins_by_its_resume():
    """A reader that reconnects before its writer took its HELLO (an idle writer takes what
    came when it first writes) loses the HELLO with the old connection: its RESUME joins
    it, and it reads what is written from then on."""
    cfg = _config()
    writer = mpx.MessageQueue(1, 0, config=cfg)
    reader = mpx.MessageQueue.create_from_handle(writer.export_handle(), 0, config=cfg)
    try:
        time.sleep(0.3)  # (connected, by TCP: the writer has not answered for it yet)
        reader._reader.reconnect_now()
        with pytest.raises(mpx.QueueTimeout):
            reader.dequeue(timeout=0.3)  # (reading: it reconnects and asks to resume)
        writer.enqueue("first", timeout=5)
        assert reader.dequeue(timeout=5) == "first"
        assert reader._reader.link_state() == ""
    finally:
        reader.close()
        writer.close()
