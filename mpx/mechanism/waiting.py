# cython: language_level=3, cdivision=True, annotation_typing=False
"""The adaptive wait policy, written once: how long a waiter polls with ``sched_yield``
before it parks, and whether it polls at all. ``setup.py`` compiles this file with Cython
(its C types are in ``mpx/mechanism/waiting.pxd``, which augments it); where no compiler is,
or under ``MPX_PURE_PYTHON=1`` (see ``mpx/_impl.py``), the same file runs as plain Python.
Its waiters inherit :class:`AdaptiveWait`: the compiled ring (``mpx._ring._RingEnd``, which
cimports it and calls the policy's steps at C level, without the GIL, from its wait loop),
the pure-Python ring (``mpx._ring_py``) and the ZeroMQ reader (``mpx.transport.zmq_reader``).

A wait spins for ``spin_ns``, calls ``sched_yield`` for the yield budget, then parks (a
futex, or a blocking receive) until the peer wakes it. A waiter calls ``_init_waiting``
once, and for each wait:

- ``_skips_yield()``: whether this wait parks at once (the host was judged crowded);
- ``_yielded(took)`` after each ``sched_yield`` of the yield phase (``took`` ns);
- ``_judge(late)`` when a yield found what it waited for ``late`` ns after it came;
- ``_woke(took)`` when a park that the peer woke ran ``took`` ns after the wake;
- ``_adapt(waited, found)`` when a wait that parked ends, ``waited`` ns after it began.

The yield budget adapts to what yielding buys the waiter (``adapt``): it starts at
``yield_ns``; a wait that outlasts ``spin_ns + yield_ns`` (yielding could not have found it:
a step longer than the window, a host too busy to answer soon) halves it, so that a waiter
whose waits are long parks at once instead of taking a core from the process that would
answer; a wait that parked but a full yield phase would have ended doubles it (plus
YIELD_STEP_NS), back to ``yield_ns``.

Whether to spin and yield at all adapts to the host (``judge``). A yield returns at once
when nothing else wants the core, and after another task's whole time slice (ms) when the
host is crowded: a waiter that is still runnable then sees its message up to a slice late,
while a parked one is woken, and scheduled, at once. So a waiter measures both:
``wake_cost_ns``, from the peer's wake to the waiter running after a park, a running mean
(WAKE_COST_PRIOR_NS until measured), and, when a yield finds a message, how late that is
(the ring's reader: after the writer published, which the writer stamps; the ZeroMQ reader,
with no stamp to compare with across machines: the yield's whole length). A yield that
returns late because the core ran the peer's own work on the message is not late. When the
waits that a yield ended lose more to lateness beyond a wake's, within COST_WINDOW of them,
than a wake each would cost (one time slice late is enough), the waiter ``parks_first``:
its next ``park_waits`` waits skip the spin and the yield phase; then it yields again for a
window, which tells whether the host is still crowded: if it is, ``park_waits`` doubles
(PARK_WAITS_MIN to PARK_WAITS_MAX), so that a host that stays crowded pays for knowing ever
more rarely; a window without that resets it. On a quiet host a yield finds a message
within microseconds, against tens for a wake on a VM, and nothing changes.
``yield_cost_ns`` (one yield's duration, a running mean) is shown for diagnosis.

The steps are functions of the waiter (``judge(w, late)``), which the class has as its
methods too (``w._judge(late)``): Cython lets a method of a class that can be subclassed be
called from Python or without the GIL, not both, and a function can be both. Their
arithmetic is C's (int64, division rounding toward zero) in both builds, so that the two
builds step the same on the same inputs. Nothing here waits or takes a lock: the waiter's
own lock (or its single thread) covers these fields.
"""

from __future__ import annotations

# the least a yield budget grows by when it was too short (from 0: 20, 60, 140... us)
YIELD_STEP_NS = 20_000
# what a park's wake is taken to cost until one is measured: a futex wake on a VM (~46 us)
WAKE_COST_PRIOR_NS = 50_000
# whether yielding pays is judged over this many waits that a yield ended: it does not once
# they lost more to late yields than parking would cost them (a wake each)
COST_WINDOW = 32
# a waiter that found yielding does not pay parks at once for this many waits, twice as many
# each time the next window finds the same (at most PARK_WAITS_MAX), then yields again for a
# window
PARK_WAITS_MIN = 256
PARK_WAITS_MAX = 16_384
# the costs' running means move by 1/COST_WEIGHT of each sample
COST_WEIGHT = 8


