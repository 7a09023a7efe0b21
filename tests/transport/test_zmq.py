"""MessageQueue readers over ZeroMQ (TCP on loopback): delivery, authentication, failures."""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import signal
import socket
import threading
import time

import _procs
import _workers
import numpy as np
import pytest
import zmq
import zmq.utils.garbage
from _env import START_METHOD

import mpx
from mpx import auth
from mpx.transport.zmq_framing import HEADER, MAGIC, VERSION

KEY = "test-key-" + "x" * 20


@pytest.fixture
def cfg():
    return mpx.Config(auth_key=KEY, heartbeat_s=1.0)


def test_local_and_remote_readers_get_everything_in_order(ctx, cfg):
    rnd = np.random.default_rng(3)
    msgs = [("small", i) for i in range(50)] + \
           [rnd.integers(0, 255, size=int(n), dtype=np.uint8) for n in (0, 10, 5000, 3 << 20)] + \
           [os.urandom(70000), b"", {"nested": np.arange(10)}]
    # ranks 0 and 2 read over shared memory, rank 1 over zmq
    with mpx.MessageQueue(3, 2, local_reader_ranks=[0, 2], config=cfg) as q:
        h = q.export_handle()
        # rank 3 is accepted too: a vLLM writer numbers readers by group rank, its own free
        assert h.shm["shm_ranks"] == (0, 2) and h.zmq["zmq_ranks"] == (1, 3)
        procs = [_procs.start(ctx, _procs.with_key, KEY, _procs.checking_reader, h, r, len(msgs), 1)
                 for r in range(3)]
        q.wait_until_ready(30)
        for m in msgs:
            q.enqueue(m, timeout=30)
        expect = [_procs.summary(m) for m in msgs]
        for p, conn in procs:
            assert conn.poll(60)
            tag, got = conn.recv()
            assert tag == "done", got
            assert got == expect
            p.join(10)


def test_transport_zmq_for_local_readers(cfg):
    z = dataclasses.replace(cfg, transport="zmq")
    with mpx.MessageQueue(1, 1, config=z) as q:
        h = q.export_handle()
        assert h.shm is None and h.zmq["zmq_ranks"] == (0,)
        r = mpx.MessageQueue.create_from_handle(h, 0, config=cfg)
        try:
            q.wait_until_ready(10)
            r.wait_until_ready(10)
            arr = np.arange(1000.0)
            q.enqueue(arr)
            got = r.dequeue(timeout=5)
            assert (got == arr).all() and got.flags.writeable
            with pytest.raises(mpx.QueueTimeout):
                r.dequeue(timeout=0.2)
        finally:
            r.close()


def _zmq_io_threads(pid: int | str = "self") -> int:
    """How many libzmq I/O threads process ``pid`` runs (one per live context)."""
    names = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            pass  # (ended meanwhile)
    return sum(n.startswith("ZMQbg/IO") for n in names)


def _through_a_new_queue(cfg, obj):
    """``obj`` as a reader of a queue made for it got it; the queue closed."""
    with mpx.MessageQueue(1, 0, config=cfg) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=cfg)
        try:
            q.wait_until_ready(10)
            q.enqueue(obj)
            return r.dequeue(timeout=5)
        finally:
            r.close()


def _at_rest(cfg) -> int:
    """_zmq_io_threads() once a queue was opened, used and closed: the first tracked send of a
    process (ZmqWriter._flush) starts pyzmq's garbage collector, whose context stays; its I/O
    thread is counted once it has named itself (it starts under this thread's name)."""
    _through_a_new_queue(cfg, 0)
    collector = 1 if zmq.utils.garbage.gc.is_alive() else 0
    assert _procs.until(lambda: _zmq_io_threads() >= collector, 5)
    return _zmq_io_threads()


