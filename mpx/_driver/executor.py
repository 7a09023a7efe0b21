"""``Executor``: N worker processes, one broadcast queue to them, one response queue each.

A thin facade: :class:`~mpx._driver.group.WorkerGroup` owns the processes, queues and
threads, and :class:`~mpx._driver.calls.CallTable` sends the calls and reads the replies.
A call flows once down and back: ``collective_rpc`` broadcasts ``wire.call(...)``; every
worker answers ``(seq, status, payload)`` on its response queue, in order; whichever thread
reads a reply completes its call. A monitor thread fails the executor within a second of a
worker's death, and then stops the surviving workers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle

from mpx import dumps
from mpx._driver import aio, preflight, stats, tracing
from mpx._driver.calls import PendingCalls
from mpx._driver.group import WorkerGroup
from mpx._driver.stats import Stats
from mpx._procinfo import describe_stall
from mpx.config import Config
from mpx.errors import ExecutorFailed, NotOwnerError, ResizeError, SerializationError
from mpx.protocol import wire

logger = logging.getLogger("mpx")

# This process's pid, kept current across os.fork() (multiprocessing's "fork" included) by
# the hook below: the owner check of every public entry point reads it instead of calling
# os.getpid(), a system call each time (glibc caches no pid), ~3% of an event loop's time
# per call. (The futures' core keeps its own, a C variable, for the futures' checks.)
_this_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _this_pid
    _this_pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _shutdown_before_thread_join(finalizer: Callable[[], Any]) -> None:
    """Run ``finalizer`` as the interpreter starts to exit, before it joins non-daemon
    threads (concurrent.futures does the same): a thread blocked in a call then gets
    ExecutorFailed instead of holding the exit up for as long as the workers take.

    CPython's private ``threading._register_atexit`` is the only hook that runs then: the
    public ``atexit`` runs its functions after those threads were joined, too late
    (tests/failures/test_matrix.py's interpreter exit with calls pending); a thread of mpx's joining
    the main thread would see it too, but would be one more thread in every process."""
    try:
        threading._register_atexit(finalizer)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        pass  # no such hook in this Python, or the interpreter is already exiting


class _Pids(list):
    """A list of pids that returns itself when called (see Executor.worker_pids)."""

    def __call__(self) -> list[int]:
        return list(self)


def _vllm_aggregate(agg: Any, output_rank: int) -> Callable[[list], Any]:
    """vLLM's KV-output aggregator object as an aggregator of the list of results."""
    if not callable(getattr(agg, "aggregate", None)):
        raise TypeError(f"kv_output_aggregator must have an aggregate() method, got "
                        f"{type(agg).__name__}")
    return lambda outputs: agg.aggregate(outputs, output_rank=output_rank)


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
        local = world_size // cfg.nnodes
        preflight.check_size(world_size, local, local)
        if cfg.nnodes > 1 and not cfg.auth_key and not cfg.allow_insecure and \
                cfg.launcher != "ray":
            raise ValueError("a multi-node executor needs Config.auth_key (MPX_AUTH_KEY), the "
                             "same on every node, or MPX_ALLOW_INSECURE=1")
        if not cfg.auth_key and (cfg.transport != "shm" or cfg.launcher == "ray"):
            # zmq queues need a key; the workers get it through their (private) start pipe,
            # Ray's follower actors through their constructor
            cfg = dataclasses.replace(cfg, auth_key=secrets.token_hex(32))
        try:
            cls_bytes = cloudpickle.dumps(worker_cls)
            kw_bytes = cloudpickle.dumps(worker_kwargs)
        except Exception as e:
            raise SerializationError(f"cannot pickle the worker class or its kwargs: {e}") from e
        self.config = cfg
        logger.info("starting %d workers of %s (transport %s, start method %s)", world_size,
                    getattr(worker_cls, "__qualname__", worker_cls), cfg.transport,
                    cfg.start_method)
        logger.debug("config: %s", cfg.describe())
        self._pid = os.getpid()
        # the awaitable forms' state (mpx/_driver/aio.py): one shutdown, one failure future
        self._shutdown_once = aio.Once()
        self._failure_once = aio.Once()
        group = self._group = WorkerGroup(cfg, world_size)
        self._finalizer = weakref.finalize(self, group.shutdown)
        _shutdown_before_thread_join(self._finalizer)
        try:
            group.start(cls_bytes, kw_bytes)
        except BaseException:
            self._finalizer()
            raise
        self.config = group.config  # launcher="ray" fills in the addresses
        self._tracing = cfg.tracing and tracing.available()
        if cfg.tracing and not self._tracing:
            logger.warning("Config.tracing is on but opentelemetry-api is not installed: "
                           "calls are not traced (pip install opentelemetry-api)")

    # ---------------------------------------------------------------- calls

    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict | None = None, non_block: bool = False,
                       unique_reply_rank: int | None = None,
                       aggregator: Callable[[list], Any] | Any = None,
                       kv_output_aggregator: Any = None, *,
                       _trace: dict[str, str] | None = None) -> Any:
        """Call ``method`` on every worker and gather the results in rank order.

        ``method`` is a method name or a callable sent with cloudpickle and called as
        ``method(worker, *args, **kwargs)``. A name may be any attribute of the worker,
        private ones included (whoever can call can already send code), except special
        ``__names__``, which are refused (ValueError). Returns the list of results, the result of
        ``unique_reply_rank`` alone, or ``aggregator(list)``. ``timeout`` is a deadline for
        the whole call, from now.

        vLLM's aggregator objects work too, as ``kv_output_aggregator=`` or as
        ``aggregator`` (told apart by their ``aggregate`` attribute): every rank replies, and
        the call returns ``agg.aggregate(results, output_rank=unique_reply_rank or 0)``.

        With ``non_block=True`` it returns an :class:`mpx.RPCFuture` at once: it completes
        when the replies arrive (callbacks, ``concurrent.futures.wait`` and asyncio work, no
        ``result()`` needed), and is awaitable. A sent call cannot be cancelled
        (``cancel()`` returns False); a reply that comes after its call timed out is dropped.

        With ``Config.tracing`` the call runs inside an OpenTelemetry span that reaches into
        the workers (mpx/_driver/tracing.py; ``_trace`` is that module's).
        """
        if self._pid != _this_pid:
            self._check_owner()
        if self._tracing and _trace is None:
            return self._traced(method, timeout, args, kwargs, non_block, unique_reply_rank,
                                aggregator, kv_output_aggregator)
        calls = self._group.calls
        calls.check_usable()
        if not calls.pending:  # (else they are awake: a call is under way)
            calls.wake_workers()  # their wake-up overlaps the Python up to the write
        if isinstance(method, str):
            if method[:2] == "__" and method[-2:] == "__":
                raise ValueError(f"collective_rpc refuses the special method {method!r}; "
                                 "to call it all the same, pass a callable: "
                                 f"lambda worker, *args: worker.{method}(*args)")
        elif not callable(method):
            raise TypeError(f"method must be a name or a callable, got {type(method).__name__}")
        if unique_reply_rank is not None and (
                not isinstance(unique_reply_rank, int) or
                not 0 <= unique_reply_rank < self.world_size):
            raise ValueError(f"unique_reply_rank must be in [0, {self.world_size}), "
                             f"got {unique_reply_rank!r}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        name = method if isinstance(method, str) else getattr(method, "__name__", "<callable>")
        reply_rank = unique_reply_rank
        if kv_output_aggregator is not None or \
                aggregator is not None and hasattr(aggregator, "aggregate"):
            if kv_output_aggregator is not None and aggregator is not None:
                raise TypeError("give aggregator or kv_output_aggregator, not both")
            aggregator = _vllm_aggregate(kv_output_aggregator or aggregator,
                                         unique_reply_rank or 0)
            reply_rank = None  # every rank's output goes to the aggregator
        elif aggregator is not None and not callable(aggregator):
            raise TypeError(f"aggregator must be a callable or have an aggregate() method, "
                            f"got {type(aggregator).__name__}")
        call = calls.sender.send(method, name, tuple(args), kwargs or None, reply_rank,
                          aggregator, timeout, non_block, _trace)
        if call.future is not None:
            return call.future
        calls.pump.wait(call)
        return call.outcome()

    def _traced(self, method: str | Callable, timeout: float | None, args: tuple,
                kwargs: dict | None, non_block: bool, *rest: Any) -> Any:
        """collective_rpc inside its span (``rest``: its last arguments, in order)."""
        name = method if isinstance(method, str) else getattr(method, "__name__", "<callable>")
        return tracing.traced_call(
            lambda trace: self.collective_rpc(method, timeout, args, kwargs, non_block, *rest,
                                              _trace=trace),
            name, self.world_size, non_block)

    def check_health(self, timeout: float = 10.0) -> None:
        """Raise unless every worker answers a ping within ``timeout`` seconds:
        WorkerStalledError at once for ranks whose watchdog reported a stall (naming the
        method, for how long, and the top frames), RPCTimeoutError or WorkerStalledError
        when the ping times out, ExecutorFailed when a worker is dead."""
        self._check_owner()
        group = self._group
        group.calls.check_usable()
        group.calls.read_available(timeout)
        group.stalls.raise_reported()
        pids = self.collective_rpc(wire.PING, timeout=timeout)
        expected = group.pids
        if pids != expected:
            raise ExecutorFailed(f"workers answered with pids {pids}, expected {expected}")

    # ---------------------------------------------------------------- asyncio forms

    async def check_health_async(self, timeout: float = 10.0) -> None:
        """:meth:`check_health` for a coroutine, with the same errors, never blocking the
        event loop: the ping is a non-blocking call that the loop awaits (a stall report
        that comes in meanwhile raises WorkerStalledError within 0.1 s)."""
        self._check_owner()
        await aio.check_health(self, timeout)

    async def shutdown_async(self) -> None:
        """:meth:`shutdown` for a coroutine: it runs in a thread of its own
        (``mpx-shutdown``) while the event loop goes on, and returns once it is over.
        Idempotent: concurrent callers await the same shutdown. Cancelling the awaiting
        task leaves the shutdown to finish in its thread."""
        self._check_owner()
        await aio.shutdown(self)

    def failure_future(self) -> Any:
        """A ``concurrent.futures.Future`` whose result is the executor's failure (an
        :class:`mpx.ExecutorFailed`, such as WorkerDiedError), set by a failure callback:
        once the surviving workers were stopped, in the monitor thread that found the
        failure (at once if that already happened). The same future for every caller; it
        cannot be cancelled; it never completes if the executor shuts down without
        failing. For threads: ``ex.failure_future().result()`` or a done callback."""
        self._check_owner()
        return aio.failure_future(self)

    async def wait_for_failure(self) -> ExecutorFailed:
        """Return the executor's failure once it fails (see :meth:`failure_future`), never
        blocking the event loop; cancel the waiting task to stop waiting (an executor shut
        down without failing never fails)."""
        self._check_owner()
        return await aio.wait_for_failure(self)

    def dump_stacks(self, timeout: float = 5.0) -> dict[int, str]:
        """Every worker's current stacks (all threads, faulthandler format) by rank, taken
        on demand even while workers are busy or stuck in C code. A worker that cannot
        dump within ``timeout`` seconds gets a line saying why (stopped, dead...)."""
        self._check_owner()
        group = self._group
        deadline = time.monotonic() + timeout
        out = dumps.dump_all({r: (p.pid, group.stalls.dump_file(r))
                                 for r, p in enumerate(group.procs)}, timeout, describe_stall)
        if group.leader is not None:
            out.update(group.leader.stacks(max(0.0, deadline - time.monotonic())))
        return out

    def pending_calls(self) -> PendingCalls:
        """``(in_flight, queued)``: calls sent to the workers and not yet settled, and
        calls queued in the driver because the broadcast ring was full (they go out in
        order as the workers make room). For admission control: a server that sees
        ``queued`` grow is sending faster than the workers take calls."""
        self._check_owner()
        return self._group.calls.pending_calls()

    def stats(self) -> Stats:
        """A snapshot of the executor (:class:`mpx.Stats`): calls by method and outcome,
        calls in flight and queued, bytes sent and received, and per rank its pid, whether
        it lives, its replies and their latency over a recent window, and the skew between
        a call's first and last reply. Cheap (no call to the workers); also after shutdown
        (the last figures, every rank not alive)."""
        self._check_owner()
        return stats.snapshot(self._group)

    def register_restart_callback(self, callback: Callable[[int], None]) -> None:
        """Run ``callback(rank)`` each time a rank restarted in place
        (``Config.max_restarts``) is ready: its new process answers calls, and the calls
        held meanwhile went out. It runs in the ``mpx-restarter`` thread (for a rank that a
        resize restarted, in the resize's thread), outside every mpx lock; what it raises
        is logged. A user re-forms the workers' process groups from there with a collective
        call that passes :attr:`distributed_init_method` (the ranks that stayed still hold
        the old one), made with ``non_block=True``: the next restart starts only once the
        callback returns (deaths are reported meanwhile; see docs/restart.md)."""
        self._check_owner()
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        self._group.add_restart_callback(callback)

    def resize(self, world_size: int, timeout: float = 30.0) -> None:
        """Grow or shrink a single-node group to ``world_size`` ranks, between calls.

        Growing starts ranks ``old..world_size-1`` (their ``ctx.world_size`` is the new
        size, their ``distributed_init_method`` a fresh one); shrinking stops the highest
        ranks (they leave their RPC loop as at shutdown). The ranks that stay keep their
        processes and state. Calls made while it runs wait in the driver and go to the
        resized group; calls in flight finish first: if they do not within ``timeout``
        seconds, :class:`mpx.ResizeError`, and the executor is as it was. The same size is a
        no-op; a bad value is a ValueError and changes nothing; a new rank whose
        ``__init__`` raises gives WorkerStartupError, the executor as it was. Afterwards
        each call returns one result per rank of the new size; re-form a
        ``torch.distributed`` group with a collective call that passes
        :attr:`distributed_init_method` and the new size (see docs/restart.md).

        From any thread: the new workers live as long as this process. In the main thread
        Ctrl-C is held back until the resize is undone or over. A size over a limit (a
        ring's reader limit, the host's process limit) is a ValueError naming it, before
        anything is allocated."""
        self._check_owner()
        group = self._group
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if timeout is None or timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        if self.config.nnodes > 1:
            raise ResizeError("resize() serves single-node executors only "
                              f"(this one has {self.config.nnodes} nodes)")
        group.calls.check_usable()
        if world_size == group.world_size:
            return
        preflight.check_size(world_size, world_size, max(0, world_size - group.world_size))
        group.resize(world_size, timeout)

    @property
    def distributed_init_method(self) -> str:
        """The ``tcp://host:port`` the workers' ``torch.distributed`` group forms on now: the
        one the ranks got at start, and a fresh one after each restart or resize (the
        restarted or new ranks' ``ctx.distributed_init_method``)."""
        self._check_owner()
        return self._group.dist_method

    @property
    def world_size(self) -> int:
        """How many ranks the group has now (``resize`` changes it)."""
        self._check_owner()
        return self._group.world_size

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` once when the executor fails, after the surviving workers
        were stopped (``Config.stop_on_failure``); at once if that already happened. It
        runs in the mpx monitor thread that found the failure (or, at once, in the caller's),
        outside every mpx lock."""
        self._check_owner()
        self._group.add_failure_callback(callback)

    @property
    def is_failed(self) -> bool:
        """True once a worker died; every call then raises the failure."""
        self._check_owner()
        return self._group.calls.failure is not None

    @property
    def worker_pids(self) -> _Pids:
        """Every worker's pid in rank order (those of follower nodes as they reported): a
        list, also callable (``ex.worker_pids()`` returns the same list), so that both the
        attribute and vLLM-style method spellings work."""
        self._check_owner()
        return _Pids(self._group.pids)

    def _check_owner(self) -> None:
        """NotOwnerError unless this is the process that created the executor (every
        public entry point checks: a forked child's copy reaches workers it does not own)."""
        if self._pid != _this_pid:
            raise NotOwnerError.of("this executor", self._pid, _this_pid)

    def shutdown(self) -> None:
        """Stop the workers (stop message, then SIGTERM, then SIGKILL after the grace
        periods), join every thread mpx started and close every queue. Idempotent; never
        raises because of a call's state; a Ctrl-C during it propagates once every worker
        was ended."""
        self._check_owner()
        self._finalizer()

    def __enter__(self) -> Executor:
        self._check_owner()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
