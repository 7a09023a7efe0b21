"""The driver's watch threads: one over the local worker processes, one over the follower
nodes. Each reports a failure once, through the callback it was given, and never touches
the call table itself."""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from mpx import _debug
from mpx._driver import lockorder
from mpx._node.leader import Leader
from mpx.errors import ExecutorFailed

logger = logging.getLogger("mpx")


class ProcessMonitor:
    """Thread: ``on_death(rank, incarnation)`` when the sentinel of a local worker's
    process fires (it exited; ``incarnation``, the number that process was watched as:
    see mpx/_driver/membership.py) or :meth:`report_death` says so; ``on_failure(error)``
    for what :meth:`report` hands it from other threads. :meth:`watch` and :meth:`unwatch`
    change the processes it watches (a rank restarted, the group resized), from any
    thread."""

    def __init__(self, procs: list[Any], incarnations: list[int],
                 on_death: Callable[[int, int], None],
                 on_failure: Callable[[ExecutorFailed], None]) -> None:
        # each watched sentinel: (rank, the number of its process)
        self._sentinels = {p.sentinel: (rank, inc)
                           for rank, (p, inc) in enumerate(zip(procs, incarnations))}
        self._watch_lock = lockorder.lock("ProcessMonitor's watch lock", lockorder.LEAF)
        self._on_death = on_death
        self._on_failure = on_failure
        self._reports: queue.SimpleQueue[ExecutorFailed | tuple[int, int]] = queue.SimpleQueue()
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=_debug.counted_thread(self._run),
                                        name="mpx-process-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, rank: int, proc: Any, incarnation: int) -> None:
        """Watch ``proc``, ``rank``'s process number ``incarnation``, from now on (instead
        of the one before)."""
        with self._watch_lock:
            self._unwatch(rank)
            self._sentinels[proc.sentinel] = (rank, incarnation)
        self._wake()

    def unwatch(self, rank: int) -> None:
        """Stop watching ``rank``'s process (it leaves the group)."""
        with self._watch_lock:
            self._unwatch(rank)
        self._wake()

    def _unwatch(self, rank: int) -> None:
        for s in [s for s, (r, _) in self._sentinels.items() if r == rank]:
            del self._sentinels[s]

    def report(self, error: ExecutorFailed) -> None:
        """Have the monitor thread handle ``error`` (found by a thread that must not)."""
        self._reports.put(error)
        self._wake()

    def report_death(self, rank: int, incarnation: int) -> None:
        """Have the monitor thread call ``on_death(rank, incarnation)``: another thread
        found that worker's queue closed, perhaps before its process has exited; it read
        the queue of ``rank``'s process number ``incarnation`` (see WorkerGroup)."""
        self._reports.put((rank, incarnation))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # closed: the monitor is gone

    def _run(self) -> None:
        while True:
            with self._watch_lock:
                watched = list(self._sentinels)
            ready = multiprocessing.connection.wait(watched + [self._wake_r])
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
                if self._stopping:
                    return
                while not self._reports.empty():
                    report = self._reports.get()
                    if isinstance(report, tuple):
                        self._handle(self._on_death, *report)
                    else:
                        self._handle(self._on_failure, report)
            for s in ready:
                with self._watch_lock:
                    process = self._sentinels.pop(s, None)  # (None: no longer watched)
                if process is not None:
                    self._handle(self._on_death, *process)

    @staticmethod
    def _handle(handler: Callable[..., None], *args: Any) -> None:
        """Run one handler; whatever it raises (SystemExit from a callback it ran, too) is
        logged, and the watch goes on: a death watch that ended would leave every later
        death unnoticed."""
        try:
            handler(*args)
        except BaseException:
            logger.exception("the process monitor's handler of %r raised", args)

    def stop(self) -> None:
        """End the thread and release its pipe (idempotent)."""
        if self._wake_r < 0:
            return
        self._stopping = True
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._wake_r = self._wake_w = -1


class NodeMonitor:
    """Thread: the only user of the leader's control socket after startup. It keeps the
    heartbeats going and calls ``on_failure(error)`` for a worker death a follower reports
    or a node that went silent. When told to :meth:`release_followers`, or at :meth:`stop`,
    it tells every follower to stop and closes the socket."""

    def __init__(self, leader: Leader, on_failure: Callable[[ExecutorFailed], None]) -> None:
        self.leader = leader
        self._on_failure = on_failure
        self._release = threading.Event()
        self._thread = threading.Thread(target=_debug.counted_thread(self._run),
                                        name="mpx-node-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._release.is_set():
                err = self.leader.poll()
                if err is not None:
                    self._on_failure(err)
        finally:
            self.leader.stop()

    def release_followers(self) -> None:
        """Stop the follower nodes (their workers exit with them); returns at once."""
        self._release.set()

    def stop(self) -> None:
        """Stop the followers and wait for the thread to end."""
        self._release.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)