def test_a_process_s_ends_share_one_io_thread_and_a_second_writer_has_its_own(cfg):
    base = _at_rest(cfg)
    q1 = mpx.MessageQueue(1, 0, config=cfg)
    ends = [q1]
    try:
        r1 = mpx.MessageQueue.create_from_handle(q1.export_handle(), 0, config=cfg)
        ends.append(r1)
        # (a thread names itself once it runs: hence the waits)
        assert _procs.until(lambda: _zmq_io_threads() == base + 1, 5)  # writer and reader: one
        time.sleep(0.05)
        assert _zmq_io_threads() == base + 1
        # a second writer alive beside the first binds a ZAP handler of its own: its own context
        q2 = mpx.MessageQueue(1, 0, config=cfg)
        ends.append(q2)
        r2 = mpx.MessageQueue.create_from_handle(q2.export_handle(), 0, config=cfg)
        ends.append(r2)
        assert _procs.until(lambda: _zmq_io_threads() == base + 2, 5)
        for q, r, tag in ((q1, r1, "one"), (q2, r2, "two")):
            q.wait_until_ready(10)
            q.enqueue((tag, np.arange(5)))
            got = r.dequeue(timeout=5)
            assert got[0] == tag and (got[1] == np.arange(5)).all()
        # the second writer still refuses readers that come after it was ready
        late = mpx.MessageQueue.create_from_handle(q2.export_handle(), 0, config=cfg)
        ends.append(late)
        q2.enqueue("after")
        with pytest.raises(mpx.QueueTimeout):
            late.dequeue(timeout=0.5)
        assert r2.dequeue(timeout=5) == "after"
        q1.close()
        r1.close()
        # the first writer gone, a new one takes the shared context (and its ZAP handler)
        q3 = mpx.MessageQueue(1, 0, config=cfg)
        ends.append(q3)
        r3 = mpx.MessageQueue.create_from_handle(q3.export_handle(), 0, config=cfg)
        ends.append(r3)
        q3.wait_until_ready(10)
        q3.enqueue(3)
        assert r3.dequeue(timeout=5) == 3
    finally:
        for e in reversed(ends):
            e.close()
    # the last end out terminated each context: no I/O thread is left behind
    assert _procs.until(lambda: _zmq_io_threads() == base, 5)


def _in_a_fork(inherited, cfg, conn):
    """(forked child) New ends work on a context of the child's own; closing what it
    inherited calls nothing of libzmq on its sockets (a send there could wait forever on a
    lock the parent's I/O thread held at the fork; terminating the context, for that
    thread, which is not here): sends ``(what the new queue carried, the socket calls
    the closes made)``."""
    got = _through_a_new_queue(cfg, "in the child")
    made = []
    for name in ("send", "send_multipart", "recv", "poll", "getsockopt", "disable_monitor"):
        setattr(zmq.Socket, name, lambda self, *a, _name=name, **kw: made.append(_name))
    for end in inherited:
        end.close()
    conn.send((got, made))


def test_a_forked_child_closes_what_it_inherited_without_hanging(cfg):
    q = mpx.MessageQueue(1, 0, config=cfg)
    r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=cfg)
    fork = multiprocessing.get_context("fork")
    here, there = fork.Pipe()
    child = fork.Process(target=_in_a_fork, args=((q, r), cfg, there))
    try:
        q.wait_until_ready(10)
        child.start()
        assert here.poll(30), "the forked child hung"
        assert here.recv() == ("in the child", [])
        child.join(10)
        assert child.exitcode == 0
        q.enqueue("still the parent's")
        assert r.dequeue(timeout=5) == "still the parent's"
    finally:
        if child.pid is not None and child.exitcode is None:
            child.kill()
            child.join(5)
        r.close()
        q.close()


def test_a_zmq_worker_runs_one_io_thread_and_the_driver_s_context_ends_at_shutdown():
    base = _at_rest(mpx.Config(auth_key=KEY, heartbeat_s=1.0))
    ex = mpx.Executor(_workers.Echo, 1, transport="zmq", auth_key=KEY, heartbeat_s=1.0,
                      start_method=START_METHOD, startup_timeout_s=60)
    try:
        assert ex.collective_rpc("mul", args=(3,)) == [3]
        # the worker's call reader and reply writer share one context, as do the driver's
        # broadcast writer and reply reader
        assert _zmq_io_threads(ex.worker_pids[0]) == 1
        assert _procs.until(lambda: _zmq_io_threads() == base + 1, 5)
    finally:
        ex.shutdown()
    assert _procs.until(lambda: _zmq_io_threads() == base, 5)


