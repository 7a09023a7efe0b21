# cython: language_level=3, boundscheck=False, wraparound=False, annotation_typing=False, binding=False
"""What a call table measures as its calls go (``Meter``): bytes sent, each rank's reply
latency, the skew between a call's first and last reply, each method's outcomes and
durations, kept in ``Histogram``s of log-spaced buckets. mpx/_driver/stats.py and the
Prometheus collector (mpx/metrics.py) read it.

One source, two builds (Cython's pure-Python mode): setup.py compiles this file, with the C
types of mpx/_driver/meter.pxd, into the extension ``mpx._driver.meter``; without a
compiler, and under MPX_PURE_PYTHON=1, it runs as plain Python (mpx/_impl.py chooses).
"""

from __future__ import annotations

import array
from typing import Any

try:
    import cython
except ImportError:  # Cython is a build dependency only: plain Python needs cython.compiled
    from mpx.mechanism import _cython_shim as cython  # type: ignore[no-redef]

if cython.compiled:
    from cython.cimports.mpx._driver.primitives import frexp, now
else:
    from mpx._driver.primitives import frexp, now

IMPLEMENTATION = "cython" if cython.compiled else "python"

# The meter's latency buckets (seconds): four per octave from 2**-20 s (~0.95 us) to 2**8 s;
# bucket i counts the values at most BOUNDS[i], the last one (N_BUCKETS - 1) the rest. Every
# fourth bound is a power of two, which the Prometheus collector exports.
BOUNDS = tuple(2.0 ** (k / 4) for k in range(-80, 33))
N_BUCKETS = len(BOUNDS) + 1
_BOUNDS_AT = array.array("d", BOUNDS + (float("inf"),))
# (Histogram.observe) a mantissa in [0.5, 1) above _Qn lies above the octave's (n + 1)th
# bound, counting 2**(e-1) as its first
_Q1, _Q2, _Q3 = 2.0 ** -0.75, 2.0 ** -0.5, 2.0 ** -0.25


