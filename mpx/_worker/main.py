"""The worker process: ready handshake, parent-death detection, signals and the RPC loop.

The executor starts one process per rank with :func:`worker_main`. The worker attaches to
the broadcast queue, builds the user's worker object, creates its response queue, and
answers every call on it exactly once, in order, with ``(seq, status, payload)``: from the
RPC loop itself, or from the async output thread (:mod:`mpx._worker.output`). The watchdog
(:mod:`mpx.watchdog`) watches each call and may add a STALL report before its answer. A
REGROUP message (the driver re-formed the group: a rank restarted, a resize) moves the loop
to another broadcast queue, or ends it, as STOP does, when the rank is past the new size.

What a call raises: an error of that call alone (an RPCError in the driver, with the
exception's type name, message and traceback: :func:`mpx.protocol.wire.error_payload`;
the traceback is its ``__cause__`` too), and the worker serves the next call; this holds
for any exception, ``BaseException`` subclasses included (``asyncio.CancelledError`` from
``asyncio.run`` of a cancelled task, ``GeneratorExit``, a user's own), whether the
method, its result's ``get_output()`` or the pickling of its result raised it. The
exceptions that ask a process to stop, ``SystemExit`` and ``KeyboardInterrupt``
(:data:`~mpx._worker.output.ENDS_THE_WORKER`, asyncio's rule for its callbacks), end the
worker instead: a method that calls ``sys.exit(3)`` exits with code 3, and the driver
reports the death (``WorkerDiedError``, "exit code 3").

Signals: the driver decides when its workers stop. A worker leads a process group of its
own, so what is sent to the driver's group (Ctrl-C in a terminal, ``kill -TERM -PGID``)
never reaches it. A SIGINT or SIGTERM that reaches it anyway (systemd's control-group
stop, ``scancel``, a ``kill`` of its pid) is ignored, with one warning, while its driver
holds it: the driver, which got the same signal, drains its calls and then stops the
workers. Once the driver has let go (it closes the death pipe before it sends any
SIGTERM, at shutdown) or died, either signal ends the worker: the call is unwound (its
``finally`` blocks run) and the process dies of the signal's default action, so the
driver reads "killed by SIGTERM", never "exit code 0". SIGKILL always ends it at once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
from typing import Any

import cloudpickle

from mpx import _debug, dumps
from mpx._procinfo import set_parent_death_signal
from mpx._worker.output import ENDS_THE_WORKER, AsyncOutput, InlineOutput, Replies
from mpx._worker.stall_watch import Watchdog, block_dump_signal
from mpx.errors import Cancelled, DeserializationError, PeerDiedError
from mpx.protocol.wire import (
    ERR,
    OK,
    PING,
    REGROUP,
    STALL,
    STOP,
    Ready,
    StartupFailed,
    WorkerContext,
    WorkerSpec,
    error_payload,
)
from mpx.queue import MessageQueue

logger = logging.getLogger("mpx")

# How long the watchdog waits for room in the response queue to report a stall.
STALL_REPORT_TIMEOUT_S = 1.0

# After the driver's death pipe closes, a worker busy in user code gets this long to
# finish before it is ended: the 2 s bound on orphaned workers includes it.
ORPHAN_GRACE_S = 1.0


class _PrefixedStream:
    """Writes ``prefix`` at the start of every line of an underlying text stream."""

    def __init__(self, stream, prefix: str) -> None:
        self._stream = stream
        self._prefix = prefix
        self._at_line_start = True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start:
                out.append(self._prefix)
            out.append(piece)
            self._at_line_start = piece.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _arm_parent_death_signal(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies; closes the race with an early death."""
    if os.getppid() != parent_pid or not set_parent_death_signal(signal.SIGKILL):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _set_identity(ctx: WorkerContext) -> None:
    title = f"mpx::worker rank={ctx.rank}"
    try:
        import setproctitle
        setproctitle.setproctitle(title)
    except ImportError:
        pass
    prefix = f"(mpx worker rank={ctx.rank} pid={os.getpid()}) "
    sys.stdout = _PrefixedStream(sys.stdout, prefix)  # type: ignore[assignment]
    sys.stderr = _PrefixedStream(sys.stderr, prefix)  # type: ignore[assignment]
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def _set_threads(ctx: WorkerContext) -> None:
    n = ctx.config.worker_threads or max(1, (os.cpu_count() or 1) // ctx.local_world_size)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _watch_parent(death_conn, parent_pid: int, on_orphaned, kick_conn=None,
                  on_kick=None) -> None:
    """Thread: the driver closed the death pipe, or died. The pipe alone can stay open
    after the driver's death (a process the driver forked holds its write end); the
    driver's pidfd says so whoever holds what. Meanwhile, each byte on ``kick_conn`` (a
    follower's workers: the leader was silent and is heard again) calls ``on_kick``."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    watched: list[Any] = [death_conn]
    pidfd = -1
    try:
        pidfd = os.pidfd_open(parent_pid)
        watched.append(pidfd)
    except ProcessLookupError:
        watched = []  # the driver is gone already
    except (AttributeError, OSError):
        pass  # no pidfds here (Linux < 5.3): the pipe alone
    if watched and kick_conn is not None:
        watched.append(kick_conn)
    try:
        while watched:
            ready = multiprocessing.connection.wait(watched)
            if kick_conn in ready:
                ready.remove(kick_conn)
                try:
                    kick_conn.recv_bytes()
                except (EOFError, OSError):
                    watched.remove(kick_conn)  # (its parent closed it, or is gone: see above)
                else:
                    try:
                        on_kick()
                    except Exception:  # (the watch for the driver's death goes on)
                        logger.exception("taking the links to the driver up again failed")
            if ready:
                break
    except OSError:
        pass
    finally:
        if pidfd >= 0:
            os.close(pidfd)
    on_orphaned()


def _leave_the_group_after_fork() -> None:
    """In a child that user code forked from a worker: it shares the worker's queues, so
    it must never touch them, and it dies with the worker (SIGKILL). SIGTERM and SIGINT
    act in it as in any Python process (the worker's policy is the worker's own)."""
    global _forked_from
    _forked_from = _worker_pid
    set_parent_death_signal(signal.SIGKILL)
    for signum, default in _INTERRUPTS.items():
        try:
            if isinstance(signal.getsignal(signum), _Interrupts):
                signal.signal(signum, default)
        except (ValueError, OSError):
            pass


_worker_pid = -1
_forked_from = -1  # in a process forked from a worker by user code: that worker's pid


def _exit_if_forked() -> None:
    """A process forked by user code that came back into mpx's code leaves at once,
    without running any finalizer (they would close the worker's queues)."""
    if _forked_from != -1:
        os._exit(0)


# The signals a worker leaves to its driver while the driver holds it, with the action a
# process forked from a worker gets back.
_INTERRUPTS: dict[signal.Signals, Any] = {signal.SIGTERM: signal.SIG_DFL,
                                         signal.SIGINT: signal.default_int_handler}


def _lead_own_process_group() -> None:
    """Leave the driver's process group (see the module docstring). The starter does the
    same from its side where it can (fork), closing the window before this runs."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass  # a session leader already (EPERM): in no terminal's group
    # A background group's write to a terminal with `stty tostop` would stop the worker
    # (SIGTTOU); ignored, its output goes out as it did from the driver's group.
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)


class _EndedBySignal(SystemExit):
    """Raised by the SIGTERM/SIGINT handler once the driver has let go of the worker: it
    unwinds the call, and :func:`worker_main` then dies of ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class _Interrupts:
    """The SIGTERM and SIGINT handler (see the module docstring): ignored with one warning
    each while the driver holds this worker, the end of it once the driver has let go."""

    def __init__(self, rank: int, driver_pid: int, death_conn, orphaned: threading.Event) -> None:
        self._rank = rank
        self._driver_pid = driver_pid
        self._death_conn = death_conn
        self._orphaned = orphaned
        self._warned: set[int] = set()

    def install(self) -> None:
        for signum in _INTERRUPTS:
            signal.signal(signum, self)

    def driver_let_go(self) -> bool:
        """Whether the driver is gone or stopping this worker: it closed the death pipe
        (LocalWorkers.stop does before its SIGTERM, so the closing is already visible here
        when that signal comes), or the parent watch saw it die."""
        if self._orphaned.is_set():
            return True
        try:
            return bool(self._death_conn.poll(0))  # the pipe carries no data: EOF
        except (OSError, ValueError, EOFError):
            return True

    def __call__(self, signum: int, frame: Any) -> None:
        if self.driver_let_go():
            raise _EndedBySignal(signum)
        if signum in self._warned:
            return
        self._warned.add(signum)
        # os.write, not print or logging: this may interrupt a write to the same stream
        name = signal.Signals(signum).name
        text = (f"(mpx worker rank={self._rank} pid={os.getpid()}) mpx: ignoring {name}: "
                f"this worker's driver (pid {self._driver_pid}) is alive and stops its "
                f"workers itself (shutdown, or its exit); SIGKILL ends this worker now. "
                f"(Said once per signal.)\n")
        try:
            os.write(2, text.encode(errors="replace"))
        except OSError:
            pass


def _die_of(signum: int) -> None:
    """End this process by ``signum``'s default action, so that its exit status (-signum to
    the driver) says what ended it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # closed, or a broken pipe: nothing to keep
            pass
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # (not reached: the signal is delivered before kill returns)


# glibc gives freed memory at the top of the heap back to the kernel past 128 KiB
# (M_TRIM_THRESHOLD) and serves blocks from 128 KiB to 32 MiB from fresh mmaps once freed
# ones were returned; every large message a worker receives then lands in fresh pages, and
# their faults cap the copy at ~3 GB/s here (a 1.1 MiB round trip: 1.0 ms -> 0.3 ms kept).
# A worker keeps up to KEEP_FREED_BYTES of freed heap mapped for the next message instead.
# MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ in the environment win.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BYTES = 256 << 20
MMAP_FROM_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit


def _keep_freed_memory() -> None:
    if "MALLOC_TRIM_THRESHOLD_" in os.environ or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES)
    mallopt(_M_MMAP_THRESHOLD, MMAP_FROM_BYTES)


def worker_main(spec: WorkerSpec, ready_conn, death_conn, kick_conn=None) -> None:
    """Entry point of a worker process (see module docstring). ``kick_conn``: a follower's
    worker is told on it to take its network link up again (_watch_parent)."""
    try:
        _worker_main(spec, ready_conn, death_conn, kick_conn)
    except _EndedBySignal as e:
        _exit_if_forked()
        _die_of(e.signum)


def _worker_main(spec: WorkerSpec, ready_conn, death_conn, kick_conn) -> None:
    global _worker_pid
    _lead_own_process_group()  # first: until then, the driver's group's signals reach it
    _worker_pid = os.getpid()
    block_dump_signal()  # before any thread starts: they all inherit it
    os.register_at_fork(after_in_child=_leave_the_group_after_fork)
    for fd in spec.close_fds:  # fork: the driver's ends of other workers' pipes
        try:
            os.close(fd)
        except OSError:
            pass
    if spec.arm_pdeathsig:
        _arm_parent_death_signal(spec.parent_pid)
    ctx = spec.ctx
    orphaned = threading.Event()
    _Interrupts(ctx.rank, spec.parent_pid, death_conn, orphaned).install()
    _set_identity(ctx)
    _set_threads(ctx)
    _keep_freed_memory()

    broadcast = resp = None
    out: InlineOutput | AsyncOutput | None = None
    wd: Watchdog | None = None

    def on_orphaned() -> None:
        orphaned.set()
        if broadcast is not None:
            broadcast.shutdown()
        timer = threading.Timer(ORPHAN_GRACE_S, os._exit, (0,))
        timer.daemon = True
        timer.start()

    def on_kick() -> None:
        # (each read once: the RPC loop may move to another queue meanwhile)
        for queue in (broadcast, resp):
            if queue is not None:
                queue.reconnect_links()

    threading.Thread(target=_debug.counted_thread(_watch_parent),
                     args=(death_conn, spec.parent_pid, on_orphaned, kick_conn, on_kick),
                     name="mpx-parent-watch", daemon=True).start()
    try:
        try:
            # (a queue it cannot attach to is a failure to report, as its __init__'s: not a
            # death, which the driver would answer with another process on the same queue)
            broadcast = MessageQueue.create_from_handle(spec.handle, spec.queue_rank,
                                                        config=ctx.config)
            worker_cls = cloudpickle.loads(spec.worker_cls)
            kwargs = cloudpickle.loads(spec.worker_kwargs) or {}
            worker = worker_cls(ctx, **kwargs)
        except _EndedBySignal:
            raise  # the driver gave up on the startup and stopped it: no failure to report
        except BaseException as e:
            ready_conn.send(StartupFailed.of(e))
            return
        if spec.remote_driver:  # the driver is on another node: answer over zmq
            resp = MessageQueue(1, 0, connect_ip=ctx.config.host, config=ctx.config)
        else:
            resp = MessageQueue(1, 1, config=ctx.config)
        replies = Replies(resp)
        try:
            wd = Watchdog(ctx.rank, ctx.config.watchdog_timeout_s,
                          dumps.dump_dir(ctx.config.dump_dir),
                          lambda info: replies.send(info["seq"], STALL, info,
                                                    timeout=STALL_REPORT_TIMEOUT_S))
        except OSError as e:
            ready_conn.send(StartupFailed.of(
                OSError(f"cannot write stack dumps to Config.dump_dir (MPX_DUMP_DIR): {e}")))
            return
        wd.start()
        out = (AsyncOutput if ctx.config.async_output else InlineOutput)(replies, worker)
        ready_conn.send(Ready(resp.export_handle(), os.getpid()))
        ready_conn.close()
        seq = 0
        while True:
            moved = _serve(worker, ctx.rank, broadcast, out, wd, seq)
            if moved is None or ctx.rank >= moved[3]:
                break  # stopped, or left the group in a resize
            _, seq, handle, _ = moved  # the group was re-formed: the next calls come there
            old, broadcast = broadcast, None
            old.close()
            broadcast = MessageQueue.create_from_handle(handle, spec.queue_rank,
                                                        config=ctx.config)
    except (Cancelled, PeerDiedError):
        pass  # the driver shut down or died
    finally:
        _exit_if_forked()
        if out is not None:
            try:
                out.close()
            except (Cancelled, PeerDiedError):
                pass
        if wd is not None:
            wd.stop()
        if resp is not None:
            resp.close()
        if broadcast is not None:
            broadcast.close()


def _call(worker: Any, method: Any, args: tuple, kwargs: dict | None) -> Any:
    if not isinstance(method, str):
        return functools.partial(method, worker)(*args, **(kwargs or {}))
    if method == PING:
        return os.getpid()
    fn = getattr(worker, method, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"{type(worker).__name__} has no method {method!r}")
    if kwargs is None:  # (the common call: no dict to make and unpack)
        return fn(*args)
    return fn(*args, **kwargs)


def _serve(worker: Any, rank: int, broadcast: MessageQueue, out: InlineOutput | AsyncOutput,
           wd: Watchdog, expected: int) -> tuple | None:
    """Answer the calls of ``broadcast`` until STOP (None) or REGROUP (that message).
    ``expected``: the seq of the first message, which names a call whose arguments do not
    unpickle."""
    calls = broadcast.reading_end()  # the calls' channel: dequeue(indefinite=True)'s work
    begin, end, put = wd.begin, wd.end, out.put
    while True:
        try:
            msg = calls.recv(-1)
        except DeserializationError as e:
            put(expected, ERR, error_payload(e), True)
            expected += 1
            continue
        tag, seq = msg[0], msg[1]
        expected = seq + 1
        if tag == STOP:
            return None
        if tag == REGROUP:
            return msg
        if len(msg) == 6:
            _, _, method, args, kwargs, reply_rank = msg
            trace = None
        else:  # (Config.tracing: the caller's trace context too)
            _, _, method, args, kwargs, reply_rank, trace = msg
        name = method if isinstance(method, str) else getattr(method, "__name__", "<callable>")
        begin(name, seq)
        try:
            if trace is None:
                status, result = OK, _call(worker, method, args, kwargs)
            else:  # (imported on the first traced call: opentelemetry is optional)
                from mpx._worker import tracing
                status, result = OK, tracing.run_traced(trace, name, rank, _call, worker,
                                                        method, args, kwargs)
        except ENDS_THE_WORKER:
            raise
        except BaseException as e:  # (see the module docstring)
            status, result = ERR, error_payload(e)
        finally:
            end()
            if _forked_from != -1:  # the method forked, and this is the child
                os._exit(0)
        put(seq, status, result, reply_rank is None or reply_rank == rank)
        # Let go of this call's arguments and result now, not when the next call comes:
        # a large result would stay in memory while the worker idles, and a __del__ that
        # crashes would take down an unrelated later call.
        del msg, method, args, kwargs
        result = None
