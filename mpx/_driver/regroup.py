"""Re-forming a running group: a rank restarted in place after its process died
(``Config.max_restarts``), and the group resized between calls (``Executor.resize``); the
operations of the group's membership (mpx/_driver/membership.py), which they change
through its methods alone.

Who runs what::

    mpx-process-monitor   finds the death; fails the calls the dead rank will never answer
                          at once (CallTable.lose) and hands the restart on; never waits
    mpx-restarter         restart(), once per death, in the order found; then the restart
                          callbacks (user code), outside every lock
    the caller            resize(); the restart callbacks of ranks it restarted
    (one at a time)       Membership.regroup_lock

Both run with the call table paused (``CallTable.pause``): the thread re-forming the group
holds the baton, so nobody else reads replies, and every call made meanwhile is queued in
the driver, to go out in order on the new broadcast queue once it ends (a blocking caller
waits for its call as usual, within its timeout). No user code runs while it is paused.
A resize in the main thread holds Ctrl-C back (mpx/_driver/interrupts.py): it is raised
where the resize is cleanly undone (waiting for the lock or the calls in flight), else once
the resize is over.

The steps (``_reform``), each undone if a later one fails before the old queue is told:

1. a new broadcast queue for the new set of ranks;
2. the new processes (the restarted rank, or the ranks the group grows by) start on it,
   and their ready handshake returns their response queues; a failure here leaves the
   group as it was (resize), or fails it with the startup error (restart); a restarted
   rank's new process that dies before it is ready is started once more (its reader
   place on the new ring given back), while the rank has restarts left;
3. the old broadcast queue tells the ranks that stay where the next calls come from
   (``wire.regroup``; a rank not below the new size leaves, as at stop), after the dead
   ranks' readers were released (they hold the writer up no more), and is closed;
4. the membership swaps in one step (``Membership.swap``: the call table's queues and
   sizes, the per-rank counters), then waits until every rank attached to the new
   broadcast queue: the ranks that stay do so when they read the message, after the calls
   before it (so a restart waits for the survivors' calls in progress), and its segment's
   name is unlinked then;
5. the ranks that left are reaped, and the monitor watches the new processes.

The group can end while a regroup runs: ``shutdown`` from another thread, or its failure
(a rank that stays died with no restart left), which stops every worker. Whatever a step
then meets (a rank "exited with code 0", a closed queue or pipe) is what mpx did on
purpose, never the account given: the regroup fails with what ended the group
(``_cut_short``), the error the calls get.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mpx import _debug
from mpx._driver import lockorder
from mpx._driver.interrupts import Deferred
from mpx._node.relay import relay_reader
from mpx.errors import (
    ExecutorFailed,
    NodeLostError,
    PeerDiedError,
    QueueTimeout,
    ResizeError,
    WorkerDiedError,
    WorkerRestartError,
    WorkerStartupError,
)
from mpx.protocol import wire
from mpx.protocol.wire import WorkerContext
from mpx.queue import MessageQueue

if TYPE_CHECKING:
    from mpx._driver.group import WorkerGroup

logger = logging.getLogger("mpx")

# How long a regroup waits for the thread reading replies to let go of the baton (its
# wait is nudged at once: it lets go within one read).
PAUSE_TIMEOUT_S = 5.0
# While a resize waits for the calls in flight to finish, it looks this often.
IN_FLIGHT_POLL_S = 0.002
# While a resize waits for a restart under way to end, it looks this often for Ctrl-C.
LOCK_POLL_S = 0.05
# While a regroup waits for the ranks to attach to the new queue, it looks this often
# whether one of those it waits for died.
ATTACH_POLL_S = 0.05
# While the old queue is full for the message that moves the ranks, and no reply came that
# would make a rank take it, the regroup waits this long before it looks again.
FULL_POLL_S = 0.001
# How long shutdown waits for the restarter thread to end (a restart under way ends as
# soon as the workers are stopped: its waits watch them).
RESTARTER_JOIN_S = 10.0


class Restarter:
    """The thread (``mpx-restarter``, started on the first death) that restarts dead ranks
    in place, one at a time in the order their deaths were found, and then runs the
    restart callbacks, outside every lock. The death watch hands it each death
    (``request``) and goes on watching: a restart, however long, never delays the report
    of another death."""

    def __init__(self, group: WorkerGroup) -> None:
        self._group = group
        # (rank, incarnation, died): a rank; (None, node, lost): a node's ranks, its
        # follower gone (at most one such for a node, due or under way: _nodes)
        self._due: collections.deque[tuple[int | None, int, ExecutorFailed]] = \
            collections.deque()
        self._nodes: set[int] = set()
        # (entered itself, not the Condition: see pump.py)
        self._lock = lockorder.lock("Restarter's lock", lockorder.LEAF)
        self._cv = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._running = False  # (a restart popped from _due and not yet done)

    def request(self, rank: int, incarnation: int, died: WorkerDiedError) -> None:
        """Restart ``rank``, whose process number ``incarnation`` died with ``died``."""
        self._ask((rank, incarnation, died))

    def request_node(self, node: int, lost: NodeLostError) -> None:
        """Restart the ranks of follower ``node``, lost with ``lost``, once a new follower
        joins for it (unless that is asked for already, or under way)."""
        with self._lock:
            if node in self._nodes:
                return
            self._nodes.add(node)
        self._ask((None, node, lost))

    def node_due(self, node: int) -> bool:
        """Whether a restart of follower ``node``'s ranks is asked for, or under way."""
        with self._lock:
            return node in self._nodes

    def _ask(self, due: tuple[int | None, int, ExecutorFailed]) -> None:
        with self._lock:
            if self._closed:
                return
            self._due.append(due)
            if self._thread is None:
                self._thread = threading.Thread(target=_debug.counted_thread(self._run),
                                                name="mpx-restarter", daemon=True)
                self._thread.start()
            self._cv.notify()

    def due(self) -> bool:
        """Whether a restart was asked for and has not begun."""
        with self._lock:
            return bool(self._due)

    def busy(self) -> bool:
        """Whether a restart was asked for and is not done."""
        with self._lock:
            return bool(self._due) or self._running

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._due and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                rank, incarnation, died = self._due.popleft()
                self._running = True
            try:
                if rank is None:
                    assert isinstance(died, NodeLostError)
                    try:
                        restarted = restart_node(self._group, incarnation, died)
                    finally:
                        with self._lock:
                            self._nodes.discard(incarnation)
                else:
                    assert isinstance(died, WorkerDiedError)
                    restarted = restart(self._group, rank, incarnation, died)
            except BaseException:  # (logged: the next death must still be restarted)
                logger.exception("restarting worker rank %d failed", rank)
                continue
            finally:
                with self._lock:
                    self._running = False
            for r in restarted:
                self._group.run_restart_callbacks(r)

    def close(self) -> None:
        """Drop the restarts not begun and end the thread (shutdown)."""
        with self._lock:
            self._closed = True
            self._due.clear()
            self._nodes.clear()
            thread = self._thread
            self._cv.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(RESTARTER_JOIN_S)


