# The C types of mpx/_driver/ledger.py (Cython's pure-Python mode): compiled, the fields
# declared here are C fields, the functions and methods C functions (cpdef: also callable
# from Python), the locals C variables. What each one does, the .py says; where it is not
# compiled, the .py runs as it reads, and this file plays no part.

cimport cython

from mpx._driver.core_settings cimport CoreSettings
from mpx._driver.locks cimport CLock
from mpx._driver.meter cimport Meter

cdef int _MORE, _ALL_OK, _ANSWERED, _LEAVE


@cython.final
cdef class Call:
    cdef readonly object seq
    cdef readonly object method
    cdef readonly Py_ssize_t n_ranks
    cdef readonly object reply_rank
    cdef readonly object aggregator
    cdef readonly object deadline
    cdef readonly CoreSettings settings
    cdef readonly double started
    cdef public double first_reply, last_reply
    cdef public Meter meter
    cdef public object future
    cdef readonly dict results
    cdef readonly dict errors
    cdef public bint done
    cdef public object value
    cdef public object error

    cpdef resize(self, Py_ssize_t n_ranks)
    cpdef int take(self, rank, reply, list next_reply) except -1
    @cython.locals(replied=Py_ssize_t, meter=Meter, at=double)
    cpdef int add(self, rank, bint ok, payload) except -1
    @cython.locals(results=dict, r=Py_ssize_t)
    cpdef object ok_value(self)
    @cython.locals(r=Py_ssize_t)
    cpdef Py_ssize_t first_missing(self) except -1


@cython.final
cdef class Ledger:
    cdef readonly CLock lock
    cdef readonly dict pending
    cdef readonly object completed
    cdef public Py_ssize_t with_deadline, outstanding
    cdef public bint open
    cdef public Meter meter

    cpdef bint register(self, Call call, tuple parts=*) except -1
    cdef bint _register(self, Call call, tuple parts) except -1
    cpdef bint settle(self, Call call, value, error) except -1
    cdef bint _settle(self, Call call, value, error) except -1
    cpdef forget(self, Call call)
    cdef _forget(self, Call call)
    cpdef Py_ssize_t settle_ok(self, list calls, Py_ssize_t start) except -1
    @cython.locals(stop=Py_ssize_t)
    cdef Py_ssize_t _settle_batch(self, list calls, Py_ssize_t start) except -1


cpdef object in_turn(object reply, object rank, list next_reply, CoreSettings settings)

@cython.locals(n=Py_ssize_t, i=Py_ssize_t, call=Call)
cpdef Py_ssize_t record_each(list replies, Py_ssize_t start, rank, list next_reply,
                             dict pending, list answered, CoreSettings settings) except -1

@cython.locals(n=Py_ssize_t, i=Py_ssize_t, with_deadline=Py_ssize_t, futures=Py_ssize_t,
               call=Call)
cpdef tuple settle_ok(list calls, Py_ssize_t start, dict pending, completed, Meter meter=*)
