"""Starting and stopping the worker processes of one node (the driver's or a follower's).

All workers start concurrently; then a ready handshake over one pipe per worker collects
each worker's response-queue handle, or the exception its ``__init__`` raised.

``stop`` may run in another thread while a handshake waits (the driver's monitor fails the
group, or ``shutdown`` runs, during a restart or resize): from then on the handshake and
the startup checks say that the workers are being stopped, never that a worker mpx stopped
"died during startup".
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from mpx._procinfo import describe_exit
from mpx._worker.main import worker_main
from mpx.config import Config
from mpx.errors import WorkerStartupError
from mpx.mechanism import segments
from mpx.protocol.wire import Ready, StartupFailed, WorkerContext, WorkerSpec

logger = logging.getLogger("mpx")


# The write ends of this process's death pipes. A child this process forks for its own
# reasons (a helper, a shell) must not hold one: the workers would then not see the driver
# die. (Workers also watch the driver's pidfd, which covers forks made from C.)
_death_pipe_fds: set[int] = set()


def _release_death_pipes_in_child() -> None:
    if not _death_pipe_fds:
        return
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        for fd in _death_pipe_fds:  # dup2, not close: the fd's owner may close it later
            try:
                os.dup2(null, fd)
            except OSError:
                pass
    finally:
        os.close(null)
    _death_pipe_fds.clear()


os.register_at_fork(after_in_child=_release_death_pipes_in_child)


def _own_process_group(pid: int) -> None:
    """Put a just-started worker in a process group of its own, as the worker itself does
    first thing (mpx._worker.main): a signal to this process's group (Ctrl-C in a
    terminal, ``kill -TERM -PGID``) then leaves the workers to this process. From here it
    takes only where the child is ours and has not exec'd (fork); elsewhere the child's own
    call does it (spawn: EACCES after exec; forkserver: not our child)."""
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass


# How long a fork server's worker that is gone gets for the fork server's report of its
# exit status (it writes it as soon as it has reaped the worker; on a busy host that took
# over a second, and the worker then read as still running).
FORK_SERVER_REPORT_S = 5.0

# How long a worker that closed its queue, or that a failed attach points at, gets to
# finish exiting before its status is read: a worker closes its queues first and then
# runs its interpreter's teardown, which can take seconds on a busy host.
EXIT_WAIT_S = 5.0


class _ForkServerWorker:
    """A worker that multiprocessing's fork server started, watched through a pidfd too.

    The fork server, not this process, is that worker's parent: it reaps it and reports its
    exit status over a pipe, the process's sentinel. The fork server runs in this process's
    group and ignores SIGINT, not SIGTERM: a SIGTERM to the whole group (``kill -TERM
    -PGID``, systemd's stop) ends it, and multiprocessing then reads every worker it
    started as exited with 255 while they run on. Here ``sentinel`` is the worker's pidfd
    (readable once the worker itself exited), ``exitcode`` None until then, and the signals
    go through the pidfd."""

    def __init__(self, proc: Any) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.name = proc.name
        self._pidfd = os.pidfd_open(proc.pid)
        self.sentinel = self._pidfd
        self._exited = False
        weakref.finalize(self, os.close, self._pidfd)

    def _gone(self, timeout: float | None = 0.0) -> bool:
        if not self._exited:
            self._exited = bool(multiprocessing.connection.wait([self._pidfd], timeout))
        return self._exited

    @property
    def exitcode(self) -> int | None:
        """None while the worker runs, else the fork server's report (255 when the fork
        server is gone and cannot say)."""
        if not self._gone():
            return None
        if self._proc.exitcode is None:
            self._proc.join(FORK_SERVER_REPORT_S)
        return self._proc.exitcode

    def join(self, timeout: float | None = None) -> None:
        if self._gone(timeout):
            self._proc.join(FORK_SERVER_REPORT_S)

    def _signal(self, sig: int) -> None:
        if not self._gone():
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


def _close(conn: Any) -> None:
    """Close ``conn`` if there is one (a worker's kick pipe: followers' workers only)."""
    if conn is not None:
        conn.close()


def _watched(proc: Any, start_method: str) -> Any:
    """``proc``, or for the fork server's workers the wrapper above (where pidfds exist)."""
    if start_method != "forkserver":
        return proc
    try:
        return _ForkServerWorker(proc)
    except (AttributeError, OSError):  # no pidfds here (Linux < 5.3), or already gone
        return proc


