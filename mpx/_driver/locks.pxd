# The C types of mpx/_driver/locks.py (Cython's pure-Python mode): compiled, the fields
# declared here are C fields, the methods C functions (cpdef: also callable from Python).
# What each one does, the .py says; where it is not compiled, the .py runs as it reads,
# and this file plays no part.

cimport cython
from posix.time cimport timespec

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


@cython.final
cdef class CLock:
    cdef sem_t _sem

    cdef bint _try(self) except -1
    @cython.locals(r=int, err=int)
    cdef bint _wait(self, double until) except -1
    cdef void _release(self) noexcept


@cython.final
cdef class Baton:
    cdef CLock _lock
    cdef bint _held
    cdef unsigned long _holder

    @cython.locals(me="unsigned long", got=bint)
    cpdef bint take(self, double timeout=*) except -1
    cpdef bint held(self) except -1
    cpdef bint locked(self) except -1
    cpdef bint let_go(self) except -1
