"""Re-forming a running group: a rank restarted in place after its process died
(``Config.max_restarts``), and the group resized between calls (``Executor.resize``).

Who runs what::

    mpx-process-monitor   restart(): the thread that found the death, once per death
    the caller            resize()
    (one at a time)       WorkerGroup.regroup_lock

Both run with the call table paused (``CallTable.pause``): the thread re-forming the group
holds the baton, so nobody else reads replies, and every call made meanwhile is queued in
the driver, to go out in order on the new broadcast queue once it ends (a blocking caller
waits for its call as usual, within its timeout). No user code runs while it is paused:
the restart callbacks run after ``resume``, in the monitor thread, outside every lock.

The steps (``_reform``), each undone if a later one fails before the old queue is told:

1. a new broadcast queue for the new set of ranks;
2. the new processes (the restarted rank, or the ranks the group grows by) start on it,
   and their ready handshake returns their response queues; a failure here leaves the
   group as it was (resize), or fails it with the startup error (restart);
3. the old broadcast queue tells the ranks that stay where the next calls come from
   (``wire.regroup``; a rank not below the new size leaves, as at stop), after the dead
   rank's unread slots were released, and is closed;
4. the call table takes the new queues (``CallTable.regrouped``), and waits until every
   rank attached to the new broadcast queue: the ranks that stay do so when they read the
   message, after the calls before it (so a restart waits for the survivors' calls in
   progress), and its segment's name is unlinked then;
5. the ranks that left are reaped, and the monitor watches the new processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mpx import wire
from mpx._procinfo import reserve_tcp_port
from mpx.errors import (
    ExecutorFailed,
    PeerDiedError,
    QueueTimeout,
    ResizeError,
    WorkerDiedError,
    WorkerRestartError,
    WorkerStartupError,
)
from mpx.queue import MessageQueue
from mpx.wire import WorkerContext

if TYPE_CHECKING:
    from mpx._driver.group import WorkerGroup

logger = logging.getLogger("mpx")

# How long a regroup waits for the thread reading replies to let go of the baton (its
# wait is nudged at once: it lets go within one read).
PAUSE_TIMEOUT_S = 5.0
# While a resize waits for the calls in flight to finish, it looks this often.
IN_FLIGHT_POLL_S = 0.002
# While a regroup waits for the ranks to attach to the new queue, it looks this often
# whether one of those it waits for died.
ATTACH_POLL_S = 0.05
# While the old queue is full for the message that moves the ranks, and no reply came that
# would make a rank take it, the regroup waits this long before it looks again.
FULL_POLL_S = 0.001


def restart(group: WorkerGroup, rank: int, incarnation: int) -> None:
    """(the monitor thread) ``rank``'s process number ``incarnation`` died and the rank has
    restarts left: fail the calls it did not answer with its WorkerDiedError, start it
    again in place, and run the restart callbacks. Fails the group if that cannot be done.
    The calls made once the death is counted (``stats()``) wait for the restart."""
    calls = group.calls
    with group.regroup_lock:
        if rank >= group.world_size or group.incarnation[rank] != incarnation:
            return  # a resize that ran meanwhile restarted it already, or it left the group
        paused = calls.pause(PAUSE_TIMEOUT_S)
        group.found_dead(rank)
        died = group.died_error(rank)
        if not paused:
            group.fail(died)  # (a no-op when the table failed or closed meanwhile)
            return
        try:
            _lose(group, rank, died)
            restarted = [rank, *_reform(group, group.world_size, [rank], dead=[rank])]
        except BaseException as e:
            err = e if isinstance(e, ExecutorFailed) else ExecutorFailed(
                f"worker rank {rank} could not be restarted: {e!r}")
            if isinstance(e, WorkerStartupError) and not isinstance(e, WorkerRestartError):
                err = WorkerRestartError(f"restarting worker rank {rank} failed: {e}", e.ranks,
                                         e.remote_traceback, pid=e.pid, exitcode=e.exitcode)
            failed = calls.fail(err)
            calls.resume()
            if failed:
                group.after_failure(err)
            if not isinstance(e, Exception):
                raise
            return
        calls.resume()
    for r in restarted:
        group.run_restart_callbacks(r)


def _lose(group: WorkerGroup, rank: int, died: WorkerDiedError) -> None:
    """(paused) ``rank``'s process died and it will be started again: what it wrote is
    read, the calls it did not answer fail with ``died``."""
    group.calls.drain_rank(rank)
    group.calls.fail_unanswered(rank, died)
    _count_restart(group, rank, died)


def _count_restart(group: WorkerGroup, rank: int, why: BaseException) -> None:
    """``rank`` is started once more: one restart used, and what is reported of its
    process so far is stale."""
    group.incarnation[rank] += 1
    group.restarts[rank] += 1
    logger.warning("restarting worker rank %d (restart %d of %d): %s", rank,
                   group.restarts[rank], group.config.max_restarts, why)


def resize(group: WorkerGroup, world_size: int, timeout: float) -> None:
    """(the caller) Grow or shrink the group to ``world_size`` ranks once the calls in
    flight are done (ResizeError if they are not within ``timeout`` seconds; the calls made
    meanwhile wait, and go to the new group)."""
    calls = group.calls
    deadline = time.monotonic() + timeout
    if not group.regroup_lock.acquire(timeout=max(0.0, timeout)):
        raise ResizeError(f"resize({world_size}): a restart or another resize was still "
                          f"under way after {timeout:g} s")
    try:
        calls.check_usable()
        calls.hold_sending()
        try:
            while calls.in_flight():
                if time.monotonic() >= deadline:
                    raise ResizeError(f"resize({world_size}): {calls.in_flight()} calls were "
                                      f"still in flight after {timeout:g} s; the executor "
                                      "is as it was")
                time.sleep(IN_FLIGHT_POLL_S)
            if not calls.pause(max(0.001, deadline - time.monotonic())):
                calls.check_usable()
                raise ResizeError(f"resize({world_size}): the replies' reader did not let go "
                                  f"within {timeout:g} s; the executor is as it was")
        except BaseException:
            calls.release_sending()
            raise
        queue = group.broadcast
        try:
            old = group.world_size
            restarted = _reform(group, world_size, list(range(old, world_size)),
                                leaving=list(range(world_size, old)))
        except BaseException as e:
            if group.broadcast is queue:  # (failed before the ranks were told: as it was)
                calls.resume()
                raise
            err = ExecutorFailed(f"resize({world_size}) failed part way: {e!r}")
            failed = calls.fail(err)
            calls.resume()
            if failed:
                group.after_failure(err)
            raise
        calls.resume()
    finally:
        group.regroup_lock.release()
    for rank in restarted:  # (ranks that died while it ran, started again in it)
        group.run_restart_callbacks(rank)


def _reform(group: WorkerGroup, n: int, starting: list[int], dead: Sequence[int] = (),
            leaving: Sequence[int] = ()) -> list[int]:
    """(paused) Re-form the group as ``n`` ranks: ``starting`` get new processes, ``dead``
    ranks' unread slots are released first, ``leaving`` ranks go (see the module
    docstring). Returns the ranks that stayed but died meanwhile, and were restarted too."""
    cfg, workers, calls = group.config, group.workers, group.calls
    assert workers is not None and group.broadcast is not None
    deadline = time.monotonic() + cfg.startup_timeout_s
    new = MessageQueue(n, n, connect_ip=cfg.host, config=cfg)
    try:
        _fresh_init_method(group)
        opened = _start(group, new, starting, n, deadline)
    except BaseException:
        new.close()
        raise
    # the point of no return: the ranks that stay are told where to go
    for rank in leaving:
        group.monitor_unwatch(rank)
    staying = [r for r in range(min(n, len(group.resp))) if r not in starting]
    old, group.broadcast = group.broadcast, new
    _tell(old, wire.regroup(calls.first_unsent(), new.export_handle(), n),
          {*dead, *workers.exited(0.0, staying)}, deadline, lambda: calls.read_paused(dead))
    _use(group, new, [opened.get(r) or group.resp[r] for r in range(n)])
    group.resized(n)
    if leaving:
        workers.retire(list(leaving))
    if group.closing.is_set():  # (shut down meanwhile: its queues may be closed already)
        _close_all(group)
    return _await_attached(group, new, n, deadline)


def _close_all(group: WorkerGroup) -> None:
    for q in [group.broadcast, *group.resp]:
        if q is not None:
            q.close()


def _start(group: WorkerGroup, new: MessageQueue, ranks: list[int], n: int,
           deadline: float) -> dict[int, MessageQueue]:
    """Start the processes of ``ranks`` on the broadcast queue ``new`` of a group of ``n``,
    and attach to their response queues once they are ready; ``{rank: that queue}``. On a
    failure (WorkerStartupError naming the rank) what was started is ended: the ranks the
    group grew by are stopped, a restarted rank's process is left to the group's failure."""
    cfg, workers = group.config, group.workers
    assert workers is not None
    started: list[int] = []
    opened: dict[int, MessageQueue] = {}
    handle = new.export_handle()
    try:
        while True:
            with group.start_lock:
                if group.workers_stopped:
                    raise ExecutorFailed("the executor is shutting down")
                started = [workers.add(_context(group, rank, n, group.restarts[rank]
                                                if rank < len(group.restarts) else 0), handle)
                           for rank in ranks]
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
        grown = [workers.ranks[i] for i in started if workers.ranks[i] >= group.world_size]
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
    if rank >= group.world_size or not group.may_restart(rank):
        return False
    group.deaths[rank] += 1
    _count_restart(group, rank, e)
    return True


def _tell(old: MessageQueue, message: tuple, gone: set[int], deadline: float,
          read: Callable[[], int]) -> None:
    """Broadcast ``message`` (the last) on the ``old`` queue, past the unread slots of the
    ranks in ``gone`` and of any that turns out to be gone too, and close it. While the
    queue is full, ``read()`` the replies (a rank blocked on its full response queue takes
    no message)."""
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


def _use(group: WorkerGroup, new: MessageQueue, resp: list[MessageQueue]) -> None:
    """The call table sends on ``new`` and reads ``resp`` from now on; the response queues
    it no longer reads are closed."""
    replaced = [q for r, q in enumerate(group.resp) if r >= len(resp) or resp[r] is not q]
    group.calls.regrouped(new, resp)
    group.resp = resp
    for q in replaced:
        q.close()


def _await_attached(group: WorkerGroup, new: MessageQueue, n: int, deadline: float) -> list[int]:
    """Wait until every rank attached to ``new``; a rank that stayed but died before it
    could is restarted on it too (while it has restarts left: else its death fails the
    regroup). Returns those ranks."""
    workers = group.workers
    assert workers is not None
    restarted: list[int] = []
    while True:
        try:
            new.wait_until_ready(timeout=ATTACH_POLL_S, cancel=group.closing)
            return restarted
        except QueueTimeout:
            pass
        group.calls.read_paused()  # (a rank blocked writing a reply reads no message)
        missing = new.writing_end().missing_readers()
        for rank in workers.exited(0.0, missing):
            died = group.died_error(rank)
            group.found_dead(rank)
            if not group.may_restart(rank):
                raise died
            _lose(group, rank, died)
            opened = _start(group, new, [rank], n, deadline)
            _use(group, new, [opened.get(r) or group.resp[r] for r in range(n)])
            restarted.append(rank)
        if time.monotonic() >= deadline:
            raise QueueTimeout(f"ranks {missing} did not join the re-formed group within "
                               f"{group.config.startup_timeout_s:g} s (startup_timeout_s)")


def _fresh_init_method(group: WorkerGroup) -> None:
    """A new ``distributed_init_method`` for the re-formed group (a new port, held as the
    first was)."""
    if group.dist_port is not None:
        group.dist_port.close()
    group.dist_port = reserve_tcp_port("127.0.0.1")
    group.dist_method = f"tcp://127.0.0.1:{group.dist_port.getsockname()[1]}"
    if group.workers is not None:  # (a forked worker closes it, as it did the first)
        group.workers.keep_fds = (group.dist_port.fileno(),)


def _context(group: WorkerGroup, rank: int, n: int, generation: int) -> WorkerContext:
    cfg = group.config
    node_id = group.placement.node_ids[0] if group.placement is not None else ""
    return WorkerContext(rank=rank, local_rank=rank, world_size=n, local_world_size=n,
                         node_rank=0, distributed_init_method=group.dist_method, config=cfg,
                         node_id=node_id, generation=generation)