def restart(group: WorkerGroup, rank: int, incarnation: int, died: WorkerDiedError) -> list[int]:
    """(the restarter thread) ``rank``'s process number ``incarnation`` died with ``died``
    and the rank has restarts left: fail the calls it did not answer, start it again in
    place. Fails the group if that cannot be done. The ranks restarted (this one, and any
    that died meanwhile), for their callbacks."""
    calls, members = group.calls, group.members
    with members.regroup_lock:
        if not members.is_current(rank, incarnation):
            # a resize that ran meanwhile restarted it already, or it left the group: the
            # calls held since the death go out (unless another restart is due)
            if not group.restarter.due():
                calls.unpause()
            return []
        paused = calls.pause(PAUSE_TIMEOUT_S)
        if not paused:
            group.fail(died)  # (a no-op when the table failed or closed meanwhile)
            return []
        try:
            _lose(group, rank, died)
            if group.is_local(rank):
                restarted = [rank, *_reform(group, members.world_size, [rank], dead=[rank])]
            else:
                restarted = [rank, *_restart_remote(group, rank)]
        except BaseException as e:
            _restart_failed(group, e, f"worker rank {rank}")
            return []
        calls.resume()
    return restarted


def _restart_failed(group: WorkerGroup, e: BaseException, what: str) -> None:
    """(paused) Restarting ``what`` met ``e``: the group fails with it (a WorkerRestartError
    if a process did not start), unless the group ended meanwhile (then ``e`` is only a
    symptom, logged); the calls go on. ``e`` is raised again unless it is an Exception."""
    calls = group.calls
    err = e if isinstance(e, ExecutorFailed) else ExecutorFailed(
        f"{what} could not be restarted: {e!r}")
    if isinstance(e, WorkerStartupError) and not isinstance(e, WorkerRestartError):
        err = WorkerRestartError(f"restarting {what} failed: {e}", e.ranks,
                                 e.remote_traceback, pid=e.pid, exitcode=e.exitcode)
    cut = _cut_short(group, f"restarting {what}")
    if cut is not None:  # (what it met is a symptom: the group ended meanwhile)
        logger.info("%s", cut)
    failed = cut is None and calls.fail(err)
    calls.resume()
    if failed:
        group.after_failure(err)
    if not isinstance(e, Exception):
        raise e