@pytest.mark.parametrize("nbytes", [100, 3 << 20])
def test_a_writer_closed_before_its_process_s_other_ends_still_delivers(ctx, cfg, nbytes):
    small = dataclasses.replace(cfg, max_chunks=2)  # (much of the message still queued)
    with mpx.MessageQueue(1, 0, config=small) as calls:
        here, there = ctx.Pipe()
        child = ctx.Process(target=_procs.with_key,
                            args=(KEY, _procs.write_then_exit, calls.export_handle(), small, nbytes,
                                  there))
        child.start()
        try:
            assert here.poll(30)
            r = mpx.MessageQueue.create_from_handle(here.recv(), 0, config=small)
            try:
                calls.wait_until_ready(10)
                got = r.dequeue(timeout=30)
                assert got.nbytes == nbytes and (got == 7).all()
            finally:
                r.close()
            child.join(10)
            assert child.exitcode == 0
        finally:
            if child.exitcode is None:
                child.kill()
                child.join(5)


def test_no_key_refuses_unless_insecure_allowed():
    with pytest.raises(ValueError, match="MPX_ALLOW_INSECURE"):
        mpx.MessageQueue(1, 0, config=mpx.Config())
    with mpx.MessageQueue(1, 0, config=mpx.Config(allow_insecure=True)) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0,
                                                config=mpx.Config(allow_insecure=True))
        q.wait_until_ready(10)
        q.enqueue("insecure but working")
        assert r.dequeue(timeout=5) == "insecure but working"
        r.close()


def test_wrong_key_reader_is_refused_and_honest_one_works(cfg):
    with mpx.MessageQueue(2, 0, config=cfg) as q:
        h = q.export_handle()
        bad = mpx.MessageQueue.create_from_handle(h, 1, config=dataclasses.replace(cfg, auth_key="wrong"))
        good = mpx.MessageQueue.create_from_handle(h, 0, config=cfg)
        try:
            with pytest.raises(mpx.QueueTimeout, match=r"ranks \[1\]"):
                q.wait_until_ready(1.0)
            assert q.writing_end().drops.count >= 1
        finally:
            bad.close()
            good.close()


def _forge(endpoint, frames, identity=b"attacker"):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, identity)
    s.connect(endpoint)
    s.send_multipart(frames)
    return s


def _feeder(reader):
    """(a ROUTER, the reader's identity on it): a writer-side socket that pushes messages
    at the reader is impossible (the reader connects out), so its receive path is fed
    through a ROUTER of our own that it connects to as well."""
    evil = zmq.Context.instance().socket(zmq.ROUTER)
    evil.setsockopt(zmq.LINGER, 0)
    port = evil.bind_to_random_port("tcp://127.0.0.1")
    reader._sock.connect(f"tcp://127.0.0.1:{port}")
    # the DEALER deals round-robin: send until the ROUTER has learnt its identity
    for _ in range(20):
        reader._sock.send_multipart([b"x"])
        if evil.poll(200):
            break
    return evil, evil.recv_multipart()[0]


def test_forged_altered_and_replayed_messages_are_dropped(cfg):
    with mpx.MessageQueue(1, 0, config=cfg) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=cfg)
        try:
            q.wait_until_ready(10)
            q.enqueue("first")
            assert r.dequeue(timeout=5) == "first"
            reader = r._reader
            evil, ident = _feeder(reader)
            import pickle

            from mpx.protocol.serde import K_PICKLE
            body = pickle.dumps("evil")
            key = KEY.encode()
            # (frame 1 was "first": a frame number the reader has read already)
            good_header = HEADER.pack(MAGIC, VERSION, K_PICKLE, reader.token, 1, 0, 1, len(body),
                                      2)
            forged = auth.seal(b"wrong key", good_header, [body])
            altered = bytearray(auth.seal(key, good_header, [body]))
            altered[-40] ^= 1
            truncated = auth.seal(key, good_header, [body])[:-1]
            old_header = HEADER.pack(MAGIC, VERSION, K_PICKLE, reader.token, 0, 0, 1, len(body),
                                     1)
            replay = auth.seal(key, old_header, [body])  # the frame and sequence of "first"
            for frames in ([forged], [altered], [truncated], [replay], [b"garbage"],
                           [os.urandom(40), os.urandom(32)]):
                evil.send_multipart([ident, *frames])
            time.sleep(0.3)
            with pytest.raises(mpx.QueueTimeout):
                r.dequeue(timeout=0.3)
            # forged, altered, truncated, garbage: each resets the link (one that alters
            # frames), the multipart one is dropped, and the replay too (counted unless it
            # came while the reader waited for the writer to take its link up again)
            assert reader.integrity_failures == 4
            assert reader.drops.count in (5, 6)
            q.enqueue("second")  # the honest writer still gets through
            assert r.dequeue(timeout=5) == "second"
            assert reader.resumes >= 1
            evil.close(0)
        finally:
            r.close()


