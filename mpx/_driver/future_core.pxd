# The C types of mpx/_driver/future_core.py (Cython's pure-Python mode): compiled, the fields
# declared here are C fields, the functions and methods C functions (cpdef: also callable
# from Python), the locals C variables. What each one does, the .py says; where it is not
# compiled, the .py runs as it reads, and this file plays no part.

cimport cython
from posix.time cimport timespec

cdef extern from "pythread.h":
    # (as CPython 3.7+ declares it; Cython's cpython.pythread has the ident as a long)
    unsigned long PyThread_get_thread_ident()

cdef extern from "<semaphore.h>" nogil:
    # (sem_clockwait: glibc 2.30+, declared where _GNU_SOURCE is, as Python.h defines it)
    ctypedef struct sem_t:
        pass
    int sem_init(sem_t*, int pshared, unsigned int value)
    int sem_destroy(sem_t*)
    int sem_trywait(sem_t*)
    int sem_wait(sem_t*)
    int sem_clockwait(sem_t*, int clock, const timespec* until)
    int sem_post(sem_t*)

cdef int _MORE, _ALL_OK, _ANSWERED, _LEAVE
cdef int _W_PENDING, _W_DONE, _W_CANCELLED
cdef int _F_HAND_OFF, _F_CALLBACKS, _F_FINISHED
cdef double _Q1, _Q2, _Q3
cdef object _OK, _ERR
cdef long _pid

cpdef bint runs_here(delivery) except -1
cdef unsigned long _this_thread()
cdef double _now()
cdef object _running_loop()


@cython.final
cdef class CLock:
    cdef sem_t _sem

    cdef bint _try(self) except -1
    cdef _acquire(self)
    cdef bint _acquire_within(self, double timeout) except -1
    @cython.locals(r=int, err=int)
    cdef bint _wait(self, double until) except -1
    cdef _release(self)


@cython.final
cdef class Baton:
    cdef object _lock
    cdef CLock _c
    cdef bint _held
    cdef unsigned long _holder

    @cython.locals(me="unsigned long", got=bint)
    cpdef bint take(self, double timeout=*) except -1
    cpdef bint held(self) except -1
    cpdef bint locked(self) except -1
    cpdef bint let_go(self) except -1


cdef class Call


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
    @cython.locals(now=double, h=Histogram)
    cpdef reply(self, Py_ssize_t rank, Call call, bint last)
    @cython.locals(h=Histogram, r=Py_ssize_t)
    cdef _next_window(self, double now)
    @cython.locals(m=MethodMeter)
    cpdef settled(self, Call call, error)


@cython.final
cdef class Call:
    cdef readonly object seq
    cdef readonly object method
    cdef readonly Py_ssize_t n_ranks
    cdef readonly object reply_rank
    cdef readonly object aggregator
    cdef readonly object deadline
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
    @cython.locals(replied=Py_ssize_t)
    cpdef int add(self, rank, bint ok, payload) except -1
    @cython.locals(results=dict, r=Py_ssize_t)
    cpdef object ok_value(self)
    @cython.locals(r=Py_ssize_t)
    cpdef Py_ssize_t first_missing(self) except -1


@cython.final
cdef class Ledger:
    cdef readonly object lock
    cdef CLock _c
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


cpdef object in_turn(object reply, object rank, list next_reply)

@cython.locals(n=Py_ssize_t, i=Py_ssize_t, call=Call)
cpdef Py_ssize_t record_each(list replies, Py_ssize_t start, rank, list next_reply,
                             dict pending, list answered) except -1

@cython.locals(n=Py_ssize_t, i=Py_ssize_t, with_deadline=Py_ssize_t, futures=Py_ssize_t,
               call=Call)
cpdef tuple settle_ok(list calls, Py_ssize_t start, dict pending, completed, Meter meter=*)


@cython.final
cdef class LoopWakeups:
    cdef list due
    cdef object delivery

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


cdef object _asyncio_loop(fn)
cdef bint _call_in_loop(delivery, fn, arg, context) except -1


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
    cdef readonly long _owner

    cpdef _check_owner(self)
    @cython.locals(follow=int)
    cdef int _finish(self, result, exc) except -1
    cdef int _finish_locked(self, result, exc) except -1
    cdef bint _attach(self, Waiter target, delivery) except -1
    @cython.locals(target=Waiter)
    cdef _do_hand_off(self, thread)
    cdef _hand_off_rest(self, list waits)
    @cython.locals(follow=int)
    cdef int _follow(self)
    cdef _run_callbacks_in(self, bint here)


@cython.locals(follow=int)
cdef int _complete_one(FutureCore fut, value, error, list due, bint by_hand, thread) except -1
@cython.locals(fut=FutureCore)
cpdef complete_each(completed, list due=*)