def restart_node(group: WorkerGroup, node: int, lost: NodeLostError) -> list[int]:
    """(the restarter thread) Follower ``node`` was lost with ``lost`` and every one of its
    ranks has a restart left: their calls fail, and once a new follower joins for the node
    (``python -m mpx node`` again, within startup_timeout_s) its ranks serve again. Fails
    the group if that cannot be done. The ranks restarted."""
    calls, members = group.calls, group.members
    leader, broadcast = members.leader, members.broadcast
    assert leader is not None and broadcast is not None
    ranks = leader.node_ranks(node)
    with members.regroup_lock:
        if not calls.pause(PAUSE_TIMEOUT_S):
            group.fail(lost)
            return []
        try:
            for rank in ranks:
                _lose(group, rank, WorkerDiedError(f"worker rank {rank} was lost with its node: "
                                                   f"{lost}", rank=rank,
                                                   pid=leader.pids.get(rank)))
            cfg = group.config
            deadline = time.monotonic() + cfg.startup_timeout_s
            local = members.world_size // cfg.nnodes
            # the new follower's readers of the calls: its relay, or each of its ranks
            for reader in [relay_reader(local, node)] if cfg.relays(local) else ranks:
                broadcast.admit_remote_reader(reader)
            ready = leader.await_rejoin(node, deadline)
            _take_in_remote(group, {r: handle for r, (handle, _) in ready.items()}, deadline)
        except BaseException as e:
            _restart_failed(group, e, f"node {node} (ranks {ranks})")
            return []
        calls.resume()
    return ranks


def _lose(group: WorkerGroup, rank: int, died: WorkerDiedError) -> None:
    """(paused) ``rank``'s process died and it will be started again: what it wrote is
    read, the calls it did not answer fail with ``died`` (those sent since the death was
    found too) and their futures complete now, and one of its restarts is used."""
    group.calls.drain_rank(rank)
    group.calls.fail_unanswered(rank, died)
    group.calls.registry.complete_futures()
    _count_restart(group, rank, died)


def _restart_remote(group: WorkerGroup, rank: int) -> list[int]:
    """(paused) Start remote ``rank`` again on its follower node: the new process reads the
    broadcast queue directly (as its global rank, also where its node relays: a relay's
    ring takes no new reader, and its dead one was released), the queue waits for it to
    connect, and its new response queue takes the old one's place. The calls held since
    the death go out once it is back. No other rank is restarted by it (none returned)."""
    cfg, members = group.config, group.members
    leader, broadcast = members.leader, members.broadcast
    assert leader is not None and broadcast is not None
    deadline = time.monotonic() + cfg.startup_timeout_s
    broadcast.admit_remote_reader(rank)
    handle, _ = leader.restart_rank(rank, deadline)
    _take_in_remote(group, {rank: handle}, deadline)
    return []