class LocalWorkers:
    """The processes for ``ctxs`` (one WorkerContext each) on this node, reading calls from
    the queue of ``handle`` as their global rank, or as their local rank when
    ``local_queue`` (a follower's relay ring). ``keep_fds``: file descriptors of this
    process that forked workers close at once (they are not inherited otherwise)."""

    def __init__(self, config: Config, ctxs: list[WorkerContext], handle: Any,
                 cls_bytes: bytes, kw_bytes: bytes, remote_driver: bool = False,
                 local_queue: bool = False, keep_fds: tuple[int, ...] = ()) -> None:
        self.config = config
        self.ranks = [c.rank for c in ctxs]
        self.procs: list[Any] = []
        self.ready: list[Any] = []
        self.kicks: list[Any] = []  # (a follower's: the write end of each one's kick pipe)
        self.death_w: Any = None
        self.reap_lock = threading.Lock()
        self._cls_bytes, self._kw_bytes = cls_bytes, kw_bytes
        self._remote_driver, self._local_queue = remote_driver, local_queue
        self.keep_fds = keep_fds  # (the starter may change them for later workers)
        self.stopping = False  # set first thing by stop(), from whichever thread
        self._mp: Any = multiprocessing.get_context(config.start_method)
        # (kept open until stop: a worker started later gets it too)
        self._death_r, self.death_w = self._mp.Pipe(duplex=False)
        _death_pipe_fds.add(self.death_w.fileno())
        for ctx in ctxs:
            proc, ready, kick = self._start(ctx, handle)
            self.procs.append(proc)
            self.ready.append(ready)
            self.kicks.append(kick)

    def _start(self, ctx: WorkerContext, handle: Any,
               direct: bool = False) -> tuple[Any, Any, Any]:
        """Start the process of ``ctx`` reading the broadcast queue of ``handle`` (as its
        global rank if ``direct``, though this node relays): (the process, the read end of
        its ready pipe, the write end of its kick pipe or None: kick_links)."""
        config = self.config
        ready_r, ready_w = self._mp.Pipe(duplex=False)
        kick_r = kick_w = None
        if self._remote_driver:
            kick_r, kick_w = self._mp.Pipe(duplex=False)
            os.set_blocking(kick_w.fileno(), False)  # (kick_links never waits)
        kicks = [k for k in (*self.kicks, kick_w) if k is not None and not k.closed]
        close_fds = (self.death_w.fileno(), *(c.fileno() for c in self.ready if not c.closed),
                     *(k.fileno() for k in kicks), *self.keep_fds) \
            if config.start_method == "fork" else ()
        # The kernel's parent-death signal fires when the *thread* that forked the child
        # ends, not the process: only the main thread, which lives as long as this
        # process, may arm it. A worker started from any other thread (a resize from a
        # request thread, a restart) is tied to this process by its death pipe and its
        # pidfd watch alone (mpx._worker.main), never to the thread that started it.
        arm = threading.current_thread() is threading.main_thread()
        spec = WorkerSpec(ctx=ctx, handle=handle,
                          queue_rank=ctx.local_rank if self._local_queue and not direct
                          else ctx.rank,
                          worker_cls=self._cls_bytes, worker_kwargs=self._kw_bytes,
                          parent_pid=os.getpid(), arm_pdeathsig=arm, close_fds=close_fds,
                          remote_driver=self._remote_driver)
        p = self._mp.Process(target=worker_main, args=(spec, ready_w, self._death_r, kick_r),
                             name=f"mpx-worker-{ctx.rank}")
        p.start()
        _own_process_group(p.pid)
        ready_w.close()
        if kick_r is not None:
            kick_r.close()
        return _watched(p, config.start_method), ready_r, kick_w

    def kick_links(self) -> None:
        """Tell each worker to take its network link to the driver up again now (a
        follower's, whose leader was silent and is heard again: a worker that reads the
        driver directly, not through the node's relay, would otherwise wait for TCP's
        retransmission; mpx._worker.main). Never waits; from any thread."""
        for kick in list(self.kicks):
            if kick is not None:
                try:
                    kick.send_bytes(b"!")
                except OSError:
                    pass  # (that worker is gone, or its pipe is full of kicks already)

    def add(self, ctx: WorkerContext, handle: Any, direct: bool = False) -> int:
        """Start a new process for ``ctx.rank`` reading the broadcast queue of ``handle`` (as
        its global rank if ``direct``: a follower's rank started again reads the driver, not
        the relay), in place of the one that had that rank (it has exited) or after the
        others (a rank the group grows by): its position, for ``handshake``."""
        if ctx.rank not in self.ranks:
            proc, ready, kick = self._start(ctx, handle)
            self.procs.append(proc)
            self.ready.append(ready)
            self.kicks.append(kick)
            self.ranks.append(ctx.rank)
            return len(self.procs) - 1
        i = self.ranks.index(ctx.rank)
        gone = self.procs[i]
        if gone.exitcode is None:  # (one that closed its queue may not have exited yet)
            gone.kill()
        self.join(gone, EXIT_WAIT_S)
        self._reap_segments_of([gone])
        self.ready[i].close()
        _close(self.kicks[i])
        self.procs[i], self.ready[i], self.kicks[i] = self._start(ctx, handle, direct)
        return i

    @staticmethod
    def _reap_segments_of(procs: list[Any]) -> None:
        """Unlink what the worker processes ``procs``, now gone, left in /dev/shm (a
        response queue, of one that died before the driver attached to it)."""
        theirs = tuple(f"/{segments.PREFIX}{p.pid}-" for p in procs)
        for name in segments.stale_segments():
            if name.startswith(theirs):
                segments.unlink(name)

    def retire(self, ranks: list[int], grace_s: float | None = None) -> None:
        """Wait ``grace_s`` (default shutdown_grace_s) for the workers of ``ranks`` (told to
        leave the group) to exit, SIGKILL those that did not, and forget them."""
        index = [self.ranks.index(r) for r in ranks]
        procs = [self.procs[i] for i in index]
        try:
            self._end(procs, self.config.shutdown_grace_s if grace_s is None else grace_s)
        finally:
            for i in sorted(index, reverse=True):
                self.ready[i].close()
                _close(self.kicks[i])
                del self.procs[i], self.ready[i], self.kicks[i], self.ranks[i]
            self._reap_segments_of(procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def join(self, p: Any, timeout: float) -> None:
        """Join one worker; serialised, because two threads reaping one child race and the
        loser reads no exit code."""
        with self.reap_lock:
            p.join(timeout)

    def handshake(self, deadline: float, which: list[int] | None = None) -> dict[int, Any]:
        """{rank: response-queue handle}, or WorkerStartupError naming the rank, its pid and
        why: its ``__init__`` raised, it exited (also after it was ready: the group cannot
        start without it), or it was not ready by ``deadline``. ``which``: the workers (by
        position) to wait for, default all."""
        handles: dict[int, Any] = {}
        which = list(range(len(self.procs))) if which is None else which
        waiting = {self.ready[i]: i for i in which}
        sentinels = {self.procs[i].sentinel: i for i in which}
        while waiting:
            left = deadline - time.monotonic()
            ranks = sorted(self.ranks[i] for i in waiting.values())
            if self.stopping:
                raise self._stopped_error(ranks)
            if left <= 0:
                raise WorkerStartupError(
                    f"workers {ranks} did not become ready within "
                    f"{self.config.startup_timeout_s} s (startup_timeout_s)", ranks)
            try:
                for obj in multiprocessing.connection.wait(list(waiting) + list(sentinels),
                                                           left):
                    if obj in waiting:
                        self._take_ready(waiting, obj, handles)
                    elif obj in sentinels:
                        i = sentinels.pop(obj)
                        conn = self.ready[i]
                        if conn in waiting and conn.poll(0):  # its last word says more
                            self._take_ready(waiting, conn, handles)
                        raise self.startup_death(self.ranks[i])
            except (OSError, ValueError):  # (stop closed the pipes under this wait)
                if self.stopping:
                    raise self._stopped_error(ranks) from None
                raise
        return handles

    def _stopped_error(self, ranks: list[int]) -> WorkerStartupError:
        """The error of a startup step that ``stop`` cut short: no worker is at fault."""
        return WorkerStartupError(
            f"workers {ranks} were stopped by mpx before they were ready: this node's "
            "workers are being stopped (shutdown, or the group failed)")

    def _take_ready(self, waiting: dict, conn: Any, handles: dict[int, Any]) -> None:
        """Read worker ``waiting[conn]``'s message: its handle into ``handles``, or the
        WorkerStartupError of its failed ``__init__``. Nothing at EOF (it died: its sentinel
        says how)."""
        try:
            msg = conn.recv()
        except EOFError:
            return
        i = waiting.pop(conn)
        rank, pid = self.ranks[i], self.procs[i].pid
        if isinstance(msg, StartupFailed):
            raise WorkerStartupError(
                f"worker rank {rank} (pid {pid}) failed in __init__: {msg.exc_type}: "
                f"{msg.message}\n\nRemote traceback:\n{msg.traceback}",
                [rank], msg.traceback, pid=pid)
        assert isinstance(msg, Ready)
        handles[rank] = msg.handle

    # ------------------------------------------------------------------ exits

    def exit_of(self, rank: int, timeout: float = EXIT_WAIT_S) -> int | None:
        """``rank``'s exit code (negative: -signal) once its process has exited, waiting up
        to ``timeout`` for that and reaping it; None if it still runs then."""
        p = self.procs[self.ranks.index(rank)]
        self.join(p, timeout)
        return p.exitcode

    def exited(self, timeout: float = 0.0, ranks: list[int] | None = None) -> list[int]:
        """The ranks (of ``ranks``, default all) whose process has exited, waiting up to
        ``timeout`` for a first one."""
        watched = [(r, p) for r, p in zip(self.ranks, self.procs) if ranks is None or r in ranks]
        ready = multiprocessing.connection.wait([p.sentinel for _, p in watched], timeout)
        return [r for r, p in watched if p.sentinel in ready]

    def startup_death(self, rank: int) -> WorkerStartupError:
        """The error of ``rank``, which died before the group was up, naming its pid and its
        exit status; or, once ``stop`` began, the error that says mpx stopped it."""
        if self.stopping:
            return self._stopped_error([rank])
        pid = self.procs[self.ranks.index(rank)].pid
        code = self.exit_of(rank)
        return WorkerStartupError(f"worker rank {rank} (pid {pid}) died during startup: "
                                  f"{describe_exit(code)}", [rank], pid=pid, exitcode=code)

    @contextlib.contextmanager
    def startup_deaths(self, ranks: list[int] | None = None) -> Iterator[None]:
        """Around the steps that attach to the workers' queues: an error in them, when a
        worker (of ``ranks``, default all) has died (or exits within EXIT_WAIT_S: it may be
        on its way out, its queue closed already), becomes that worker's
        WorkerStartupError, the error as its cause; and a worker found dead once they
        succeeded fails the startup the same way."""
        try:
            yield
        except Exception as e:
            dead = self.exited(EXIT_WAIT_S, ranks)
            if dead:
                raise self.startup_death(dead[0]) from e
            raise
        dead = self.exited(0.0, ranks)
        if dead:
            raise self.startup_death(dead[0])

    def stop(self) -> None:
        """Close the death pipe, wait shutdown_grace_s, SIGTERM, wait terminate_grace_s,
        SIGKILL; then close the handshake pipes. Whatever interrupts the waits (Ctrl-C), the
        workers still alive are SIGKILLed before it propagates.

        The pipe closes first because that is how a worker tells this SIGTERM from a stray
        one: it ignores SIGTERM and SIGINT while the pipe is open and this process alive
        (mpx._worker.main), and dies of them once the pipe is closed."""
        self.stopping = True
        if self.death_w is not None:
            _death_pipe_fds.discard(self.death_w.fileno())
            self.death_w.close()
            self.death_w = None

        try:
            alive = self._still_running(self.procs, self.config.shutdown_grace_s)
            for p in alive:
                logger.warning("worker pid %d did not exit in %.1f s; sending SIGTERM",
                               p.pid, self.config.shutdown_grace_s)
                p.terminate()
            alive = self._still_running(alive, self.config.terminate_grace_s) if alive else []
            for p in alive:
                logger.warning("worker pid %d ignored SIGTERM; sending SIGKILL", p.pid)
        finally:
            self._kill_and_reap()

    def _still_running(self, procs: list[Any], seconds: float) -> list[Any]:
        """Those of ``procs`` that have not exited within ``seconds`` (the others reaped)."""
        deadline = time.monotonic() + seconds
        for p in procs:
            self.join(p, max(0.0, deadline - time.monotonic()))
        return [p for p in procs if p.exitcode is None]

    def _kill(self, procs: list[Any]) -> None:
        """SIGKILL those of ``procs`` still running, and reap them all."""
        for p in procs:
            if p.exitcode is None:
                p.kill()
        for p in procs:
            self.join(p, 5.0)

    def _end(self, procs: list[Any], grace_s: float) -> None:
        """Wait ``grace_s`` for ``procs`` to exit, then SIGKILL and reap the rest (a SIGTERM
        would be ignored: the death pipe is open)."""
        try:
            self._still_running(procs, grace_s)
        finally:
            for p in procs:
                if p.exitcode is None:
                    logger.warning("worker pid %d did not leave the group in %.1f s; sending "
                                   "SIGKILL", p.pid, grace_s)
            self._kill(procs)

    def _kill_and_reap(self) -> None:
        """SIGKILL every worker still running, reap them all, close the handshake pipes,
        and unlink what the workers left in /dev/shm: the response queue of one that died
        before the driver attached to it."""
        self._kill(self.procs)
        for c in self.ready:  # (kept, closed: a regroup under way still retires by position)
            c.close()
        for k in self.kicks:
            _close(k)
        self._death_r.close()
        self._reap_segments_of(self.procs)
