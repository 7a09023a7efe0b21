"""The driver's locks, the order in which they may nest, and a check of that order.

Each lock the driver's Python code takes is made here, with its rank. A thread may take a
lock only while every lock it holds has a lower rank (taking one it holds again, a
re-entrant lock's own, is allowed); so no two threads can wait for each other's locks.
Outermost first:

====  ============================  ========================================================
rank  lock                          guards
====  ============================  ========================================================
10    Membership.regroup_lock       one restart or resize at a time, for the whole of it
20    WorkerGroup's stop lock       starting workers vs. stopping them (start_lock)
30    Membership.lock               the membership's fields; its one-step swap; snapshots
35    Sender.numbering              a call that needs the pickler, from its number to its
                                    registration (senders only; its pickling, user code,
                                    runs under it: see mpx/_driver/sender.py)
40    CallTable.order               registering, sending and queuing calls; the outbox
50    CallTable.turn_lock           the waiters' Condition (a call done, the baton free)
60    CallRegistry.completing       taking a batch of settled calls and queuing callbacks
70    CallbackThread's lock         the done callbacks handed to mpx-callbacks
80    WorkerGroup.lock              the failure and restart callbacks lists (a leaf)
80    Restarter's lock              the deaths handed to mpx-restarter (a leaf)
80    ProcessMonitor's watch lock   the processes the death watch watches (a leaf)
80    aio.Once's lock               making the shutdown or failure future once (a leaf)
====  ============================  ========================================================

Innermost of all, taken with none of the above waited for inside it: the call ledger's lock
(``Ledger.lock``, compiled; held for dict and counter updates only), the futures' own locks
(mpx/_driver/futures.py, future_core.py) and each transport end's own lock. The baton
(mpx/_driver/locks.py) is never waited for while one of these locks is held, and no
user code runs under any of them.

With ``MPX_CHECK_LOCKS=1`` in the environment when mpx is imported, the locks are made as
``CheckedLock``s, which raise :class:`LockOrderError` (and record it in ``violations``) on
an acquire that could block out of order; the stateful stress test runs so
(tests/membership/test_membership_stress.py). Otherwise they are plain ``threading`` locks.
"""

from __future__ import annotations

import os
import threading
from typing import Any

REGROUP = 10
STOP = 20
MEMBERSHIP = 30
NUMBERING = 35
ORDER = 40
TURN = 50
COMPLETING = 60
CALLBACKS = 70
LEAF = 80

CHECK = os.environ.get("MPX_CHECK_LOCKS", "") not in ("", "0")

# Every out-of-order acquire seen (CHECK only), as text: a thread of mpx's may swallow the
# exception, so the stress test reads this too.
violations: list[str] = []


class LockOrderError(RuntimeError):
    """A lock was taken while the thread held one of the same or a higher rank."""


_held = threading.local()


def _stack() -> list[CheckedLock]:
    stack = getattr(_held, "stack", None)
    if stack is None:
        stack = _held.stack = []
    return stack


class CheckedLock:
    """A lock (or re-entrant lock) named ``name`` of rank ``rank`` that checks, on every
    acquire that may block, that the calling thread holds only locks of lower ranks."""

    def __init__(self, name: str, rank: int, reentrant: bool = False) -> None:
        self.name, self.rank = name, rank
        self._lock: Any = threading.RLock() if reentrant else threading.Lock()
        self._reentrant = reentrant

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        stack = _stack()
        again = self._reentrant and self in stack
        if blocking and not again:
            worst = max(stack, key=lambda lk: lk.rank, default=None)
            if worst is not None and worst.rank >= self.rank:
                text = (f"{self.name} (rank {self.rank}) taken while holding {worst.name} "
                        f"(rank {worst.rank}) in thread {threading.current_thread().name}")
                violations.append(text)
                raise LockOrderError(text)
        got = self._lock.acquire(blocking, timeout)
        if got:
            stack.append(self)
        return got

    def release(self) -> None:
        self._lock.release()
        stack = _stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self:
                del stack[i]
                break

    def locked(self) -> bool:
        return self._lock.locked() if not self._reentrant else bool(self in _stack())

    __enter__ = acquire

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock(name: str, rank: int) -> Any:
    """A lock of ``rank`` (see the table above): checked under MPX_CHECK_LOCKS."""
    return CheckedLock(name, rank) if CHECK else threading.Lock()


def rlock(name: str, rank: int) -> Any:
    """A re-entrant lock of ``rank``: checked under MPX_CHECK_LOCKS."""
    return CheckedLock(name, rank, reentrant=True) if CHECK else threading.RLock()