def _take_in_remote(group: WorkerGroup, handles: dict[int, Any], deadline: float) -> None:
    """(paused) Remote ranks started again (``{rank: its response queue's handle}``): once
    the broadcast queue has every reader it admitted (by ``deadline``), their response
    queues take the old ones' place."""
    members, cfg = group.members, group.config
    assert members.broadcast is not None
    opened: dict[int, MessageQueue] = {}
    try:
        for rank, handle in handles.items():
            opened[rank] = MessageQueue.create_from_handle(handle, 0, config=cfg)
        members.broadcast.wait_until_ready(timeout=max(0.001, deadline - time.monotonic()))
    except BaseException:
        for q in opened.values():
            q.close()
        raise
    _swap(group, [opened.get(r) or members.resp[r] for r in range(members.world_size)])


def _count_restart(group: WorkerGroup, rank: int, why: BaseException) -> None:
    n = group.members.count_restart(rank)
    logger.warning("restarting worker rank %d (restart %d of %d): %s", rank, n,
                   group.config.max_restarts, why)


def resize(group: WorkerGroup, world_size: int, timeout: float) -> None:
    """(the caller) Grow or shrink the group to ``world_size`` ranks once the calls in
    flight are done (ResizeError if they are not within ``timeout`` seconds; the calls made
    meanwhile wait, and go to the new group). A restart asked for while it waits for them
    runs first (_RestartFirst)."""
    members = group.members
    deadline = time.monotonic() + timeout
    with Deferred() as interrupt:
        while True:
            while not members.regroup_lock.acquire(timeout=LOCK_POLL_S):
                interrupt.raise_if_interrupted()
                if time.monotonic() >= deadline:
                    raise ResizeError(f"resize({world_size}): a restart or another resize "
                                      f"was still under way after {timeout:g} s")
            try:
                restarted = _resize_locked(group, world_size, deadline, timeout, interrupt)
                break
            except _RestartFirst:
                pass
            finally:
                members.regroup_lock.release()
            # a rank died while calls were in flight: its restart fails the calls it did
            # not answer (under the lock), and then the resize waits for the rest again
            while group.restarter.busy():
                interrupt.raise_if_interrupted()
                if time.monotonic() >= deadline:
                    raise ResizeError(f"resize({world_size}): a restart was still under way "
                                      f"after {timeout:g} s; the executor is as it was")
                time.sleep(IN_FLIGHT_POLL_S)
    for rank in restarted:  # (ranks that died while it ran, started again in it)
        group.run_restart_callbacks(rank)


class _RestartFirst(Exception):
    """(resize) A restart is due or under way while the calls in flight are waited for:
    they may wait for it (it fails those the dead rank did not answer), and it waits for
    the lock the resize holds. The resize lets go of the lock until it is done."""


def _resize_locked(group: WorkerGroup, world_size: int, deadline: float, timeout: float,
                   interrupt: Deferred) -> list[int]:
    """resize(), ``regroup_lock`` held; Ctrl-C is raised only while nothing is changed."""
    calls, members = group.calls, group.members
    calls.check_usable()
    calls.hold_sending()
    try:
        while calls.in_flight():
            interrupt.raise_if_interrupted()
            calls.read_available(0)  # (a restart may be due: nobody else reads meanwhile)
            if group.restarter.busy():
                raise _RestartFirst()
            if time.monotonic() >= deadline:
                raise ResizeError(f"resize({world_size}): {calls.in_flight()} calls were "
                                  f"still in flight after {timeout:g} s; the executor "
                                  "is as it was")
            time.sleep(IN_FLIGHT_POLL_S)
        interrupt.raise_if_interrupted()
        if not calls.pause(max(0.001, deadline - time.monotonic())):
            calls.check_usable()
            raise ResizeError(f"resize({world_size}): the replies' reader did not let go "
                              f"within {timeout:g} s; the executor is as it was")
    except BaseException:
        calls.release_sending()
        raise
    queue = members.broadcast
    what = f"resize({world_size})"
    try:
        old = members.world_size
        restarted = _reform(group, world_size, list(range(old, world_size)),
                            leaving=list(range(world_size, old)))
    except BaseException as e:
        cut = _cut_short(group, what)
        if cut is None and members.broadcast is queue:  # (before the ranks were told: as it was)
            calls.resume()
            raise
        err: ExecutorFailed | None = None
        if cut is None:  # the ranks were told: the group cannot go back, and fails
            err = e if isinstance(e, ExecutorFailed) else ExecutorFailed(
                f"the group did not re-form: {e}")
            if not calls.fail(err):
                err = None
            cut = _cut_short(group, what)
        calls.resume()
        if err is not None:
            group.after_failure(err)
        if not isinstance(e, Exception) or cut is None:
            raise
        raise cut from cut.__cause__
    calls.resume()
    return restarted


