# The C types of mpx/_driver/core_settings.py (Cython's pure-Python mode): compiled, its
# fields are C fields, which the core's other compiled modules read with no Python call.

cimport cython


@cython.final
cdef class CoreSettings:
    cdef readonly object ok, err, not_owner, delivery_of
