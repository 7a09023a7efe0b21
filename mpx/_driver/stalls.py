"""Why a rank has not answered: its watchdog's report, a dump its watchdog's C thread wrote
while the worker held the GIL, or what its process looks like from outside (stopped, busy,
dead)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from mpx import dumps
from mpx._procinfo import describe_stall
from mpx.config import Config
from mpx.errors import WorkerStalledError

logger = logging.getLogger("mpx")


class StallDiagnosis:
    """The stall reports of one executor's workers, and the words for a missing reply.

    ``pids()`` gives every worker's pid by rank; ``is_local(rank)`` whether that rank runs
    on this node (its /proc and dump file can be read); ``remote(rank)`` how a rank on a
    follower node looks from here (its node's liveness, its links).
    """

    def __init__(self, config: Config, pids: Callable[[], list[int]],
                 is_local: Callable[[int], bool],
                 remote: Callable[[int], str] = lambda rank: "on a follower node") -> None:
        self.config = config
        self.pids = pids
        self.is_local = is_local
        self.remote = remote
        self.reports: dict[int, dict] = {}  # rank -> its watchdog's report of the current stall

    def report(self, rank: int, info: dict, answered_up_to: int) -> None:
        """A STALL report from ``rank``, whose replies up to ``answered_up_to`` (exclusive)
        have been read: kept until the stalled call is answered."""
        if info["seq"] < answered_up_to:
            return  # that call has been answered since
        info["since"] = time.monotonic() - info["seconds"]
        logger.warning("%s", dumps.describe(info))
        self.reports[rank] = info

    def answered(self, rank: int, seq: int) -> None:
        """``rank`` answered call ``seq``: a stall it reported up to that call is over."""
        info = self.reports.get(rank)
        if info is not None and seq >= info["seq"]:
            del self.reports[rank]

    def raise_reported(self) -> None:
        """WorkerStalledError naming every rank whose watchdog reported a stall, if any."""
        if not self.reports:
            return
        ranks = sorted(self.reports)
        stalls = {r: self.reports[r] for r in ranks}
        raise WorkerStalledError(
            f"ranks {ranks} are stalled: "
            + "; ".join(dumps.describe(i) for i in stalls.values()), ranks, stalls)

    def dump_file(self, rank: int) -> str:
        """Where local ``rank``'s watchdog writes its stack dumps."""
        return dumps.dump_path(dumps.dump_dir(self.config.dump_dir), rank,
                                  self.pids()[rank])

    def describe_missing(self, ranks: list[int], since: float) -> tuple[str, dict[int, dict]]:
        """How each of ``ranks`` (not answering a call started at monotonic ``since``) looks
        for a timeout message: stalled (its watchdog's report, or a dump its watchdog's C
        thread wrote while the worker held the GIL), stopped (SIGSTOP), dead, or busy; and
        the details of the stalled ones."""
        pids = self.pids()
        parts, stalled = [], {}
        for r in ranks:
            pid = pids[r] if r < len(pids) else None
            local = self.is_local(r)
            state = describe_stall(pid) if local else self.remote(r)
            info = self.reports.get(r)
            if info is None and local:
                info = self._dumped(r, time.time() - (time.monotonic() - since))
            if info is not None:
                stalled[r] = info
                parts.append(dumps.describe(info))
            elif local and "stopped" in state:
                stalled[r] = dict(rank=r, pid=pid, state=state)
                parts.append(f"rank {r} (pid {pid}) is stalled: {state}")
            else:
                parts.append(f"rank {r} (pid {pid}) is {state}")
        return "; ".join(parts), stalled

    def _dumped(self, rank: int, since_wall: float) -> dict[str, Any] | None:
        """The stall in the dump ``rank``'s C thread wrote after ``since_wall``, if any."""
        path = self.dump_file(rank)
        try:
            if os.stat(path).st_mtime < since_wall:
                return None
        except OSError:
            return None
        dumped = dumps.last_c_dump(dumps.read_dump(path))
        if dumped is None:
            return None
        top = dumps.top_of_dump(dumped)
        return dict(rank=rank, pid=self.pids()[rank], method=dumps.method_of_dump(top),
                    seconds=self.config.watchdog_timeout_s, stack=top, dump_file=path,
                    reported=False)