def _cut_short(group: WorkerGroup, what: str) -> ExecutorFailed | None:
    """If the group ended while ``what`` (a resize, a restart) ran, the error that says
    how: its failure (the death that failed it, named with its exit status), or its
    shutdown; the error is what the calls get, with the failure as its cause. None while
    the group runs."""
    failure = group.calls.failure
    if failure is not None:
        again = "" if group.config.max_restarts else \
            " (with Config.max_restarts a dead rank is started again in place instead)"
        err = ExecutorFailed(f"{what} failed: {failure}. The executor has failed: shut it "
                             f"down and create a new one{again}")
        err.__cause__ = failure
        return err
    if group.closing.is_set() or group.calls.closed:
        return ExecutorFailed(f"{what} did not finish: the executor was shut down while it "
                              "ran (shutdown() in another thread, or at exit); create a new "
                              "executor to go on")
    return None


def _reform(group: WorkerGroup, n: int, starting: list[int], dead: Sequence[int] = (),
            leaving: Sequence[int] = ()) -> list[int]:
    """(paused) Re-form the group as ``n`` ranks: ``starting`` get new processes, ``dead``
    ranks' readers are released first, ``leaving`` ranks go (see the module docstring).
    Returns the ranks that stayed but died meanwhile, and were restarted too."""
    cfg, members, calls = group.config, group.members, group.calls
    workers = members.workers
    assert workers is not None and members.broadcast is not None
    deadline = time.monotonic() + cfg.startup_timeout_s
    new = MessageQueue(n, n, connect_ip=cfg.host, config=cfg, keep_name=True)  # (_start)
    try:
        members.reserve_init_method("127.0.0.1")
        opened = _start(group, new, starting, n, deadline)
    except BaseException:
        new.close()
        raise
    # the point of no return: the ranks that stay are told where to go
    for rank in leaving:
        group.monitor_unwatch(rank)
    staying = [r for r in range(min(n, len(members.resp))) if r not in starting]
    old = members.set_broadcast(new)
    assert old is not None
    _tell(old, wire.regroup(calls.first_unsent(), new.export_handle(), n),
          {*dead, *workers.exited(0.0, staying)}, deadline, lambda: calls.read_paused(dead))
    _swap(group, [opened.get(r) or members.resp[r] for r in range(n)])
    if leaving:
        workers.retire(list(leaving))
    if group.closing.is_set():  # (shut down meanwhile: its queues may be closed already)
        _close_all(group)
    return _await_attached(group, new, n, deadline)


def _swap(group: WorkerGroup, resp: list[MessageQueue]) -> None:
    """The membership swaps to the broadcast queue set and ``resp``; the response queues
    no longer read are closed."""
    for q in group.members.swap(group.calls, resp):
        q.close()


def _close_all(group: WorkerGroup) -> None:
    for q in [group.members.broadcast, *group.members.resp]:
        if q is not None:
            q.close()


def _start(group: WorkerGroup, new: MessageQueue, ranks: list[int], n: int,
           deadline: float) -> dict[int, MessageQueue]:
    """Start the processes of ``ranks`` on the broadcast queue ``new`` of a group of ``n``,
    and attach to their response queues once they are ready; ``{rank: that queue}``. On a
    failure (WorkerStartupError naming the rank) what was started is ended: the ranks the
    group grew by are stopped, a restarted rank's process is left to the group's failure."""
    cfg, members = group.config, group.members
    workers = members.workers
    assert workers is not None
    started: list[int] = []
    opened: dict[int, MessageQueue] = {}
    handle = new.export_handle()
    try:
        while True:
            with group.start_lock:
                if group.workers_stopped:
                    raise ExecutorFailed("the executor is shutting down")
                started = [workers.add(_context(group, rank, n), handle) for rank in ranks]
                for rank in ranks:
                    if rank >= members.world_size:  # (a rank the group grows by)
                        members.joining(rank)
            try:
                handles = workers.handshake(deadline, started)
                break
            except WorkerStartupError as e:
                if not _died_restarting(group, ranks, e):
                    raise
                new.writing_end().reopen_reader(ranks[0])  # (its dead process may have attached)
        with workers.startup_deaths(ranks):
            for rank in ranks:
                opened[rank] = MessageQueue.create_from_handle(handles[rank], 0, config=cfg)
        for i in started:
            group.monitor_watch(workers.ranks[i], workers.procs[i])
    except BaseException:
        for q in opened.values():
            q.close()
        grown = [workers.ranks[i] for i in started if workers.ranks[i] >= members.world_size]
        if grown:
            workers.retire(grown, grace_s=0.0)
        raise
    return opened


