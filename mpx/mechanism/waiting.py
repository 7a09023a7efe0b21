"""The wait policy's choices, in Python: how long a waiter polls with ``sched_yield`` before it
parks, and whether it polls at all. ``mpx._ring._RingEnd`` has the compiled policy and its
reasons in its docstring; this is the same policy for the waiters that run it as Python:
the pure-Python ring (``mpx._ring_py``) and the ZeroMQ reader (``mpx.transport.zmq``).

A waiter mixes in :class:`AdaptiveWait`, calls ``_init_waiting`` once, and for each wait:

- ``_skips_yield()``: whether this wait parks at once (the host was judged crowded);
- ``_yielded(took)`` after each ``sched_yield`` of the yield phase (``took`` ns);
- ``_judge(late)`` when a yield found what it waited for ``late`` ns after it came;
- ``_adapt(waited, found)`` when a wait that parked ends, ``waited`` ns after it began.

Nothing here waits or takes a lock: the waiter's own lock (or its single thread) covers
these fields.
"""

from __future__ import annotations

# the least a yield budget grows by when it was too short
YIELD_STEP_NS = 20_000
# what a futex wake is taken to cost until a waiter measures it (a VM's is ~46 us)
WAKE_COST_PRIOR_NS = 50_000
# how many waits that a yield ended make one window of judging the host
COST_WINDOW = 32
# how many waits in a row park at once once the host was judged crowded (the span doubles
# while it stays crowded, up to the max)
PARK_WAITS_MIN = 256
PARK_WAITS_MAX = 16_384
# the weight of the newest sample in the running means (1/COST_WEIGHT)
COST_WEIGHT = 8


class AdaptiveWait:
    """The yield budget and the crowded-host judgement of one waiter (see the module
    docstring). Fields shown for diagnosis: ``yield_budget_ns``, ``yield_cost_ns`` (one
    yield's duration, a running mean), ``wake_cost_ns``, ``parks_first``, ``park_waits``."""

    def _init_waiting(self, spin_ns: int, yield_ns: int) -> None:
        self.spin_ns, self.yield_ns = spin_ns, yield_ns
        self.yield_budget_ns = yield_ns  # (adapts in [0, yield_ns])
        self.yield_cost_ns, self.wake_cost_ns = 0, WAKE_COST_PRIOR_NS
        self.parks_first, self.park_waits, self._probing = False, PARK_WAITS_MIN, False
        self._window_n = self._window_lost_ns = self._parked_waits = 0

    def _skips_yield(self) -> bool:
        """Whether this wait parks at once: it is one of the span of waits after the host
        was judged crowded; the first after the span yields again, to judge anew."""
        if not self.parks_first:
            return False
        self._parked_waits += 1
        if self._parked_waits <= self.park_waits:
            return True
        self.parks_first, self._probing = False, True
        return False

    def _yielded(self, took: int) -> None:
        """One yield of the yield phase took ``took`` ns."""
        self.yield_cost_ns += int((took - self.yield_cost_ns) / COST_WEIGHT)  # (C's /)

    def _judge(self, late: int) -> None:
        """Count a wait that a yield ended ``late`` ns after its message came: if the
        window's waits lost more to lateness beyond a wake's than a wake each would cost,
        the next waits park at once (``parks_first``)."""
        self._window_n += 1
        if late > self.wake_cost_ns:
            self._window_lost_ns += late - self.wake_cost_ns
        crowded = self._window_lost_ns > COST_WINDOW * self.wake_cost_ns
        if not crowded and self._window_n < COST_WINDOW:
            return
        if crowded:
            if self._probing:  # (the window after parking first: the host is still crowded)
                self.park_waits = min(2 * self.park_waits, PARK_WAITS_MAX)
            self.parks_first, self._parked_waits = True, 0
        else:
            self.park_waits = PARK_WAITS_MIN
        self._probing = False
        self._window_n = self._window_lost_ns = 0

    def _adapt(self, waited: int, found: bool) -> None:
        """After a wait that parked, ``waited`` ns in all, ``found``: whether it ended with
        what it waited for. A wait longer than the whole window (yielding could not have
        found it) halves the yield budget; one that a full yield phase would have ended
        doubles it (plus YIELD_STEP_NS), up to ``yield_ns``."""
        if waited > self.spin_ns + self.yield_ns:
            self.yield_budget_ns //= 2
        elif found:
            self.yield_budget_ns = min(self.yield_ns, 2 * self.yield_budget_ns + YIELD_STEP_NS)
