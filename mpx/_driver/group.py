"""What one executor owns, and how it ends.

``WorkerGroup`` starts the worker processes (and admits the follower nodes), owns the
queues, the call table and the monitor threads, turns a worker's death into the failure of
the group (the replies already written are read first, then the survivors are stopped, then
the failure callbacks run) or, while that rank has restarts left, into its restart in place
(mpx/_driver/regroup.py, which resizes the group too), and shuts everything down. Its
``shutdown`` is what the executor's finalizer runs, so nothing here refers back to the
``Executor``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mpx import dumps
from mpx._driver import lockorder, preflight, regroup, stats, stats_server
from mpx._driver.calls import CallTable
from mpx._driver.membership import Membership
from mpx._driver.monitors import NodeMonitor, ProcessMonitor
from mpx._driver.stalls import StallDiagnosis
from mpx._driver.stats_server import StatsServer
from mpx._node.leader import Leader
from mpx._node.local_workers import EXIT_WAIT_S, LocalWorkers
from mpx._node.relay import relayed_node
from mpx._procinfo import describe_exit
from mpx.config import Config
from mpx.errors import ExecutorFailed, NodeLostError, PeerDiedError, WorkerDiedError
from mpx.protocol import wire
from mpx.protocol.wire import WorkerContext
from mpx.queue import MessageQueue

logger = logging.getLogger("mpx")

# How long shutdown and a failure wait to hand the workers the stop message: a worker that
# died can leave the broadcast ring full, and the stop sequence goes on to signals anyway.
STOP_MESSAGE_TIMEOUT_S = 0.5


def _run_callback(cb: Callable[[], None]) -> None:
    try:
        cb()
    except BaseException:  # (SystemExit, KeyboardInterrupt too: the monitor thread goes on)
        logger.exception("a failure callback raised")


class WorkerGroup:
    """The worker processes, queues and threads of one executor (see the module docstring)."""

    def __init__(self, config: Config, world_size: int) -> None:
        self.config = config
        self.creator_pid = os.getpid()
        # who is in the group: its processes, queues, counters; restart and resize change it
        self.members = Membership(world_size)
        self.placement: Any = None  # a RayPlacement with launcher="ray"
        self.stalls = StallDiagnosis(config, lambda: self.pids, self.is_local,
                                     self._remote_state)
        self.calls = CallTable(world_size, self.stalls, self._peer_gone)
        self.process_monitor: ProcessMonitor | None = None
        self.node_monitor: NodeMonitor | None = None
        self.lock = lockorder.lock("WorkerGroup.lock", lockorder.LEAF)
        self.callbacks: list[Callable[[], None]] = []
        self.callbacks_ran = False
        self._stop_lock = lockorder.lock("WorkerGroup's stop lock", lockorder.STOP)
        self.closed = False
        self.stats_server: StatsServer | None = None  # Config.stats_socket's
        # the callbacks of Executor.register_restart_callback, and the thread that restarts
        # dead ranks and runs them (mpx/_driver/regroup.py)
        self.restart_callbacks: list[Callable[[int], None]] = []
        self.restarter = regroup.Restarter(self)
        self.closing = threading.Event()  # set first thing at shutdown: ends a regroup's waits

    # ------------------------------------------------------------------ start

    def start(self, cls_bytes: bytes, kw_bytes: bytes) -> None:
        """Start every worker (and admit the follower nodes), wait until all are ready and
        attached, then start the monitors. Raises WorkerStartupError naming the rank."""
        cfg, world, members = self.config, self.world_size, self.members
        local = world // cfg.nnodes
        deadline = time.monotonic() + cfg.startup_timeout_s
        if cfg.launcher == "ray":
            from mpx._node.ray_launcher import RayPlacement
            self.placement = RayPlacement(cfg, local, deadline)
            cfg = self.config = self.placement.config
        preflight.check(cfg, local)
        if cfg.stats_socket:  # bound before anything starts (a failure: shutdown closes it)
            self.stats_server = StatsServer(cfg.stats_socket, self._stats_json)
        # remote readers: one relay per follower node, or every remote rank directly
        remote = cfg.nnodes - 1 if cfg.relays(local) else world - local
        broadcast = MessageQueue(local + remote, local, local_reader_ranks=list(range(local)),
                                 connect_ip=cfg.host, config=cfg)
        members.set_broadcast(broadcast)
        dist = members.reserve_init_method(cfg.master_addr if cfg.nnodes > 1 else "127.0.0.1")
        node_id = self.placement.node_ids[0] if self.placement is not None else ""
        ctxs = [WorkerContext(rank=rank, local_rank=rank, world_size=world,
                              local_world_size=local, node_rank=0,
                              distributed_init_method=dist, config=cfg, node_id=node_id)
                for rank in range(local)]
        dumps.reap_empty_dumps(dumps.dump_dir(cfg.dump_dir))
        leader = None
        if cfg.nnodes > 1:  # (its control socket bound before any worker starts)
            leader = Leader(cfg, world)
            leader.heard_again = self._reconnect_node
            members.led(leader)
        workers = LocalWorkers(cfg, ctxs, broadcast.export_handle(), cls_bytes, kw_bytes,
                               keep_fds=(members.dist_port_fd(),))
        members.started(workers)
        if leader is not None:
            if self.placement is not None:
                leader.startup_check = self.placement.check
                leader.gone_check = self.placement.gone
                self.placement.start_followers()
            leader.admit(wire.NodeSpec(node_rank=0, config=cfg, world_size=world,
                                       distributed_init_method=dist,
                                       handle=broadcast.export_handle(),
                                       worker_cls=cls_bytes, worker_kwargs=kw_bytes),
                         deadline)
        handles = workers.handshake(deadline)
        if leader is not None:
            handles.update(leader.collect(deadline))
        with workers.startup_deaths():  # a worker that died: its error, not the attach's
            resp: list[MessageQueue] = []
            members.attached(resp)  # (filled as attached: a failure closes what was)
            for r in range(world):
                resp.append(MessageQueue.create_from_handle(handles[r], 0, config=cfg))
            broadcast.wait_until_ready(timeout=max(1.0, deadline - time.monotonic()))
        self.calls.attach(broadcast, resp)
        if self.stats_server is not None:
            self.stats_server.serve()
        self.process_monitor = ProcessMonitor(workers.procs, members.incarnations(), self._died,
                                              self._node_failed)
        self.process_monitor.start()
        if leader is not None:
            self.node_monitor = NodeMonitor(leader, self._node_failed)
            self.node_monitor.start()

    # ------------------------------------------------------------------ who is where
    # (read-only: the membership's, mpx/_driver/membership.py)

    @property
    def world_size(self) -> int:
        return self.members.world_size

    @property
    def workers(self) -> LocalWorkers | None:
        return self.members.workers

    @property
    def leader(self) -> Leader | None:
        return self.members.leader

    @property
    def broadcast(self) -> MessageQueue | None:
        return self.members.broadcast

    @property
    def resp(self) -> list[MessageQueue]:
        return self.members.resp

    @property
    def dist_method(self) -> str:
        """The workers' distributed_init_method now."""
        return self.members.dist_method

    @property
    def procs(self) -> list[Any]:
        """This node's worker processes, by rank."""
        return self.members.procs

    @property
    def pids(self) -> list[int]:
        """Every worker's pid by rank (those of follower nodes as they reported)."""
        return self.members.pids

    def is_local(self, rank: int) -> bool:
        """Whether ``rank`` runs on this node (else on a follower node)."""
        return self.members.is_local(rank)

    def _reconnect_node(self, node: int) -> None:
        """(the node monitor) Follower ``node`` was silent and is heard again: its replies'
        links are taken up again now, and the calls' writer lets its readers there back in
        at once (mpx/_node/liveness.py)."""
        assert self.leader is not None
        broadcast = self.members.broadcast
        if broadcast is not None:
            broadcast.reconnect_links()
        ends = self.calls.pump.ends
        for rank in self.leader.node_ranks(node):
            if rank < len(ends):  # (attached)
                ends[rank].reconnect_now()

    def _remote_state(self, rank: int) -> str:
        """How remote ``rank`` looks from here, for a timeout's message: its reply link's
        trouble if it has any, else when its node was last heard."""
        leader = self.leader
        assert leader is not None
        node = leader.node_of(rank)
        ends = self.calls.pump.ends
        trouble = ends[rank].link_state() if rank < len(ends) else ""
        if trouble:
            return f"on node {node}, {trouble}"
        heard = leader.heard_ago(node)
        if heard is None:
            return f"on node {node}"
        if heard > self.config.heartbeat_s / 2:  # (two probes missed)
            return (f"on node {node}, silent for {heard:.1f} s: its link may be cut (the "
                    f"node is lost past link_grace_s, {self.config.link_grace:g} s)")
        return (f"on node {node}, alive (heard {heard:.1f} s ago) and its links whole, but "
                "still busy with the call or an earlier one")

    def alive(self) -> list[bool]:
        """Per rank, whether its worker runs (never waits)."""
        return self.members.alive()

    def died_error(self, rank: int) -> WorkerDiedError:
        """The error that says how ``rank`` died (exit code or signal when local: this waits
        up to EXIT_WAIT_S for a worker that closed its queue to exit, and reaps it)."""
        if not self.is_local(rank):  # on a follower node, which reports how it died
            pid = self.leader.pids.get(rank) if self.leader is not None else None
            return WorkerDiedError(f"worker rank {rank} (pid {pid}) on a follower node is gone",
                                   rank=rank, pid=pid)
        assert self.workers is not None
        pid = self.procs[rank].pid
        code = self.workers.exit_of(rank)
        how = f"died: {describe_exit(code)}" if code is not None else \
            f"closed its queue but is still running {EXIT_WAIT_S:g} s later"
        return WorkerDiedError(f"worker rank {rank} (pid {pid}) {how}", rank=rank, pid=pid,
                               exitcode=code)

    # ------------------------------------------------------------------ failure

    def _died(self, rank: int, incarnation: int) -> None:
        """(the monitor thread) ``rank``'s process number ``incarnation`` died. If it has
        restarts left: the calls it will never answer fail now (``CallTable.lose``: their
        futures complete at once), new calls wait, and the restarter thread starts it
        again in place; else the group fails. Never waits for a restart or a resize under
        way (it holds no lock they hold)."""
        if not self.members.is_current(rank, incarnation):
            return  # said of a process that was replaced already, or left the group
        self._restart_or_fail(rank, incarnation, lambda: self.died_error(rank))

    def _node_failed(self, err: ExecutorFailed) -> None:
        """(the node monitor) A follower reported that a worker died (restarted, as a
        local one is, while it has restarts left), or a node was lost."""
        if type(err) is WorkerDiedError and err.rank is not None:
            self._restart_or_fail(err.rank, self.members.incarnation(err.rank), lambda: err)
        elif isinstance(err, NodeLostError) and self.restarter.node_due(err.node_rank):
            pass  # (the same loss, found another way: the node's restart is under way)
        elif isinstance(err, NodeLostError) and self._node_may_restart(err.node_rank):
            for rank in err.ranks:
                self.members.found_dead(rank)
            self.restarter.request_node(err.node_rank, err)
        else:
            self.fail(err)

    def _node_may_restart(self, node: int) -> bool:
        """Whether lost follower ``node`` may be joined again, as a restart of its ranks
        (each has one left)."""
        leader = self.leader
        return leader is not None and self.calls.failure is None and not self.calls.closed \
            and all(self.may_restart(r) for r in leader.node_ranks(node))

    def _restart_or_fail(self, rank: int, incarnation: int,
                         died: Callable[[], WorkerDiedError]) -> None:
        """``rank``'s process number ``incarnation`` died (``died()``: how, which may wait
        for its exit): restart it, or fail the group."""
        members = self.members
        if self.calls.failure is None and not self.calls.closed and self.may_restart(rank):
            error = died()
            if self.calls.lose(rank, error, lambda: members.is_current(rank, incarnation),
                               members.lock):
                members.found_dead(rank)  # (counted once new calls wait: stats() shows it)
                self.restarter.request(rank, incarnation, error)
            return
        members.found_dead(rank)
        if self.calls.failure is None and not self.calls.closed:
            self.fail(died())

    def may_restart(self, rank: int) -> bool:
        """Whether ``rank`` is started again in place after its death (Config.max_restarts;
        a rank on a follower node too: mpx/_driver/regroup.py)."""
        return self.members.may_restart(rank, self.config.max_restarts)

    def _peer_gone(self, rank: int, error: PeerDiedError) -> ExecutorFailed | None:
        """A queue's end found its peer gone: ``rank`` is the worker whose reply queue's
        writer is gone (``error.role`` "writer"), or the broadcast's reader that is
        (``error.role`` "reader": a local rank's, a remote rank's, or a follower's relay).
        The monitor thread fails the group; a remote peer's loss is its node's
        (NodeLostError, returned)."""
        monitor = self.process_monitor
        if monitor is None:
            return None
        local = self.world_size // self.config.nnodes
        if rank < local:  # (died_error waits for its exit: not in this thread)
            monitor.report_death(rank, self.members.read_incarnation(rank))
            return None
        relayed = error.role == "reader" and self.config.relays(local)
        assert self.leader is not None
        node = relayed_node(local, rank) if relayed else self.leader.node_of(rank)
        lost = self.leader.lost_error(node, f"its link to the driver failed: {error}")
        for r in lost.ranks:
            self.members.found_dead(r)
        monitor.report(lost)
        return lost

    def fail(self, err: ExecutorFailed) -> None:
        """The group failed (a monitor thread calls this): settle the calls, stop the
        surviving workers unless ``Config.stop_on_failure`` is off, run the callbacks."""
        if self.calls.fail(err):  # (else failed already, or shutting down)
            self.after_failure(err)

    def after_failure(self, err: ExecutorFailed) -> None:
        """The call table failed with ``err``: stop the surviving workers unless
        ``Config.stop_on_failure`` is off, and run the failure callbacks."""
        logger.error("executor failed: %s", err)
        if self.config.stop_on_failure:
            self.stop_workers()
        with self.lock:
            callbacks, self.callbacks = self.callbacks, []
            self.callbacks_ran = True
        for cb in callbacks:
            _run_callback(cb)

    def add_failure_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` once when the group fails (at once if its callbacks ran)."""
        with self.lock:
            if not self.callbacks_ran:
                self.callbacks.append(callback)
                return
        _run_callback(callback)

    # ------------------------------------------------------------------ re-forming

    @property
    def start_lock(self) -> threading.Lock:
        """Held to start worker processes after startup: stop_workers holds it too, so
        none starts once the workers are being stopped (``workers_stopped``)."""
        return self._stop_lock

    @property
    def workers_stopped(self) -> bool:
        return self.members.workers_stopped

    def monitor_watch(self, rank: int, proc: Any) -> None:
        """Watch ``proc`` as ``rank``'s current process (its membership's number)."""
        if self.process_monitor is not None:
            self.process_monitor.watch(rank, proc, self.members.incarnation(rank))

    def monitor_unwatch(self, rank: int) -> None:
        if self.process_monitor is not None:
            self.process_monitor.unwatch(rank)

    def add_restart_callback(self, callback: Callable[[int], None]) -> None:
        with self.lock:
            self.restart_callbacks.append(callback)

    def run_restart_callbacks(self, rank: int) -> None:
        """``cb(rank)`` for each restart callback (the restarter thread, or a resize's
        caller for a rank it restarted; no lock held)."""
        with self.lock:
            callbacks = list(self.restart_callbacks)
        for cb in callbacks:
            try:
                cb(rank)
            except BaseException:  # (SystemExit too: the death watch must go on)
                logger.exception("a restart callback raised")

    def resize(self, n: int, timeout: float) -> None:
        """Grow or shrink to ``n`` ranks (mpx/_driver/regroup.py)."""
        regroup.resize(self, n, timeout)

    # ------------------------------------------------------------------ ending

    def stop_workers(self) -> None:
        """The stop message, then (LocalWorkers.stop) the grace, SIGTERM and SIGKILL for
        this node's workers; the follower nodes are told to stop theirs. Once only."""
        with self._stop_lock:
            if self.members.workers_stopped:
                return
            self.members.stopped()
            try:
                if self.broadcast is not None:
                    try:
                        self.broadcast.enqueue(wire.stop(self.calls.next_seq),
                                        timeout=STOP_MESSAGE_TIMEOUT_S)
                    except Exception as e:
                        logger.debug("no stop message for the workers (%s)", e)
            finally:
                try:
                    if self.node_monitor is not None:
                        self.node_monitor.release_followers()
                finally:
                    if self.workers is not None:
                        self.workers.stop()

    def shutdown(self) -> None:
        """Fail the pending calls, stop every worker, join every thread mpx started and
        close every queue. Idempotent, and a no-op in any process but the creator. Each
        step runs whatever the one before raised; an interrupt (Ctrl-C) propagates only
        after every worker was ended."""
        with self.lock:
            if self.closed or os.getpid() != self.creator_pid:
                return
            self.closed = True
        self.closing.set()
        steps = [self.calls.close, self._stop_stats_server, self.stop_workers,
                 self._stop_monitors, self.restarter.close, self._close_queues,
                 self._release_placement]
        raised: BaseException | None = None
        for step in steps:
            try:
                step()
            except BaseException as e:
                if raised is None:
                    raised = e
                if isinstance(e, Exception):
                    logger.exception("shutdown step %s failed", step.__name__)
        if raised is not None and not isinstance(raised, Exception):
            raise raised

    def _stats_json(self) -> dict:
        return stats_server.to_json(stats.snapshot(self), self.is_local, os.getpid())

    def _stop_stats_server(self) -> None:
        if self.stats_server is not None:
            self.stats_server.stop()

    def _stop_monitors(self) -> None:
        if self.process_monitor is not None:
            self.process_monitor.stop()
        if self.node_monitor is not None:
            self.node_monitor.stop()
        elif self.leader is not None:
            self.leader.stop()  # startup failed before its monitor began

    def _release_placement(self) -> None:
        """launcher="ray": let the follower actors return (their nodes were told to stop),
        kill them, remove the placement group."""
        if self.placement is not None:
            from mpx._node.ray_launcher import close_wait_s
            self.placement.close(close_wait_s(self.config))

    def _close_queues(self) -> None:
        self.members.release_port()
        for q in self.resp:
            q.close()
        if self.broadcast is not None:
            self.broadcast.close()