class Histogram:
    """Counts of values by the meter's latency buckets (``BOUNDS``): ``buckets``, an
    ``array('q')`` of N_BUCKETS counts, with their ``count``, ``sum`` and ``max``. Changed by
    one thread at a time (the meter's rules); read by any."""

    __slots__ = ("buckets", "_counts", "_bounds", "count", "sum", "max")

    def __init__(self) -> None:
        self.buckets = array.array("q", bytes(8 * N_BUCKETS))
        self._counts = self.buckets  # (compiled: a C view of it, as _bounds of the bounds)
        self._bounds = _BOUNDS_AT
        self.count = 0
        self.sum = 0.0
        self.max = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` (seconds) in its bucket: the first bound >= value, found from its
        binary exponent."""
        bounds = self._bounds
        if not value > bounds[0]:  # (NaN too, as bisect puts it)
            lo = 0
        else:  # value = m * 2**e, 0.5 <= m < 1: the octave's bounds are 2**(e-1)..2**e
            m, e = frexp(value)
            lo = 4 * e + 76 + (m > 0.5) + (m > _Q1) + (m > _Q2) + (m > _Q3)
            if lo > N_BUCKETS - 1:
                lo = N_BUCKETS - 1
            while value <= bounds[lo - 1]:  # (the rounding of 2.0 ** (k / 4))
                lo -= 1
            while value > bounds[lo]:
                lo += 1
        self._counts[lo] += 1
        self.count += 1
        self.sum += value
        if value > self.max:
            self.max = value

    def add(self, other: Histogram) -> None:
        """Count ``other``'s values too."""
        for i in range(N_BUCKETS):
            self._counts[i] += other._counts[i]
        self.count += other.count
        self.sum += other.sum
        if other.max > self.max:
            self.max = other.max

    def clear(self) -> None:
        """Forget every value."""
        for i in range(N_BUCKETS):
            self._counts[i] = 0
        self.count = 0
        self.sum = 0.0
        self.max = 0.0


class MethodMeter:
    """One method's calls, by outcome, and the time from each call made to its last reply
    (``durations``: the calls every rank answered)."""

    __slots__ = ("ok", "error", "timeout", "durations")

    def __init__(self) -> None:
        self.ok = 0
        self.error = 0
        self.timeout = 0
        self.durations = Histogram()


class Meter:
    """What one call table measures, as its calls go: bytes sent; per rank the time from a
    call made to that rank's reply read (``recent``, the current window of ``window_s``
    seconds; ``previous``, the one before; ``earlier``, every window before those: since the
    start is the three together); the skew between a call's first and last reply (with
    two ranks or more), kept the same three ways; per method its outcomes and durations
    (``methods``). The thread holding the baton records replies (``Call.add``,
    mpx/_driver/ledger.py); the ledger records outcomes holding its lock. Readers take
    numbers without a lock: a snapshot may miss the reply being recorded at that instant.
    ``timeout_type``: the error class whose calls count as timed out (the others that
    failed count as errors)."""

    __slots__ = ("n_ranks", "window_s", "timeout_type", "bytes_sent", "recent", "previous",
                 "earlier", "skew_recent", "skew_previous", "skew_earlier", "methods",
                 "window_start")

    def __init__(self, n_ranks: int, timeout_type: type, window_s: float = 60.0) -> None:
        self.n_ranks = n_ranks
        self.window_s = window_s
        self.timeout_type = timeout_type
        self.bytes_sent = 0
        self.recent: list[Histogram] = [Histogram() for _ in range(n_ranks)]
        self.previous: list[Histogram] = [Histogram() for _ in range(n_ranks)]
        self.earlier: list[Histogram] = [Histogram() for _ in range(n_ranks)]
        self.skew_recent = Histogram()
        self.skew_previous = Histogram()
        self.skew_earlier = Histogram()
        self.methods: dict[str, MethodMeter] = {}
        self.window_start = now()

    def resize(self, n_ranks: int) -> None:
        """The group was resized to ``n_ranks``: the ranks that left take their
        histograms with them, the new ones start empty."""
        for hs in (self.recent, self.previous, self.earlier):
            del hs[n_ranks:]
            hs.extend([Histogram() for _ in range(n_ranks - len(hs))])
        self.n_ranks = n_ranks

    def sent(self, parts: tuple) -> None:
        """Count the bytes of a call's encoded ``parts``."""
        n = 0
        for part in parts:
            n += len(part) if type(part) is bytes else memoryview(part).nbytes
        self.bytes_sent += n

    def reply(self, rank: int, started: float, first_reply: float, last: bool) -> float:
        """``rank``'s reply to a call made at ``started`` (monotonic) was read now: when, as
        the call records it. ``first_reply``: when the call's first reply was read (0.0:
        this is it); ``last``: this is its last."""
        at = now()
        if at - self.window_start >= self.window_s:
            self._next_window(at)
        h = self.recent[rank]
        h.observe(at - started)
        if last and self.n_ranks > 1:
            self.skew_recent.observe(at - first_reply if first_reply != 0.0 else 0.0)
        return at

    def _next_window(self, at: float) -> None:
        for r in range(self.n_ranks):
            self.earlier[r].add(self.previous[r])
        self.skew_earlier.add(self.skew_previous)
        self.recent, self.previous = self.previous, self.recent
        for h in self.recent:
            h.clear()
        self.skew_recent, self.skew_previous = self.skew_previous, self.skew_recent
        self.skew_recent.clear()
        self.window_start = at

    def settled(self, method: str, error: Any, started: float, last_reply: float) -> None:
        """(the ledger's lock held) A call of ``method``, made at ``started``, ended, with
        ``error`` or None; ``last_reply``: when its last reply was read (0.0: not every
        rank answered)."""
        m = self.methods.get(method)
        if m is None:
            m = self.methods[method] = MethodMeter()
        if error is None:
            m.ok += 1
        elif isinstance(error, self.timeout_type):
            m.timeout += 1
        else:
            m.error += 1
        if last_reply != 0.0:
            m.durations.observe(last_reply - started)
