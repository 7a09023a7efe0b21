# The C types of mpx/_driver/future_core.py (Cython's pure-Python mode): compiled, the fields
# declared here are C fields, the functions and methods C functions (cpdef: also callable
# from Python), the locals C variables. What each one does, the .py says; where it is not
# compiled, the .py runs as it reads, and this file plays no part.

cimport cython

from mpx._driver.core_settings cimport CoreSettings
from mpx._driver.locks cimport CLock
from mpx._driver.waiters cimport Waiter

cdef int _F_HAND_OFF, _F_CALLBACKS, _F_FINISHED
cdef long _pid


cdef class FutureCore:
    cdef public CLock _lock
    cdef public object _state
    cdef public object _result
    cdef public object _exception
    cdef object _waiting
    cdef public object _done_callbacks
    cdef public object _loop_waits
    cdef public object _cond
    cdef public object _call
    cdef public object _source
    cdef public object _target
    cdef public object _delivery
    cdef readonly CoreSettings _settings
    cdef readonly long _owner

    cpdef _check_owner(self)
    @cython.locals(follow=int)
    cdef int _finish(self, result, exc) except -1
    cdef int _finish_locked(self, result, exc) except -1
    cdef object _attach(self, Waiter target)
    @cython.locals(target=Waiter)
    cdef _do_hand_off(self, unsigned long thread)
    cdef _hand_off_rest(self, list waits)
    @cython.locals(follow=int)
    cdef int _follow(self)
    cdef _run_callbacks_in(self, bint here)


@cython.locals(follow=int)
cdef int _complete_one(FutureCore fut, value, error, list due, bint by_hand,
                       unsigned long thread) except -1
@cython.locals(fut=FutureCore, thread="unsigned long")
cpdef complete_each(completed, list due=*)
