"""``python -m mpx demo``: mpx.MessageQueue across real (spawned) processes.

The driver broadcasts on one queue to N_READERS reader processes; each reader writes its
replies on its own one-reader queue back to the driver and sends that queue's handle over
a multiprocessing Pipe at startup. The demo measures

(a) small-message round trips to reader 0, next to a multiprocessing.Pipe echo loop;
(b) broadcast of a 32 MiB array to every reader, which checks its CRC and replies.

The child entry points live here, not in ``mpx.__main__``, so that spawn can import them.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
import zlib
from typing import Any

CTX = multiprocessing.get_context("spawn")

N_READERS = 2
N_ROUND_TRIPS = 2000
N_WARMUP = 200
ARRAY_BYTES = 32 << 20
N_BROADCASTS = 5
# Generous: a spawned child imports mpx (and numpy) before it can attach.
STARTUP_TIMEOUT_S = 20.0
# No single reply should take anywhere near this long, even on a loaded 2-core machine.
REPLY_TIMEOUT_S = 10.0
JOIN_TIMEOUT_S = 5.0

PING_PAYLOAD = ("step", 7, 3.5, None)


class DemoError(RuntimeError):
    """The demo could not complete; the message says which step failed."""


def _crc(buf: Any) -> int:
    return zlib.crc32(memoryview(buf).cast("B"))


def _make_array(nbytes: int) -> Any:
    """A 32 MiB numpy array if numpy is installed, else a bytearray (both travel out of band)."""
    try:
        import numpy as np
    except ImportError:
        return bytearray((i * 2654435761) & 0xFF for i in range(4096)) * (nbytes // 4096)
    rng = np.random.default_rng(0)
    return rng.integers(0, 2**32, size=nbytes // 4, dtype=np.uint32)


# ---------------------------------------------------------------------- child processes


def reader_main(rank: int, handle: Any, conn: Any) -> None:
    """A reader process: attach to the broadcast queue as ``rank``, answer on a reply queue."""
    from mpx import Cancelled, MessageQueue, PeerDiedError

    reply = MessageQueue(1, 1)
    try:
        conn.send(reply.export_handle())
        conn.close()
        queue = MessageQueue.create_from_handle(handle, rank)
        try:
            reply.wait_until_ready(timeout=STARTUP_TIMEOUT_S)
            while True:
                msg = queue.dequeue(timeout=60.0)
                op = msg[0]
                if op == "ping":
                    if msg[1] == rank:
                        reply.enqueue(msg[2])
                elif op == "array":
                    t_recv = time.monotonic()
                    reply.enqueue(("crc", rank, _crc(msg[1]), t_recv))
                elif op == "stop":
                    reply.enqueue(("stopped", rank))
                    return
                else:
                    reply.enqueue(("error", rank, f"unknown op {op!r}"))
        finally:
            queue.close()
    except (Cancelled, PeerDiedError) as e:
        # The driver gave up (and says why) or died: leave without a traceback.
        print(f"mpx demo reader {rank}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        reply.close()


# ---------------------------------------------------------------------- driver


def _median_us(ping: Any) -> float:
    """Median microseconds of N_ROUND_TRIPS calls of ``ping``, after N_WARMUP."""
    for _ in range(N_WARMUP):
        ping()
    took = []
    for _ in range(N_ROUND_TRIPS):
        t0 = time.perf_counter_ns()
        ping()
        took.append(time.perf_counter_ns() - t0)
    return statistics.median(took) / 1e3


def pipe_echo_main(conn: Any) -> None:
    """The Pipe baseline's child: answer every object with itself until None."""
    while (obj := conn.recv()) is not None:
        conn.send(obj)


def _bench_mpx_ping(queue: Any, reply: Any) -> float:
    def ping() -> None:
        queue.enqueue(("ping", 0, PING_PAYLOAD))
        got = reply.dequeue(timeout=REPLY_TIMEOUT_S)
        if got != PING_PAYLOAD:
            raise DemoError(f"reader 0 echoed {got!r}, expected {PING_PAYLOAD!r}")

    return _median_us(ping)


def _bench_pipe_ping() -> float:
    conn, child = CTX.Pipe()
    p = CTX.Process(target=pipe_echo_main, args=(child,), name="mpx-demo-pipe-echo",
                    daemon=True)
    p.start()
    child.close()

    def ping() -> None:
        conn.send(PING_PAYLOAD)
        if not conn.poll(REPLY_TIMEOUT_S):
            raise DemoError(f"the Pipe echo process did not answer within {REPLY_TIMEOUT_S} s")
        got = conn.recv()
        if got != PING_PAYLOAD:
            raise DemoError(f"the Pipe echo process sent {got!r}")

    try:
        return _median_us(ping)
    finally:
        conn.send(None)
        p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()
        conn.close()