def test_a_stream_of_forged_frames_holds_no_reader_past_its_deadline(cfg):
    """Each dropped frame is followed by the deadline's check: a flood of them (faster
    than the reader's receive timeout) cannot keep a dequeue waiting past its timeout."""
    with mpx.MessageQueue(1, 0, config=cfg) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=cfg)
        evil = None
        stop = threading.Event()
        try:
            q.wait_until_ready(10)
            q.enqueue("first")
            assert r.dequeue(timeout=5) == "first"
            evil, ident = _feeder(r._reader)

            def flood():  # (for 6 s at most: a reader that waits it out still returns)
                end = time.monotonic() + 6
                while not stop.is_set() and time.monotonic() < end:
                    evil.send_multipart([ident, b"garbage" * 8])
                    time.sleep(0.001)

            t = threading.Thread(target=flood, daemon=True)
            t.start()
            t0 = time.monotonic()
            with pytest.raises(mpx.QueueTimeout):
                r.dequeue(timeout=0.5)
            took = time.monotonic() - t0
            stop.set()
            t.join(5)
            assert r._reader.drops.count > 10
            assert took < 3.0, f"the dequeue took {took:.1f} s with a 0.5 s timeout"
            q.enqueue("second")
            assert r.dequeue(timeout=5) == "second"
        finally:
            stop.set()
            if evil is not None:
                evil.close(0)
            r.close()


_FRAMES = itertools.count(1000)  # frame numbers past a test writer's own


def _chunk(key, token, seq, index, count, total, data, kind=None):
    from mpx.protocol.serde import K_BYTES
    header = HEADER.pack(MAGIC, VERSION, K_BYTES if kind is None else kind, token,
                         seq, index, count, total, next(_FRAMES))
    return auth.seal(key, header, [data])


def test_chunks_reassemble_in_order_and_replays_or_gaps_are_dropped(cfg):
    """Feeds a reader signed chunks by hand: a replayed or out-of-order chunk is dropped
    and the message still completes; a message the writer gave up on part way (its next
    message starts) is discarded, not delivered."""
    with mpx.MessageQueue(1, 0, config=cfg) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=cfg)
        evil = None
        try:
            q.wait_until_ready(10)
            q.enqueue("first")
            assert r.dequeue(timeout=5) == "first"
            reader = r._reader
            evil, ident = _feeder(reader)
            key, tok = KEY.encode(), reader.token
            parts = [b"a" * 10, b"b" * 10, b"c" * 5]
            for frame in (_chunk(key, tok, 1, 0, 3, 25, parts[0]),
                          _chunk(key, tok, 1, 0, 3, 25, parts[0]),   # replayed
                          _chunk(key, tok, 1, 2, 3, 25, parts[2]),   # out of order
                          _chunk(key, tok, 1, 1, 3, 25, parts[1]),
                          _chunk(key, tok, 1, 2, 3, 25, parts[2])):
                evil.send_multipart([ident, frame])
            assert r.dequeue(timeout=5) == b"".join(parts)
            assert reader.drops.count == 2
            for frame in (_chunk(key, tok, 2, 0, 2, 20, parts[0]),  # given up part way
                          _chunk(key, tok, 4, 0, 1, 5, parts[2]),
                          _chunk(key, tok, 2, 1, 2, 20, parts[1])):  # too late: dropped
                evil.send_multipart([ident, frame])
            assert r.dequeue(timeout=5) == parts[2]
            with pytest.raises(mpx.QueueTimeout):
                r.dequeue(timeout=0.3)
            assert reader.drops.count == 3
        finally:
            if evil is not None:
                evil.close(0)
            r.close()