def constants() -> dict[str, int]:
    """The policy's constants by name (compiled, they are C variables, which Python cannot
    read as the module's attributes)."""
    return {"YIELD_STEP_NS": YIELD_STEP_NS, "WAKE_COST_PRIOR_NS": WAKE_COST_PRIOR_NS,
            "COST_WINDOW": COST_WINDOW, "PARK_WAITS_MIN": PARK_WAITS_MIN,
            "PARK_WAITS_MAX": PARK_WAITS_MAX, "COST_WEIGHT": COST_WEIGHT}


def _mean_step(mean: int, sample: int) -> int:
    """The running mean ``mean`` moved by 1/COST_WEIGHT of the way to ``sample``, rounded
    toward zero as C's division rounds (Python's ``//`` rounds down: negated, it rounds up)."""
    d = sample - mean
    return mean + (d // COST_WEIGHT if d >= 0 else -(-d // COST_WEIGHT))


def skips_yield(w: AdaptiveWait) -> bool:
    """Whether this wait of ``w`` parks at once: it is one of the span of waits after the
    host was judged crowded; the first after the span yields again, to judge anew."""
    if not w.parks_first:
        return False
    w._parked_waits += 1
    if w._parked_waits <= w.park_waits:
        return True
    w.parks_first = False
    w._probing = True
    return False


def yielded(w: AdaptiveWait, took: int) -> None:
    """One yield of ``w``'s yield phase took ``took`` ns."""
    w.yield_cost_ns = _mean_step(w.yield_cost_ns, took)


def woke(w: AdaptiveWait, took: int) -> None:
    """A park of ``w`` that the peer woke ran again ``took`` ns after the wake."""
    w.wake_cost_ns = _mean_step(w.wake_cost_ns, took)


def judge(w: AdaptiveWait, late: int) -> None:
    """Count a wait of ``w`` that a yield ended ``late`` ns after its message came: if the
    window's waits lost more to lateness beyond a wake's than a wake each would cost, the
    next waits park at once (``parks_first``)."""
    w._window_n += 1
    if late > w.wake_cost_ns:
        w._window_lost_ns += late - w.wake_cost_ns
    crowded = w._window_lost_ns > COST_WINDOW * w.wake_cost_ns
    if not crowded and w._window_n < COST_WINDOW:
        return
    if crowded:
        if w._probing:  # (the window after parking first: the host is still crowded)
            w.park_waits = min(2 * w.park_waits, PARK_WAITS_MAX)
        w.parks_first = True
        w._parked_waits = 0
    else:
        w.park_waits = PARK_WAITS_MIN
    w._probing = False
    w._window_n = 0
    w._window_lost_ns = 0


def adapt(w: AdaptiveWait, waited: int, found: bool) -> None:
    """After a wait of ``w`` that parked, ``waited`` ns in all, ``found``: whether it ended
    with what it waited for: set the yield budget by what a full yield phase would have
    bought (see the module docstring)."""
    if waited > w.spin_ns + w.yield_ns:
        w.yield_budget_ns //= 2  # (never negative: C's division rounds it as Python's)
    elif found:
        w.yield_budget_ns = min(w.yield_ns, 2 * w.yield_budget_ns + YIELD_STEP_NS)


class AdaptiveWait:
    """The yield budget and the crowded-host judgement of one waiter (see the module
    docstring). Fields shown for diagnosis: ``spin_ns``, ``yield_ns``, ``yield_budget_ns``,
    ``yield_cost_ns`` (one yield's duration, a running mean), ``wake_cost_ns``,
    ``parks_first``, ``park_waits``; the judgement's window: ``_window_n``,
    ``_window_lost_ns``, ``_probing``, ``_parked_waits``. Compiled, they are read-only to
    Python: only the steps change them."""

    spin_ns: int
    yield_ns: int
    yield_budget_ns: int
    yield_cost_ns: int
    wake_cost_ns: int
    parks_first: bool
    park_waits: int
    _parked_waits: int
    _probing: bool
    _window_n: int
    _window_lost_ns: int

    def _init_waiting(self, spin_ns: int, yield_ns: int) -> None:
        """Start the policy afresh: spin ``spin_ns``, yield at most ``yield_ns`` (where the
        budget starts), judged quiet."""
        self.spin_ns = spin_ns
        self.yield_ns = yield_ns
        self.yield_budget_ns = yield_ns
        self.yield_cost_ns = 0
        self.wake_cost_ns = WAKE_COST_PRIOR_NS
        self.parks_first = False
        self.park_waits = PARK_WAITS_MIN
        self._parked_waits = 0
        self._probing = False
        self._window_n = 0
        self._window_lost_ns = 0

    _skips_yield = skips_yield
    _yielded = yielded
    _woke = woke
    _judge = judge
    _adapt = adapt
