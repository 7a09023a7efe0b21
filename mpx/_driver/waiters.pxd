# The C types of mpx/_driver/waiters.py (Cython's pure-Python mode): compiled, the fields
# declared here are C fields, the functions and methods C functions (cpdef: also callable
# from Python; cdef: from the core's other compiled modules, which cimport them). What each
# one does, the .py says; where it is not compiled, the .py runs as it reads, and this file
# plays no part.

cimport cython

cdef int _W_PENDING, _W_DONE, _W_CANCELLED

cpdef bint runs_here(delivery) except -1
cdef object _running_loop()


@cython.final
cdef class LoopWakeups:
    cdef list due
    cdef readonly object delivery

    cdef schedule(self, Waiter waiter)
    @cython.locals(due=list, waiter=Waiter)
    cpdef run(self)


@cython.final
cdef class Waiter:
    cdef public object _asyncio_future_blocking
    cdef object _loop
    cdef LoopWakeups _wakeups
    cdef int _state
    cdef object _result
    cdef object _exception
    cdef object _cancel_message
    cdef object _callback
    cdef object _context
    cdef list _more

    cdef object _cancelled_error(self)
    cdef _settle(self, result, exc)
    cdef _schedule(self)
    cdef _run_callbacks(self)
    cdef _call(self, fn, context)


@cython.locals(wakeups=LoopWakeups)
cdef Waiter new_waiter(delivery_of)
cdef object asyncio_loop(fn)
cdef bint call_in_loop(delivery, fn, arg, context) except -1