def test_relay_streams_chunks_on_and_drops_a_message_given_up(cfg):
    """dequeue_stream -> enqueue_stream, as a follower's relay does: a message crosses
    chunk by chunk into a local ring; one the writer gave up on part way never reaches
    the ring's reader, and the next message does."""
    up = mpx.MessageQueue(1, 0, config=cfg)
    r = mpx.MessageQueue.create_from_handle(up.export_handle(), 0, config=cfg)
    down = mpx.MessageQueue(1, 1, config=dataclasses.replace(cfg, max_chunk_bytes=64,
                                                             max_chunks=2))
    local = mpx.MessageQueue.create_from_handle(down.export_handle(), 0)
    evil = None
    try:
        up.wait_until_ready(10)
        down.wait_until_ready(10)
        up.enqueue(bytes(range(200)))  # one chunk
        kind, total, pieces = r.dequeue_stream(timeout=5)
        got: list = []
        t = threading.Thread(target=lambda: got.extend(local.dequeue(timeout=10)
                                                        for _ in range(3)))
        t.start()
        down.enqueue_stream(kind, total, pieces, timeout=5)
        evil, ident = _feeder(r._reader)
        key, tok = KEY.encode(), r._reader.token
        for frame in (_chunk(key, tok, 1, 0, 3, 300, b"p" * 100),
                      _chunk(key, tok, 1, 1, 3, 300, b"q" * 100),
                      _chunk(key, tok, 2, 0, 2, 150, b"r" * 100),  # message 1 given up
                      _chunk(key, tok, 2, 1, 2, 150, b"s" * 50),
                      _chunk(key, tok, 3, 0, 1, 5, b"t" * 5)):
            evil.send_multipart([ident, frame])
        kind, total, pieces = r.dequeue_stream(timeout=5)
        assert total == 300
        with pytest.raises(mpx.MessageAbortedError):
            down.enqueue_stream(kind, total, pieces, timeout=5)  # 2 of its 3 slots went out
        for _ in range(2):
            down.enqueue_stream(*r.dequeue_stream(timeout=5), timeout=5)
        t.join(15)
        assert got == [bytes(range(200)), b"r" * 100 + b"s" * 50, b"t" * 5]
    finally:
        if evil is not None:
            evil.close(0)
        for q in (local, down, r, up):
            q.close()


@pytest.mark.parametrize("chunk", [4096, 65536])
def test_large_messages_stream_in_chunks(cfg, chunk):
    small = dataclasses.replace(cfg, max_chunk_bytes=chunk, max_chunks=4)
    arr = np.arange(300_000, dtype=np.float32)
    raw = os.urandom(3 * chunk)  # an exact multiple of the chunk size
    with mpx.MessageQueue(1, 0, config=small) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=small)
        try:
            q.wait_until_ready(10)
            out = []
            t = threading.Thread(target=lambda: out.extend(r.dequeue(timeout=10)
                                                            for _ in range(4)))
            t.start()
            for obj in (arr, raw, b"", {"a": arr[:10]}):
                q.enqueue(obj, timeout=10)
            t.join(20)
            assert np.array_equal(out[0], arr) and out[0].flags.writeable
            assert out[1] == raw and out[2] == b""
            assert np.array_equal(out[3]["a"], arr[:10])
        finally:
            r.close()


def test_random_bytes_on_the_port_change_nothing(cfg):
    with mpx.MessageQueue(1, 0, config=cfg) as q:
        host, port = q.export_handle().zmq["endpoint"][len("tcp://"):].rsplit(":", 1)
        rnd = np.random.default_rng(0)
        for _ in range(50):
            with socket.create_connection((host, int(port)), timeout=2) as s:
                junk = rnd.integers(0, 256, size=int(rnd.integers(1, 400)), dtype=np.uint8)
                s.sendall(junk.tobytes())
        # zmq framing with random content, signed with nothing
        for i in range(20):
            _forge(q.export_handle().zmq["endpoint"],
                   [os.urandom(int(rnd.integers(1, 64))) for _ in range(int(rnd.integers(1, 4)))],
                   identity=f"fuzz{i}".encode()).close(0)
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=cfg)
        try:
            q.wait_until_ready(10)
            q.enqueue({"after": "fuzz"})
            assert r.dequeue(timeout=5) == {"after": "fuzz"}
        finally:
            r.close()


def test_slow_remote_reader_makes_writer_wait_then_raise(cfg):
    small = dataclasses.replace(cfg, max_chunks=2)
    with mpx.MessageQueue(1, 0, config=small) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=small)
        try:
            q.wait_until_ready(10)
            payload = os.urandom(1 << 20)
            with pytest.raises(mpx.QueueTimeout, match="rank 0"):
                for _ in range(200):
                    q.enqueue(payload, timeout=0.5)
        finally:
            r.close()


