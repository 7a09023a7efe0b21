"""``Executor``: N worker processes, one broadcast queue to them, one response queue each.

A call flows once down and back: ``collective_rpc`` encodes ``(CALL, seq, method, args,
kwargs, reply_rank)`` onto the broadcast queue; every worker answers ``(seq, status,
payload)`` on its response queue, in order; the thread that waits for a result reads the
replies (see :mod:`mpx.futures`). A monitor thread watches the processes and fails the
executor within a second of a worker's death. A call that times out names each missing
rank's state: stalled (its watchdog's report, or a stack dump), stopped, busy or dead.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Any, Callable

import cloudpickle

from mpx import _debug, watchdog
from mpx import worker as W
from mpx.config import Config
from mpx.errors import (
    Cancelled,
    DeserializationError,
    ExecutorFailed,
    PeerDiedError,
    QueueTimeout,
    RPCError,
    RPCTimeoutError,
    SerializationError,
    WorkerDiedError,
    WorkerStalledError,
)
from mpx.futures import RPCFuture
from mpx.launch import LocalWorkers, describe_exit, describe_stall
from mpx.node import Leader
from mpx.queue import MessageQueue
from mpx.worker import WorkerContext

logger = logging.getLogger("mpx")

# How long the monitor waits for the reply-reading lock to collect a dead worker's last
# replies before it fails the executor anyway (within the 1 s bound on reporting a death).
LAST_REPLIES_WAIT_S = 0.1


def _free_tcp_address(host: str = "127.0.0.1") -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class _Call:
    """One call in flight: the replies gathered so far and, once done, its outcome."""

    __slots__ = ("seq", "method", "ranks", "reply_rank", "aggregator", "deadline", "future",
                 "results", "errors", "done", "value", "error", "started")

    def __init__(self, seq: int, method: str, ranks: int, reply_rank: int | None,
                 aggregator: Callable | None, deadline: float | None) -> None:
        self.seq = seq
        self.method = method
        self.ranks = ranks
        self.reply_rank = reply_rank
        self.aggregator = aggregator
        self.deadline = deadline
        self.started = time.monotonic()
        self.future: RPCFuture | None = None  # only for non_block calls
        self.results: dict[int, Any] = {}
        self.errors: dict[int, Any] = {}
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def missing(self) -> list[int]:
        return [r for r in range(self.ranks) if r not in self.results and r not in self.errors]

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        if self.done:
            return
        self.value, self.error, self.done = value, error, True
        if self.future is not None:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Group:
    """Everything the executor owns; ``shutdown`` can run from a finalizer at exit."""

    def __init__(self, config: Config, world_size: int) -> None:
        self.config = config
        self.world_size = world_size
        self.creator_pid = os.getpid()
        self.workers: LocalWorkers | None = None
        self.leader: Leader | None = None
        self.node_watch: threading.Thread | None = None
        self.bq: MessageQueue | None = None
        self.resp: list[MessageQueue] = []
        self.monitor: threading.Thread | None = None
        self.wake_r, self.wake_w = os.pipe()
        self.lock = threading.RLock()
        self.send_lock = threading.Lock()
        self.pump_lock = threading.Lock()
        self.pending: dict[int, _Call] = {}
        self.next_seq = 0
        self.next_reply = [0] * world_size
        self.stalls: dict[int, dict] = {}  # rank -> its watchdog's report of the current stall
        self.failure: ExecutorFailed | None = None
        self.callbacks: list[Callable[[], None]] = []
        self.closing = False
        self.closed = False

    # ---------------------------------------------------------------- failure

    def fail(self, err: ExecutorFailed) -> None:
        with self.lock:
            if self.failure is not None or self.closing:
                return
            self.failure = err
            callbacks, self.callbacks = self.callbacks, []
            pending = list(self.pending.values())
            self.pending.clear()
        logger.error("mpx: executor failed: %s", err)
        for q in self.resp:
            q.shutdown()  # wakes a thread reading replies
        for call in pending:
            call.settle(error=err)
        for cb in callbacks:
            _run_callback(cb)

    @property
    def procs(self) -> list[Any]:
        return self.workers.procs if self.workers is not None else []

    @property
    def pids(self) -> list[int]:
        remote = self.leader.pids if self.leader is not None else {}
        return [p.pid for p in self.procs] + [remote[r] for r in sorted(remote)]

    def died_error(self, rank: int) -> WorkerDiedError:
        if rank >= len(self.procs):  # on a follower node, which reports how it died
            pid = self.leader.pids.get(rank) if self.leader is not None else None
            return WorkerDiedError(f"worker rank {rank} (pid {pid}) on a follower node is gone",
                                   rank=rank, pid=pid)
        p = self.procs[rank]
        assert self.workers is not None
        self.workers.join(p, 1.0)
        return WorkerDiedError(f"worker rank {rank} (pid {p.pid}) died: {describe_exit(p.exitcode)}",
                               rank=rank, pid=p.pid, exitcode=p.exitcode)

    def dump_file(self, rank: int) -> str:
        return watchdog.dump_path(watchdog.dump_dir(self.config.dump_dir), rank,
                                  self.pids[rank])

    def describe_missing(self, ranks: list[int], since: float) -> tuple[str, dict[int, dict]]:
        """How each of ``ranks`` (not answering a call started at monotonic ``since``) looks
        for a timeout message: stalled (its watchdog's report, or a dump its watchdog's C
        thread wrote while the worker held the GIL), stopped (SIGSTOP), dead, or busy; and
        the details of the stalled ones."""
        pids = self.pids
        parts, stalled = [], {}
        for r in ranks:
            pid = pids[r] if r < len(pids) else None
            local = r < len(self.procs)
            state = describe_stall(pid) if local else "on a follower node, alive"
            info = self.stalls.get(r)
            if info is None and local:
                info = self._dumped_stall(r, time.time() - (time.monotonic() - since))
            if info is not None:
                stalled[r] = info
                parts.append(watchdog.describe(info))
            elif local and "stopped" in state:
                stalled[r] = dict(rank=r, pid=pid, state=state)
                parts.append(f"rank {r} (pid {pid}) is stalled: {state}")
            else:
                parts.append(f"rank {r} (pid {pid}) is {state}")
        return "; ".join(parts), stalled

    def _dumped_stall(self, rank: int, since_wall: float) -> dict | None:
        path = self.dump_file(rank)
        try:
            if os.stat(path).st_mtime < since_wall:
                return None
        except OSError:
            return None
        dumped = watchdog.last_c_dump(watchdog.read_dump(path))
        if dumped is None:
            return None
        top = watchdog.top_of_dump(dumped)
        return dict(rank=rank, pid=self.pids[rank], method=watchdog.method_of_dump(top),
                    seconds=self.config.watchdog_timeout_s, stack=top, dump_file=path,
                    reported=False)

    def watch(self) -> None:
        """Monitor thread: a worker's sentinel becomes ready when it exits."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while sentinels:
            ready = multiprocessing.connection.wait(list(sentinels) + [self.wake_r])
            if self.wake_r in ready or self.closing:
                return
            for s in ready:
                rank = sentinels.pop(s)  # type: ignore[arg-type]
                self.take_last_replies(rank)
                self.fail(self.died_error(rank))

    def take_last_replies(self, rank: int) -> None:
        """Read what a worker sent before it died, so that a call it had answered gets its
        result, not the failure. Skipped when another thread holds the reading lock for
        LAST_REPLIES_WAIT_S: it reads them itself, or it waits on another rank and would
        hold up the failure."""
        if rank >= len(self.resp):
            return
        q = self.resp[rank]
        # a ring (unlike a zmq socket) may be polled beside its reader: nothing unread, no wait
        if q.ring_implementation != "zmq" and not q.poll():
            return
        if not self.pump_lock.acquire(timeout=LAST_REPLIES_WAIT_S):
            return
        try:
            while q.poll():
                self.read_reply(rank, 1.0)
        except (ExecutorFailed, QueueTimeout):
            pass  # it died mid-message: the failure follows
        finally:
            self.pump_lock.release()

    def watch_nodes(self) -> None:
        """Node-monitor thread: the only user of the leader's control socket after startup."""
        assert self.leader is not None
        try:
            while not self.closing:
                err = self.leader.poll()
                if err is not None:
                    self.fail(err)
        finally:
            self.leader.stop()

    # ---------------------------------------------------------------- replies

    def finish(self, call: _Call) -> None:
        self.pending.pop(call.seq, None)
        if call.done:
            return
        if call.errors:
            ranks = sorted(call.errors)
            etype, msg, tb = call.errors[ranks[0]]
            call.settle(error=RPCError(ranks, etype, msg, tb, method=call.method))
            return
        if call.reply_rank is not None:
            call.settle(call.results[call.reply_rank])
            return
        value = [call.results[r] for r in range(call.ranks)]
        if call.aggregator is not None:
            try:
                value = call.aggregator(value)
            except Exception as e:
                call.settle(error=e)
                return
        call.settle(value)

    def record(self, rank: int, seq: int, status: int, payload: Any) -> None:
        if status == W.STALL:
            if payload["seq"] < self.next_reply[rank]:
                return  # that call has been answered since
            payload["since"] = time.monotonic() - payload["seconds"]
            logger.warning("mpx: %s", watchdog.describe(payload))
            self.stalls[rank] = payload
            return
        if self.stalls and rank in self.stalls and seq >= self.stalls[rank]["seq"]:
            del self.stalls[rank]
        self.next_reply[rank] = seq + 1
        with self.lock:
            call = self.pending.get(seq)
        if call is None:
            return  # the reply of a call that already timed out
        if status == W.OK:
            call.results[rank] = payload
        else:
            call.errors[rank] = payload
        if len(call.results) + len(call.errors) == call.ranks:
            with self.lock:
                self.finish(call)

    def read_reply(self, rank: int, timeout: float | None) -> None:
        q = self.resp[rank]
        try:
            seq, status, payload = q.dequeue(timeout=timeout, indefinite=True)
        except DeserializationError as e:
            seq = self.next_reply[rank]
            status, payload = W.ERR, ("DeserializationError",
                                      f"the driver could not unpickle the result: {e}", "")
        except PeerDiedError:
            self.fail(self.died_error(rank))
            if self.failure is None:  # shutdown() stopped the workers under this reader
                raise ExecutorFailed("the executor was shut down") from None
            raise self.failure from None
        except Cancelled:
            if self.failure is not None:
                raise self.failure from None
            raise ExecutorFailed("the executor was shut down") from None
        self.record(rank, seq, status, payload)

    def take_available(self) -> None:
        """Read every reply already waiting (the caller holds ``pump_lock``)."""
        for rank, q in enumerate(self.resp):
            while q.poll():
                self.read_reply(rank, None)

    def drain(self) -> None:
        """Read the replies that are there already, so that workers blocked on a full
        response ring go on taking calls (a sender waiting for broadcast room calls this)."""
        if not self.pump_lock.acquire(timeout=0.001):
            return  # another thread is reading replies
        try:
            self.take_available()
        finally:
            self.pump_lock.release()
        time.sleep(0.0002)

    def drive(self, call: _Call, timeout: float | None) -> None:
        """Read replies until ``call`` is done or its deadline passes (RPCTimeoutError), or
        ``timeout`` passes (TimeoutError; the call goes on). Only one thread reads at a time;
        reading for one call completes every earlier call on the way."""
        wait_until = None if timeout is None else time.monotonic() + timeout
        while not call.done:
            limits = [t for t in (wait_until, call.deadline) if t is not None]
            until = min(limits) if limits else None
            left = None if until is None else max(0.0, until - time.monotonic())
            if not self.pump_lock.acquire(timeout=-1 if left is None else left):
                self._timed_out(call, wait_until)
                continue
            try:
                while not call.done:
                    left = None if until is None else max(0.0, until - time.monotonic())
                    try:
                        try:
                            self.read_reply(call.missing()[0], left)
                        except QueueTimeout:
                            self.take_available()  # stall reports of the other ranks
                            self._timed_out(call, wait_until)
                    except ExecutorFailed as e:
                        call.settle(error=e)
            finally:
                self.pump_lock.release()

    def _timed_out(self, call: _Call, wait_until: float | None) -> None:
        now = time.monotonic()
        if call.done:
            return
        if call.deadline is not None and now >= call.deadline:
            with self.lock:
                self.pending.pop(call.seq, None)
            missing = call.missing()
            text, stalled = self.describe_missing(missing, call.started)
            message = (f"collective_rpc {call.method!r} timed out after "
                       f"{now - call.started:.1f} s; ranks {missing} have not answered: {text}")
            call.settle(error=WorkerStalledError(message, missing, stalled) if stalled else
                        RPCTimeoutError(message, missing))
        elif wait_until is not None and now >= wait_until:
            raise TimeoutError(f"result() timed out; call {call.method!r} is still running")

    # ---------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        with self.lock:
            if self.closed or os.getpid() != self.creator_pid:
                return
            self.closing = True
            pending = list(self.pending.values())
            self.pending.clear()
        gone = ExecutorFailed("the executor was shut down")
        for call in pending:
            call.settle(error=gone)
        if self.bq is not None and self.failure is None:
            try:
                self.bq.enqueue((W.STOP, self.next_seq), timeout=1.0)
            except Exception:
                pass
        if self.workers is not None:
            self.workers.stop()
        os.write(self.wake_w, b"x")
        for t in (self.monitor, self.node_watch):
            if t is not None and t is not threading.current_thread():
                t.join(5)
        if self.leader is not None and self.node_watch is None:
            self.leader.stop()  # startup failed before the watch began
        for q in self.resp:
            q.close()
        if self.bq is not None:
            self.bq.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        self.closed = True


