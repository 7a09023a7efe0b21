# The C types of mpx/mechanism/waiting.py, which this file augments when Cython compiles it
# (plain Python never reads it), and what mpx/_ring.pyx cimports: the class its ring ends
# inherit and the steps its wait loop calls without the GIL. The values and the reasons of
# the constants are in the .py.
cimport cython
from libc.stdint cimport int64_t

cdef int64_t YIELD_STEP_NS, WAKE_COST_PRIOR_NS
cdef int COST_WINDOW, PARK_WAITS_MIN, PARK_WAITS_MAX, COST_WEIGHT


cdef class AdaptiveWait:
    cdef readonly int64_t spin_ns
    cdef readonly int64_t yield_ns         # the most its yield phase lasts (Config.yield_us)
    cdef readonly int64_t yield_budget_ns  # how long it lasts now: adapts in [0, yield_ns]
    cdef readonly int64_t yield_cost_ns    # how long one yield takes (running mean)
    cdef readonly int64_t wake_cost_ns     # from the peer's wake to this waiter running (mean)
    cdef readonly bint parks_first   # yielding costs more than a wake: it parks at once
    cdef readonly int park_waits     # how many waits parks_first lasts
    cdef readonly int _parked_waits  # while parks_first: the waits since it began
    cdef readonly bint _probing      # parks_first just ended: this window judges again
    cdef readonly int _window_n      # the waits a yield ended in this window so far
    cdef readonly int64_t _window_lost_ns  # how much later than a wake those yields found it

    cpdef void _init_waiting(self, int64_t spin_ns, int64_t yield_ns)


@cython.locals(d=int64_t)
cdef int64_t _mean_step(int64_t mean, int64_t sample) noexcept nogil

cpdef bint skips_yield(AdaptiveWait w) noexcept nogil
cpdef void yielded(AdaptiveWait w, int64_t took) noexcept nogil
cpdef void woke(AdaptiveWait w, int64_t took) noexcept nogil
@cython.locals(crowded=bint)
cpdef void judge(AdaptiveWait w, int64_t late) noexcept nogil
cpdef void adapt(AdaptiveWait w, int64_t waited, bint found) noexcept nogil