def _died_restarting(group: WorkerGroup, ranks: list[int], e: WorkerStartupError) -> bool:
    """Whether ``e`` says that the new process of a rank being restarted died before it
    was ready (not that its ``__init__`` raised) while the rank has restarts left: that
    death counts as one, and the rank is started once more."""
    if len(ranks) != 1 or e.ranks != ranks or e.exitcode is None or e.remote_traceback:
        return False
    rank = ranks[0]
    if not group.may_restart(rank):
        return False
    group.members.count_startup_death(rank)
    _count_restart(group, rank, e)
    return True


def _tell(old: MessageQueue, message: tuple, gone: set[int], deadline: float,
          read: Callable[[], int]) -> None:
    """Broadcast ``message`` (the last) on the ``old`` queue, past the readers of the ranks
    in ``gone`` and of any that turns out to be gone too, and close it. While the queue is
    full, ``read()`` the replies (a rank blocked on its full response queue takes no
    message)."""
    out = old.writing_end()

    def while_full() -> None:
        if not read():
            time.sleep(FULL_POLL_S)

    try:
        for rank in gone:
            out.release_reader(rank)
        while True:
            try:
                old.enqueue(message, timeout=max(0.1, deadline - time.monotonic()),
                            while_full=while_full)
                return
            except PeerDiedError as e:
                if e.rank is None or e.rank in gone:
                    raise
                gone.add(e.rank)  # it died meanwhile: it reads nothing more
                out.release_reader(e.rank)
    finally:
        old.close()


def _await_attached(group: WorkerGroup, new: MessageQueue, n: int, deadline: float) -> list[int]:
    """Wait until every rank attached to ``new``; a rank that stayed but died before it
    could is restarted on it too (while it has restarts left: else its death fails the
    regroup). Returns those ranks."""
    members = group.members
    workers = members.workers
    assert workers is not None
    restarted: list[int] = []
    while True:
        try:
            new.wait_until_ready(timeout=ATTACH_POLL_S, cancel=group.closing)
            return restarted
        except QueueTimeout:
            pass
        if group.workers_stopped:  # (they exit because mpx stopped them: not deaths)
            raise ExecutorFailed("the workers were stopped while the group re-formed")
        group.calls.read_paused()  # (a rank blocked writing a reply reads no message)
        missing = new.writing_end().missing_readers()
        for rank in workers.exited(0.0, missing):
            died = group.died_error(rank)
            members.found_dead(rank)
            if not group.may_restart(rank):
                raise died
            _lose(group, rank, died)
            opened = _start(group, new, [rank], n, deadline)
            _swap(group, [opened.get(r) or members.resp[r] for r in range(n)])
            restarted.append(rank)
        if time.monotonic() >= deadline:
            raise QueueTimeout(f"ranks {missing} did not join the re-formed group within "
                               f"{group.config.startup_timeout_s:g} s (startup_timeout_s)")


def _context(group: WorkerGroup, rank: int, n: int) -> WorkerContext:
    cfg, members = group.config, group.members
    node_id = group.placement.node_ids[0] if group.placement is not None else ""
    generation = members.restarts(rank) if rank < members.world_size else 0
    return WorkerContext(rank=rank, local_rank=rank, world_size=n, local_world_size=n,
                         node_rank=0, distributed_init_method=members.dist_method, config=cfg,
                         node_id=node_id, generation=generation)