def _shutdown_before_thread_join(finalizer: Callable[[], Any]) -> None:
    """Run ``finalizer`` as the interpreter starts to exit, before it joins non-daemon
    threads (concurrent.futures does the same): a thread blocked in a call then gets
    ExecutorFailed instead of holding the exit up for as long as the workers take."""
    try:
        threading._register_atexit(finalizer)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        pass  # no such hook in this Python, or the interpreter is already exiting


def _run_callback(cb: Callable[[], None]) -> None:
    try:
        cb()
    except Exception:
        logger.exception("mpx: a failure callback raised")


class Executor:
    """Start ``world_size`` processes each holding ``worker_cls(ctx, **worker_kwargs)`` and
    call their methods collectively.

    ``config`` (an :class:`mpx.Config`, default ``Config.from_env()``) and ``overrides``
    (its field names) set start method, ring geometry, timeouts and thread counts.
    Construction returns once every worker is ready; a worker whose ``__init__`` raises
    makes it raise :class:`mpx.WorkerStartupError`.
    """

    def __init__(self, worker_cls: type, world_size: int, *, worker_kwargs: dict | None = None,
                 config: Config | None = None, **overrides: Any) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not callable(worker_cls):
            raise TypeError(f"worker_cls must be a class, got {worker_cls!r}")
        cfg = Config.from_env(**overrides) if config is None else \
            dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
        if cfg.nnodes > 1 and world_size % cfg.nnodes:
            raise ValueError(f"world_size {world_size} is not a multiple of nnodes {cfg.nnodes}")
        if cfg.nnodes > 1 and not cfg.auth_key and not cfg.allow_insecure:
            raise ValueError("a multi-node executor needs Config.auth_key (MPX_AUTH_KEY), the "
                             "same on every node, or MPX_ALLOW_INSECURE=1")
        if not cfg.auth_key and cfg.transport != "shm":
            # zmq queues need a key; the workers get it through their (private) start pipe
            cfg = dataclasses.replace(cfg, auth_key=secrets.token_hex(32))
        try:
            cls_bytes = cloudpickle.dumps(worker_cls)
            kw_bytes = cloudpickle.dumps(worker_kwargs)
        except Exception as e:
            raise SerializationError(f"cannot pickle the worker class or its kwargs: {e}") from e
        self.config = cfg
        self.world_size = world_size
        logger.info("mpx: starting %d workers of %s; config: %s", world_size,
                    getattr(worker_cls, "__qualname__", worker_cls), cfg.describe())
        g = self._group = _Group(cfg, world_size)
        self._finalizer = weakref.finalize(self, g.shutdown)
        _shutdown_before_thread_join(self._finalizer)
        try:
            self._start(worker_cls, cls_bytes, kw_bytes)
        except BaseException:
            self._finalizer()
            raise

    def _start(self, worker_cls: type, cls_bytes: bytes, kw_bytes: bytes) -> None:
        g, cfg = self._group, self.config
        local = self.world_size // cfg.nnodes
        # remote readers: one relay per follower node, or every remote rank directly
        remote = cfg.nnodes - 1 if cfg.relays(local) else self.world_size - local
        g.bq = MessageQueue(local + remote, local, local_reader_ranks=list(range(local)),
                            connect_ip=cfg.host, config=cfg)
        dist = _free_tcp_address(cfg.master_addr if cfg.nnodes > 1 else "127.0.0.1")
        ctxs = [WorkerContext(rank=rank, local_rank=rank, world_size=self.world_size,
                              local_world_size=local, node_rank=0,
                              distributed_init_method=dist, config=cfg)
                for rank in range(local)]
        deadline = time.monotonic() + cfg.startup_timeout_s
        watchdog.reap_empty_dumps(watchdog.dump_dir(cfg.dump_dir))
        g.workers = LocalWorkers(cfg, ctxs, g.bq.export_handle(), cls_bytes, kw_bytes)
        if cfg.nnodes > 1:
            g.leader = Leader(cfg, self.world_size)
            g.leader.admit(dict(config=cfg, world_size=self.world_size, dist=dist,
                                handle=g.bq.export_handle(), worker_cls=cls_bytes,
                                worker_kwargs=kw_bytes), deadline)
        handles = g.workers.handshake(deadline)
        if g.leader is not None:
            handles.update(g.leader.collect(deadline))
        g.resp = [MessageQueue.create_from_handle(handles[r], 0, config=cfg)
                  for r in range(self.world_size)]
        g.bq.wait_until_ready(timeout=max(1.0, deadline - time.monotonic()))
        g.monitor = threading.Thread(target=_debug.counted_thread(g.watch),
                                     name="mpx-executor-monitor", daemon=True)
        g.monitor.start()
        if g.leader is not None:
            g.node_watch = threading.Thread(target=_debug.counted_thread(g.watch_nodes),
                                            name="mpx-node-monitor",
                                            daemon=True)
            g.node_watch.start()

    # ---------------------------------------------------------------- calls

    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict | None = None, non_block: bool = False,
                       unique_reply_rank: int | None = None,
                       aggregator: Callable[[list], Any] | None = None) -> Any:
        """Call ``method`` on every worker and gather the results in rank order.

        ``method`` is a method name or a callable sent with cloudpickle and called as
        ``method(worker, *args, **kwargs)``. Returns the list of results, the result of
        ``unique_reply_rank`` alone, or ``aggregator(list)``; with ``non_block=True`` a
        future of that. ``timeout`` is a deadline for the whole call, from now.
        """
        g = self._group
        self._check_usable()
        if not (isinstance(method, str) or callable(method)):
            raise TypeError(f"method must be a name or a callable, got {type(method).__name__}")
        if unique_reply_rank is not None and (
                not isinstance(unique_reply_rank, int) or
                not 0 <= unique_reply_rank < self.world_size):
            raise ValueError(f"unique_reply_rank must be in [0, {self.world_size}), "
                             f"got {unique_reply_rank!r}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        name = method if isinstance(method, str) else getattr(method, "__name__", "<callable>")
        with g.send_lock:
            seq = g.next_seq
            call = _Call(seq, name, self.world_size, unique_reply_rank, aggregator, deadline)
            if non_block:
                call.future = RPCFuture(lambda t: g.drive(call, t))
            with g.lock:
                self._check_usable()
                g.pending[seq] = call
            try:
                assert g.bq is not None
                g.bq.enqueue((W.CALL, seq, method, tuple(args), kwargs or None,
                              unique_reply_rank), timeout=timeout,
                             while_full=g.drain if len(g.pending) > 1 else None)
            except BaseException as e:
                with g.lock:
                    g.pending.pop(seq, None)
                if isinstance(e, QueueTimeout):
                    raise RPCTimeoutError(f"collective_rpc {name!r} timed out before every "
                                          f"worker could take the call: {e}",
                                          list(range(self.world_size))) from e
                if isinstance(e, PeerDiedError) and e.rank is not None:
                    g.fail(g.died_error(e.rank))  # the monitor may not have seen it yet
                if isinstance(e, (PeerDiedError, Cancelled)):
                    self._check_usable()
                    raise ExecutorFailed(f"collective_rpc {name!r} could not be sent: {e}") from e
                raise
            g.next_seq = seq + 1
        if call.future is not None:
            return call.future
        g.drive(call, None)
        return call.outcome()

    def check_health(self, timeout: float = 10.0) -> None:
        """Raise unless every worker answers a ping within ``timeout`` seconds:
        WorkerStalledError at once for ranks whose watchdog reported a stall (naming the
        method, for how long, and the top frames), RPCTimeoutError or WorkerStalledError
        when the ping times out, ExecutorFailed when a worker is dead."""
        g = self._group
        self._check_usable()
        if g.pump_lock.acquire(timeout=timeout):  # else another thread reads replies
            try:
                g.take_available()
            finally:
                g.pump_lock.release()
        if g.stalls:
            ranks = sorted(g.stalls)
            stalls = {r: g.stalls[r] for r in ranks}
            raise WorkerStalledError(
                f"ranks {ranks} are stalled: "
                + "; ".join(watchdog.describe(i) for i in stalls.values()), ranks, stalls)
        pids = self.collective_rpc(W.PING, timeout=timeout)
        expected = self._group.pids
        if pids != expected:
            raise ExecutorFailed(f"workers answered with pids {pids}, expected {expected}")

    def dump_stacks(self, timeout: float = 5.0) -> dict[int, str]:
        """Every worker's current stacks (all threads, faulthandler format) by rank, taken
        on demand even while workers are busy or stuck in C code. A worker that cannot
        dump within ``timeout`` seconds gets a line saying why (stopped, dead...)."""
        g = self._group
        deadline = time.monotonic() + timeout
        out = watchdog.dump_all({r: (p.pid, g.dump_file(r)) for r, p in enumerate(g.procs)},
                                timeout, describe_stall)
        if g.leader is not None:
            out.update(g.leader.stacks(max(0.0, deadline - time.monotonic())))
        return out

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` once when the executor fails (at once if it already has)."""
        g = self._group
        with g.lock:
            if g.failure is None:
                g.callbacks.append(callback)
                return
        _run_callback(callback)

    @property
    def is_failed(self) -> bool:
        """True once a worker died; every call then raises the failure."""
        return self._group.failure is not None

    @property
    def worker_pids(self) -> list[int]:
        """Every worker's pid in rank order (those of follower nodes as they reported)."""
        return self._group.pids

    def _check_usable(self) -> None:
        g = self._group
        if g.failure is not None:
            raise g.failure
        if g.closing:
            raise ExecutorFailed("the executor was shut down")

    def shutdown(self) -> None:
        """Stop the workers (stop message, then SIGTERM, then SIGKILL after the grace
        periods), join every thread mpx started and close every queue. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
