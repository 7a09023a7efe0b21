"""Functions that run in child processes (module level, so every start method finds them),
and the helpers tests use to start and watch them."""

from __future__ import annotations

import os
import random
import signal
import struct
import time
import zlib

import numpy as np

import mpx


def echo_reader(handle, rank, conn):
    """Dequeue objects and send a summary of each back over ``conn`` until None arrives."""
    _echo(mpx.MessageQueue.create_from_handle(handle, rank), conn)


def echo_reader_yielding(handle, rank, yield_us, conn):
    """echo_reader whose waits poll for ``yield_us`` before they park (given here, not by
    the environment: a forkserver's children do not see the test's)."""
    config = mpx.Config(yield_us=yield_us)
    _echo(mpx.MessageQueue.create_from_handle(handle, rank, config=config), conn)


def _echo(q, conn):
    q.wait_until_ready(10)
    conn.send(("ready", os.getpid()))
    try:
        while True:
            obj = q.dequeue(timeout=30)
            if obj is None:
                break
            conn.send(summary(obj))
    except Exception as e:  # report to the test
        conn.send(("error", type(e).__name__, str(e)))
    finally:
        q.close()
        conn.close()


def summary(obj):
    import numpy as np
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, zlib.crc32(obj.tobytes()))
    if isinstance(obj, (bytes, bytearray)):
        return (type(obj).__name__, len(obj), zlib.crc32(obj))
    return ("obj", repr(obj))


def checking_reader(handle, rank, n, seed, conn):
    """Read n messages, with random pauses, and report crc32 of each in order."""
    rnd = random.Random(seed + rank)
    q = mpx.MessageQueue.create_from_handle(handle, rank)
    crcs = []
    try:
        for _ in range(n):
            if rnd.random() < 0.05:
                time.sleep(rnd.random() * 0.005)
            obj = q.dequeue(timeout=60)
            crcs.append(summary(obj))
        conn.send(("done", crcs))
    except Exception as e:
        conn.send(("error", type(e).__name__, str(e)))
    finally:
        q.close()
        conn.close()


def writer_process(n_reader, conn, msgs, then):
    """Create a queue, send its handle, enqueue ``msgs`` once readers attach, then ``then``:
    'exit' (return normally), 'hang' (sleep), 'close', 'shutdown'."""
    q = mpx.MessageQueue(n_reader, n_reader, max_chunk_bytes=4096, max_chunks=4)
    conn.send(q.export_handle())
    q.wait_until_ready(30)
    for m in msgs:
        q.enqueue(m, timeout=30)
    conn.send("sent")
    if then == "close":
        q.close()
    elif then == "shutdown":
        q.shutdown()
    elif then == "hang":
        time.sleep(60)
    elif then == "stream":
        while True:
            q.enqueue(os.urandom(random.randrange(1, 20000)), timeout=60)


def paced_writer(cpu, gap_s, work_s, conn):
    """Create a 1-reader queue, send its handle, and once the reader is attached enqueue a
    small message every ``gap_s`` from CPU ``cpu`` until ``conn`` says stop, each after
    ``work_s`` of busy work (the message's making)."""
    _pace(mpx.MessageQueue(1, 1), cpu, gap_s, work_s, conn)


def paced_remote_writer(config, cpu, gap_s, work_s, conn):
    """paced_writer's, to a reader over ZeroMQ (``config`` has the key)."""
    _pace(mpx.MessageQueue(1, 0, config=config), cpu, gap_s, work_s, conn)


def _pace(q, cpu, gap_s, work_s, conn):
    conn.send(q.export_handle())
    q.wait_until_ready(30)
    os.sched_setaffinity(0, {cpu})
    n = 0
    while not conn.poll(gap_s):
        end = time.perf_counter() + work_s
        while time.perf_counter() < end:
            pass
        q.enqueue(n, timeout=30)
        n += 1
    q.close()


