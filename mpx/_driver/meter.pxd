# The C types of mpx/_driver/meter.py (Cython's pure-Python mode): compiled, the fields
# declared here are C fields, the methods C functions (cpdef: also callable from Python),
# the locals C variables. What each one does, the .py says; where it is not compiled, the
# .py runs as it reads, and this file plays no part.

cimport cython

cdef double _Q1, _Q2, _Q3


@cython.final
cdef class Histogram:
    cdef readonly object buckets
    cdef long long[::1] _counts
    cdef double[::1] _bounds
    cdef public Py_ssize_t count
    cdef public double sum, max

    @cython.locals(lo=Py_ssize_t, e=int, m=double)
    cpdef observe(self, double value)
    @cython.locals(i=Py_ssize_t)
    cpdef add(self, Histogram other)
    @cython.locals(i=Py_ssize_t)
    cpdef clear(self)


@cython.final
cdef class MethodMeter:
    cdef public Py_ssize_t ok, error, timeout
    cdef public Histogram durations


@cython.final
cdef class Meter:
    cdef readonly Py_ssize_t n_ranks
    cdef readonly double window_s
    cdef readonly object timeout_type
    cdef public Py_ssize_t bytes_sent
    cdef public list recent, previous, earlier
    cdef public Histogram skew_recent, skew_previous, skew_earlier
    cdef readonly dict methods
    cdef public double window_start

    cpdef resize(self, Py_ssize_t n_ranks)
    @cython.locals(n=Py_ssize_t)
    cpdef sent(self, tuple parts)
    @cython.locals(at=double, h=Histogram)
    cpdef double reply(self, Py_ssize_t rank, double started, double first_reply,
                       bint last) except? -1.0
    @cython.locals(h=Histogram, r=Py_ssize_t)
    cdef _next_window(self, double at)
    @cython.locals(m=MethodMeter)
    cpdef settled(self, method, error, double started, double last_reply)