def test_a_write_that_may_not_wait_never_finds_a_prompt_readers_pipe_full(ctx, cfg):
    # each message goes out once the reader (another process) has taken the one before, so
    # its pipe has room; libzmq hands the writer's socket that credit as a command that a
    # send processes at most every ~1 ms: the writer takes it in before it calls the pipe
    # full (with 2 messages of room, a send ~100 us after the last one would find it full)
    small = dataclasses.replace(cfg, max_chunks=2)
    with mpx.MessageQueue(1, 0, config=small) as q:
        p, conn = _procs.start(ctx, _procs.with_key, KEY, _procs.echo_reader, q.export_handle(), 0)
        try:
            q.wait_until_ready(30)
            assert conn.poll(30) and conn.recv()[0] == "ready"
            for i in range(300):
                q.enqueue(i, timeout=0)  # (a deadline already past: no waiting)
                assert conn.poll(10) and conn.recv() == _procs.summary(i)
            q.enqueue(None, timeout=10)
        finally:
            p.join(10)


def test_remote_reader_death_is_peer_died(ctx, cfg):
    with mpx.MessageQueue(1, 0, config=cfg) as q:
        p, conn = _procs.start(ctx, _procs.with_key, KEY, _procs.slow_reader, q.export_handle())
        assert conn.recv()[0] == "ready"
        q.wait_until_ready(10)
        os.kill(p.pid, signal.SIGKILL)
        p.join(5)
        t0 = time.monotonic()
        with pytest.raises(mpx.PeerDiedError, match="rank 0"):
            for _ in range(10000):
                q.enqueue(b"x" * 1000, timeout=5)
                time.sleep(0.001)
        assert time.monotonic() - t0 < cfg.heartbeat_s + 2


def test_writer_death_is_peer_died_for_remote_reader(ctx, cfg):
    parent, child = ctx.Pipe()
    w = ctx.Process(target=_procs.with_key, args=(KEY, _procs.remote_writer_process, child),
                    daemon=True)
    w.start()
    h = parent.recv()
    r = mpx.MessageQueue.create_from_handle(h, 0, config=cfg)
    try:
        assert parent.poll(30) and parent.recv() == "sent"
        assert r.dequeue(timeout=10) == "hello"
        os.kill(w.pid, signal.SIGKILL)
        w.join(5)
        t0 = time.monotonic()
        with pytest.raises(mpx.PeerDiedError, match="lost the writer"):
            r.dequeue(timeout=30)
        assert time.monotonic() - t0 < cfg.heartbeat_s + 1.5
    finally:
        r.close()


def test_shutdown_wakes_remote_reader(cfg):
    with mpx.MessageQueue(1, 0, config=cfg) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=cfg)
        errs = []
        t = threading.Thread(target=lambda: errs.append(_catch(r.dequeue, 10)))
        t.start()
        time.sleep(0.2)
        r.shutdown()
        t.join(5)
        assert isinstance(errs[0], mpx.Cancelled)
        r.close()


def _catch(fn, *a):
    try:
        fn(*a)
    except Exception as e:
        return e


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_encrypted_queue(cfg):
    enc = dataclasses.replace(cfg, curve=True)
    with mpx.MessageQueue(1, 0, config=enc) as q:
        h = q.export_handle()
        assert len(h.zmq["curve_server_key"]) == 40
        r = mpx.MessageQueue.create_from_handle(h, 0, config=cfg)
        try:
            q.wait_until_ready(10)
            q.enqueue(np.arange(100))
            assert (r.dequeue(timeout=5) == np.arange(100)).all()
        finally:
            r.close()
        # a reader that does not speak CURVE never gets through the handshake
        with mpx.MessageQueue(1, 0, config=enc) as q2:
            h2 = q2.export_handle()
            plain = dataclasses.replace(h2, zmq={**h2.zmq, "curve_server_key": None})
            r2 = mpx.MessageQueue.create_from_handle(plain, 0, config=cfg)
            try:
                with pytest.raises(mpx.QueueTimeout):
                    q2.wait_until_ready(1.0)
            finally:
                r2.close()