def idle_reader(handle, conn):
    """Attach, report ready, then block in dequeue; report the result."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    conn.send(("ready", os.getpid()))
    try:
        obj = q.dequeue(timeout=60)
        conn.send(("got", summary(obj), time.monotonic()))
    except Exception as e:
        conn.send(("error", type(e).__name__, str(e), time.monotonic()))
    finally:
        q.close()


def slow_reader(handle, conn):
    """Attach and never read (the writer fills the ring)."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    conn.send(("ready", os.getpid()))
    time.sleep(60)
    q.close()


def keep_array_reader(handle, laps_bytes, conn):
    """Receive an array, keep it while ~laps_bytes more flow through the ring, check it."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    first = q.dequeue(timeout=30)
    before = first.copy()
    flowed = 0
    while flowed < laps_bytes:
        x = q.dequeue(timeout=30)
        flowed += x.nbytes
    conn.send(("unchanged", bool((first == before).all()), first.flags.writeable,
               int(first.sum())))
    first += 1  # owned and writable
    q.close()


def keep_inband_reader(handle, laps_bytes, conn):
    """Receive an in-band object (unpickled from its ring slot), keep it while ~laps_bytes
    more flow through the ring, check it."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    first = q.dequeue(timeout=30)
    before = zlib.crc32(first[1])
    flowed = 0
    while flowed < laps_bytes:
        flowed += len(q.dequeue(timeout=30)[1])
    conn.send(("unchanged", zlib.crc32(first[1]) == before, first[0]))
    q.close()


def die(sig=signal.SIGKILL):
    os.kill(os.getpid(), sig)


def remote_writer_process(conn):
    """A writer whose only reader is remote (zmq); sends one message, then hangs."""
    q = mpx.MessageQueue(1, 0)
    conn.send(q.export_handle())
    q.wait_until_ready(30)
    q.enqueue("hello")
    conn.send("sent")
    time.sleep(60)


def with_key(key, target, *args):
    """Run ``target(*args)`` with MPX_AUTH_KEY set: a forkserver child inherits the
    forkserver's environment, not the test's, so the key travels as an argument."""
    os.environ["MPX_AUTH_KEY"] = key
    os.environ["MPX_HEARTBEAT_S"] = "1.0"
    target(*args)


def start(ctx, target, *args):
    """Start ``target(*args, conn)`` in a daemon process; returns (process, our conn)."""
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, child), daemon=True)
    p.start()
    child.close()
    return p, parent


def reader_parked(mm, index=0) -> bool:
    """Whether reader ``index`` of the ring segment mapped at ``mm`` is parked."""
    from mpx.mechanism import layout
    return bool(struct.unpack_from("<I", mm, layout.reader_block(index) + layout.RB_PARKED)[0])


def until(cond, timeout):
    """Poll ``cond`` every 2 ms until it is true (True) or ``timeout`` seconds passed."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


def running(pid):
    """Alive and not a zombie (an exited process waits for its parent to reap it)."""
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids, seconds):
    """The pids still running after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pids = [p for p in pids if running(p)]
        if not pids:
            return []
        time.sleep(0.02)
    return [p for p in pids if running(p)]


def echo_object(conn):
    """Receive one object and send it back (it crosses two process boundaries)."""
    conn.send(conn.recv())
    conn.close()


def write_then_exit(handle, cfg, nbytes, conn):
    """With a reader of ``handle``'s queue open, write ``nbytes``, close the writer and leave
    at once: close() must not return before the message has left."""
    keep_open = mpx.MessageQueue.create_from_handle(handle, 0, config=cfg)
    w = mpx.MessageQueue(1, 0, config=cfg)
    conn.send(w.export_handle())
    w.wait_until_ready(10)
    keep_open.wait_until_ready(10)
    w.enqueue(np.full(nbytes, 7, dtype=np.uint8))
    w.close()
    os._exit(0)  # (no finalizer, and the reader still open: the process is simply gone)


def keep_name_writer(conn):
    """A writer whose ring keeps its name past its readers' attaching; sends its handle,
    then waits to be killed."""
    q = mpx.MessageQueue(1, 1, keep_name=True)
    conn.send(q.export_handle())
    time.sleep(60)
