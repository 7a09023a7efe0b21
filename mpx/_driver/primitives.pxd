# The C bodies of mpx/_driver/primitives.py's primitives, as cdef inline functions (no
# extension of their own: each compiled module of the futures core that cimports them
# compiles them in). What each does is in the .py, which the plain build imports instead.

from libc.math cimport frexp as c_frexp
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from mpx._driver.locks cimport CLock


cdef extern from "pythread.h":
    # (as CPython 3.7+ declares it; Cython's cpython.pythread has the ident as a long)
    unsigned long PyThread_get_thread_ident()


cdef inline double now() noexcept:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline unsigned long this_thread() noexcept:
    return PyThread_get_thread_ident()


cdef inline (double, int) frexp(double x) noexcept:
    cdef int e = 0
    cdef double m = c_frexp(x, &e)
    return m, e


cdef inline CLock new_lock():
    return CLock.__new__(CLock)  # (tp_new, no call of the type)


cdef inline bint lock_enter(CLock lock) except -1:
    return lock._wait(-1.0)


cdef inline void lock_exit(CLock lock) noexcept:
    lock._release()


cdef inline bint lock_try(CLock lock) except -1:
    return lock._try()


cdef inline bint lock_within(CLock lock, double timeout) except -1:
    return lock._wait(now() + timeout)


cdef inline int compiled_only(what) except -1:
    return 0