def _bench_broadcast(queue: Any, replies: list) -> tuple[float, float]:
    """(best, median) GB/s of broadcasting the array, from enqueue to the last reader's
    receipt (the CRC the readers compute afterwards is not timed)."""
    arr = _make_array(ARRAY_BYTES)
    want = _crc(arr)
    rates = []
    for _ in range(N_BROADCASTS):
        t0 = time.monotonic()
        queue.enqueue(("array", arr))
        last = t0
        for rank, reply in enumerate(replies):
            msg = reply.dequeue(timeout=REPLY_TIMEOUT_S)
            if msg[0] != "crc" or msg[1] != rank:
                raise DemoError(f"reader {rank} answered {msg!r} to the array broadcast")
            if msg[2] != want:
                raise DemoError(f"reader {rank} received a corrupted array: "
                                f"crc {msg[2]:#010x}, expected {want:#010x}")
            last = max(last, msg[3])
        rates.append(ARRAY_BYTES / max(last - t0, 1e-9) / 1e9)
    return max(rates), statistics.median(rates)


def _start_readers(queue: Any) -> tuple[list, list]:
    procs, conns = [], []
    for rank in range(N_READERS):
        parent, child = CTX.Pipe(duplex=False)
        p = CTX.Process(target=reader_main, args=(rank, queue.export_handle(), child),
                        name=f"mpx-demo-reader-{rank}", daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    return procs, conns


def _attach_replies(procs: list, conns: list) -> list:
    from mpx import MessageQueue

    replies = []
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for rank, (p, conn) in enumerate(zip(procs, conns)):
        while not conn.poll(0.05):
            if not p.is_alive():
                raise DemoError(f"reader {rank} (pid {p.pid}) exited with code {p.exitcode} "
                                "before sending its reply-queue handle")
            if time.monotonic() > deadline:
                raise DemoError(f"reader {rank} (pid {p.pid}) sent no reply-queue handle "
                                f"within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            handle = conn.recv()
        except EOFError:
            p.join(JOIN_TIMEOUT_S)
            raise DemoError(f"reader {rank} (pid {p.pid}) closed its pipe without sending a "
                            f"handle (exit code {p.exitcode})") from None
        finally:
            conn.close()
        replies.append(MessageQueue.create_from_handle(handle, 0))
    return replies


def _stop_readers(queue: Any, replies: list, procs: list) -> None:
    queue.enqueue(("stop",), timeout=REPLY_TIMEOUT_S)
    for rank, reply in enumerate(replies):
        msg = reply.dequeue(timeout=REPLY_TIMEOUT_S)
        if msg != ("stopped", rank):
            raise DemoError(f"reader {rank} answered {msg!r} to stop")
    for rank, p in enumerate(procs):
        p.join(JOIN_TIMEOUT_S)
        if p.exitcode != 0:
            raise DemoError(f"reader {rank} (pid {p.pid}) exited with code {p.exitcode}")


def run(out: Any = None) -> int:
    """Run the demo, printing to ``out`` (stdout). 0 on success, 1 on failure."""
    import os

    import mpx
    from mpx import MessageQueue

    out = out or sys.stdout

    def say(*args: Any) -> None:
        print(*args, file=out, flush=True)

    t_start = time.monotonic()
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:
        ncpu = os.cpu_count() or 1
    say(f"mpx {mpx.__version__} demo: ring={mpx.ring_implementation()}, {N_READERS} reader "
        f"processes (spawn), {ncpu} CPUs")

    queue = MessageQueue(N_READERS, N_READERS)
    procs: list = []
    conns: list = []
    replies: list = []
    ok = False
    try:
        procs, conns = _start_readers(queue)
        replies = _attach_replies(procs, conns)
        queue.wait_until_ready(timeout=STARTUP_TIMEOUT_S)
        say(f"readers ready after {time.monotonic() - t_start:.2f} s")

        mpx_us = _bench_mpx_ping(queue, replies[0])
        pipe_us = _bench_pipe_ping()
        say(f"(a) round trip of a small tuple, median of {N_ROUND_TRIPS}:")
        say(f"      mpx.MessageQueue      {mpx_us:8.1f} us")
        say(f"      multiprocessing.Pipe  {pipe_us:8.1f} us")
        if N_READERS + 1 > ncpu and mpx.Config.from_env().spin_us > 0:
            say(f"      (note: {N_READERS + 1} waiting processes share {ncpu} CPUs and MPX_SPIN_US "
                f"is set: a pause spin\n       holds a core the others need; 0 yields instead)")

        best, med = _bench_broadcast(queue, replies)
        kind = type(_make_array(4096)).__name__
        say(f"(b) broadcast of a {ARRAY_BYTES >> 20} MiB {kind} to {N_READERS} readers, "
            f"checksums OK: {best:.2f} GB/s best, {med:.2f} GB/s median of {N_BROADCASTS}")

        _stop_readers(queue, replies, procs)
        ok = True
    except (mpx.MpxError, DemoError, OSError, EOFError) as e:
        print(f"mpx demo FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    finally:
        if not ok:
            queue.shutdown()
        for reply in replies:
            reply.close()
        queue.close()
        for conn in conns:
            conn.close()
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
    if not ok:
        return 1
    say(f"demo OK ({time.monotonic() - t_start:.1f} s)")
    return 0
