# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""serde's compiled helpers. Memory a received message is copied into, owned by the
receiver (never aliasing a ring or a socket's frame): ``bytes`` or a writable
``bytearray``, with huge-page advice when large. The pickler's sink, whose ``write`` the
pickler calls for every message sent, each thread's kept picklers, and the codec of
small messages (``small_encode``, ``small_decode``). ``mpx/_buffers_py.py`` is its
pure-Python twin."""

import copyreg
import sys

from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.dict cimport PyDict_GetItem, PyDict_SetItem
from cpython.object cimport PyObject
from cpython.bytearray cimport (PyByteArray_FromStringAndSize, PyByteArray_AS_STRING,
                                 PyByteArray_Resize)
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.float cimport PyFloat_AS_DOUBLE, PyFloat_FromDouble
from cpython.long cimport PyLong_FromLongLong
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.string cimport memcpy
from libc.stdint cimport uint64_t

cdef extern from "Python.h":
    PyObject* PyThreadState_GetDict()
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1
    bint PyUnicode_IS_ASCII(object)
    void* PyUnicode_DATA(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    Py_ssize_t PY_SSIZE_T_MAX
    object PyUnicode_DecodeASCII(const char*, Py_ssize_t, const char*)

cdef extern from "_ring_sync.h" nogil:
    void mpx_advise_huge(void* p, size_t n)

cdef enum:
    # Large buffers get transparent-huge-page advice: 4 KiB page faults would otherwise cap
    # a copy into fresh memory at ~3 GB/s.
    HUGE_ADVICE_MIN = 4 << 20
    # A pickler's memo table grows with the largest message it pickled and never shrinks,
    # and clear_memo() walks all of it: after one message of 20000 small lists, every later
    # no-op call took ~110 us to pickle. After a message this large (in band), the pickler
    # gets a new, small table instead (~40 ns more than clearing a small one).
    FRESH_MEMO_BYTES = 512

# The small-message codec (see small_encode); the twin's SMALL_* constants are the same.
cdef enum:
    SMALL_NONE = 0
    SMALL_FALSE = 1
    SMALL_TRUE = 2
    SMALL_INT = 3      # int64, little-endian
    SMALL_FLOAT = 4    # IEEE 754 double, little-endian, bit for bit
    SMALL_STR = 5      # u8 length, ASCII
    SMALL_BYTES = 6    # u8 length, bytes
    SMALL_TUPLE = 7    # u8 length, items
    SMALL_MAX_BYTES = 256
    SMALL_MAX_LEN = 255
    SMALL_MAX_DEPTH = 4

IMPLEMENTATION = "cython"


cdef object owned_buffer(bint as_bytes, uint64_t size, char** ptr):
    """A new, uninitialised buffer of ``size`` bytes (bytes if ``as_bytes``, else a
    bytearray); its memory in ``*ptr``. MemoryError if it cannot be allocated."""
    cdef object buf
    if size > <uint64_t>PY_SSIZE_T_MAX:
        raise MemoryError(f"cannot allocate a buffer of {size} bytes")
    if as_bytes:
        buf = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>size)
        ptr[0] = PyBytes_AS_STRING(buf)
    else:
        # Not PyByteArray_FromStringAndSize(NULL, size): when its malloc fails it frees a
        # bytearray whose export count it has not set yet, and CPython (3.11-3.13) prints
        # "SystemError: deallocated bytearray object has exported buffers". An empty one
        # resized fails cleanly.
        buf = PyByteArray_FromStringAndSize(NULL, 0)
        PyByteArray_Resize(buf, <Py_ssize_t>size)
        ptr[0] = PyByteArray_AS_STRING(buf)
    if size >= HUGE_ADVICE_MIN:
        mpx_advise_huge(ptr[0], size)
    return buf


cdef class Assembler:
    """Builds one message of ``total`` bytes from consecutive pieces (the ZeroMQ reader's
    chunks) in memory the caller will own: bytes if ``as_bytes``, else a bytearray."""

    cdef object dest
    cdef char* ptr
    cdef uint64_t off, total

    def __init__(self, uint64_t total, bint as_bytes):
        self.dest = owned_buffer(as_bytes, total, &self.ptr)
        self.off = 0
        self.total = total

    def add(self, const unsigned char[::1] piece):
        """Append ``piece``; ValueError if it would overrun the message."""
        cdef size_t n = piece.shape[0]
        if self.dest is None:
            raise ValueError("the message was already taken")
        if n > self.total - self.off:
            raise ValueError(f"a piece of {n} bytes overruns the message "
                             f"({self.off} of {self.total} bytes filled)")
        if n:
            with nogil:
                memcpy(self.ptr + self.off, &piece[0], n)
        self.off += n

    @property
    def complete(self):
        """Whether every byte of the message was added."""
        return self.off == self.total

    def result(self):
        """The message; ValueError unless every byte was added."""
        if self.off != self.total:
            raise ValueError(f"message incomplete: {self.off} of {self.total} bytes")
        if self.dest is None:
            raise ValueError("the message was already taken")
        d, self.dest = self.dest, None
        return d


cdef class Sink:
    """The pickler's file (see ``mpx.serde``): the pickle's parts as the pickler writes
    them, never joined. A write of ``big`` bytes or more is first offered to
    ``on_big(sink, b, n)`` (serde's out-of-band policy), which returns True if it took it.
    ``oob`` keeps its identity (a pickler's ``buffer_callback`` is its ``append``)."""

    cdef public list parts
    cdef public list oob
    cdef public Py_ssize_t size
    cdef readonly Py_ssize_t big
    cdef object on_big

    def __init__(self, Py_ssize_t big, on_big):
        self.parts = []
        self.oob = []
        self.size = 0
        self.big = big
        self.on_big = on_big

    def write(self, b):
        cdef Py_ssize_t n = len(b)
        if n >= self.big and self.on_big(self, b, n):
            return
        self.parts.append(b)
        self.size += n

    def dump(self, pickler, obj):
        """``pickler.dump(obj)`` (its file is this sink), its memo cleared after (replaced
        by a new one after a large message: a memo table never shrinks). The parts as a
        tuple when nothing went out of band (the sink is then empty again), else None
        (``parts`` and ``oob`` hold the message: the caller resets). An exception leaves
        the sink empty."""
        return self._dump(pickler, pickler.dump, pickler.clear_memo, obj)

    cdef tuple _dump(self, pickler, dump, clear_memo, obj):
        cdef tuple parts
        cdef bint large = True
        try:
            dump(obj)
            large = self.size >= FRESH_MEMO_BYTES
        except BaseException:
            self.reset()
            raise
        finally:
            if large:
                pickler.memo = {}
            else:
                clear_memo()
        if self.oob:
            return None
        parts = tuple(self.parts)
        self.parts = []
        self.size = 0
        return parts

    def reset(self):
        """Forget what was written."""
        self.parts = []
        del self.oob[:]
        self.size = 0


cdef class _Kept:
    """A kept pickler, its sink, and its methods bound once."""
    cdef Sink sink
    cdef object pickler, dump, clear_memo
    cdef object seen  # the copyreg table its dispatch table was built from
    cdef bint busy


cdef class Picklers:
    """Each thread's kept picklers, one per (``local_only``, torch imported): building one
    costs more than pickling a small call. ``make(local_only, with_torch)`` (serde's
    policy) returns ``(sink, pickler, seen)`` for a new one; a kept one is made again when
    copyreg's table is no longer ``seen`` or ``settings["OOB_MIN_BYTES"]`` is no longer its
    sink's floor. A nested use in the same thread (a reducer that encodes) gets a new one."""

    cdef object make
    cdef dict settings
    cdef dict modules
    cdef dict registered

    def __init__(self, make, dict settings):
        self.make = make
        self.settings = settings
        self.modules = sys.modules
        self.registered = copyreg.dispatch_table  # (the pickle module reads this dict too)

    cdef _Kept _new(self, bint local_only, bint with_torch):
        cdef _Kept k = _Kept.__new__(_Kept)
        sink, pickler, k.seen = self.make(local_only, with_torch)
        k.sink = sink
        k.pickler = pickler
        k.dump = pickler.dump
        k.clear_memo = pickler.clear_memo
        return k

    def dumps(self, obj, bint local_only):
        """``obj`` pickled: ``(parts, sink)``, as ``Sink.dump`` returns them (``parts`` is
        None when something went out of band: the caller resets the sink when done)."""
        return self._dumps(obj, local_only)

    cdef tuple _dumps(self, obj, bint local_only):
        cdef object local = <object>PyThreadState_GetDict()
        cdef PyObject* found = PyDict_GetItem(local, self)
        cdef list kept
        cdef _Kept k
        cdef bint with_torch = "torch" in self.modules
        cdef Py_ssize_t i = local_only + 2 * with_torch
        if found == NULL:
            kept = [None, None, None, None]
            PyDict_SetItem(local, self, kept)
        else:
            kept = <list>found
        k = kept[i]
        if k is None or k.sink.big != self.settings["OOB_MIN_BYTES"] or \
                k.seen != self.registered:
            k = kept[i] = self._new(local_only, with_torch)
        elif k.busy:
            k = self._new(local_only, with_torch)
        k.busy = True
        try:
            return k.sink._dump(k.pickler, k.dump, k.clear_memo, obj), k.sink
        finally:
            k.busy = False


cdef class Encoder:
    """``serde.encode`` with its common case in C (``encode``): ``bytes`` travel as they
    are (``bytes_kind``), a small tuple as one ``small_kind`` message (``small_encode``);
    anything else is pickled by ``picklers`` into one
    ``pickle_kind`` message, unless something went out of band (then ``oob(sink)`` makes
    the message, and the sink is reset after) or the kept pickler refused it (then
    ``refused(obj, local_only, error)`` tries another way or raises)."""

    cdef Picklers picklers
    cdef object bytes_kind, small_kind, pickle_kind, refused, oob

    def __init__(self, Picklers picklers, bytes_kind, small_kind, pickle_kind, refused, oob):
        self.picklers = picklers
        self.bytes_kind = bytes_kind
        self.small_kind = small_kind
        self.pickle_kind = pickle_kind
        self.refused = refused
        self.oob = oob

    def encode(self, obj, bint local_only=False):
        """``(kind, parts)``: ``obj`` as a message, its buffers to concatenate."""
        cdef tuple got
        if type(obj) is tuple:
            small = _small_bytes(obj)
            if small is not None:
                return (self.small_kind, (small,))
        elif type(obj) is bytes:
            return (self.bytes_kind, (obj,))
        try:
            got = self.picklers._dumps(obj, local_only)
        except Exception as e:
            return self.refused(obj, local_only, e)
        parts, sink = got
        if parts is not None:
            return (self.pickle_kind, parts)
        try:
            return self.oob(sink)
        finally:
            sink.reset()


cdef class LentDecoder:
    """``serde.decode_lent`` with its common cases in C: a plain pickle is ``loads(data)``
    here and a small message ``small_decode(data)``; an exception of either (a
    BaseException too) not of the ``passthrough`` types becomes ``undecodable(e)``
    (chained); any other kind is ``other(kind, data)``. Every message a ring reader takes goes through one."""

    cdef int pickle_kind, small_kind
    cdef object loads, other, undecodable, passthrough

    def __init__(self, int pickle_kind, int small_kind, loads, other, undecodable,
                 passthrough):
        self.pickle_kind = pickle_kind
        self.small_kind = small_kind
        self.loads = loads
        self.other = other
        self.undecodable = undecodable
        self.passthrough = passthrough

    def __call__(self, int kind, data):
        try:
            if kind == self.small_kind:
                return _small_decode(data)
            if kind != self.pickle_kind:
                return self.other(kind, data)
            return self.loads(data)
        except BaseException as e:
            if isinstance(e, self.passthrough):
                raise
            raise self.undecodable(e) from e


# ------------------------------------------------------------------ small messages

cdef Py_ssize_t _small_put(object o, char* buf, Py_ssize_t pos, int depth) except -2:
    """``o``'s encoding appended at ``buf[pos:]``: the new end, or -1 if ``o`` is not small."""
    cdef Py_ssize_t n, i
    cdef long long v
    cdef double d
    cdef int overflow = 0
    if pos + 10 > SMALL_MAX_BYTES:  # (room for any header and 8 bytes)
        return -1
    if o is None:
        buf[pos] = SMALL_NONE
        return pos + 1
    cdef type t = type(o)
    if t is tuple:
        n = PyTuple_GET_SIZE(o)
        if depth >= SMALL_MAX_DEPTH or n > SMALL_MAX_LEN:
            return -1
        buf[pos] = SMALL_TUPLE
        buf[pos + 1] = <char>n
        pos += 2
        for i in range(n):
            pos = _small_put(<object>PyTuple_GET_ITEM(o, i), buf, pos, depth + 1)
            if pos < 0:
                return -1
        return pos
    if t is int:
        v = PyLong_AsLongLongAndOverflow(o, &overflow)
        if overflow:
            return -1
        buf[pos] = SMALL_INT
        memcpy(buf + pos + 1, &v, 8)
        return pos + 9
    if t is str:
        n = PyUnicode_GET_LENGTH(o)
        if n > SMALL_MAX_LEN or not PyUnicode_IS_ASCII(o) or pos + 2 + n > SMALL_MAX_BYTES:
            return -1
        buf[pos] = SMALL_STR
        buf[pos + 1] = <char>n
        memcpy(buf + pos + 2, PyUnicode_DATA(o), n)
        return pos + 2 + n
    if t is bool:
        buf[pos] = SMALL_TRUE if o is True else SMALL_FALSE
        return pos + 1
    if t is float:
        d = PyFloat_AS_DOUBLE(o)
        buf[pos] = SMALL_FLOAT
        memcpy(buf + pos + 1, &d, 8)
        return pos + 9
    if t is bytes:
        n = len(<bytes>o)
        if n > SMALL_MAX_LEN or pos + 2 + n > SMALL_MAX_BYTES:
            return -1
        buf[pos] = SMALL_BYTES
        buf[pos + 1] = <char>n
        memcpy(buf + pos + 2, PyBytes_AS_STRING(o), n)
        return pos + 2 + n
    return -1


cdef object _small_bytes(tuple obj):
    cdef char buf[SMALL_MAX_BYTES]
    cdef Py_ssize_t n = _small_put(obj, buf, 0, 0)
    return None if n < 0 else PyBytes_FromStringAndSize(buf, n)


def small_encode(obj):
    """``obj`` as a small message (bytes), or None when it is not one: a tuple, nested at
    most SMALL_MAX_DEPTH deep, of None, bool, int (int64), float, ASCII str and bytes (up
    to 255 characters or bytes each), and tuples of these, of the exact types, 256 bytes
    encoded at most. Each item is a tag byte and its value; a tuple, str or bytes has a
    length byte; numbers are 8 bytes, little-endian. Far less code runs than in the
    pickler and the unpickler: after an idle spell, when every line runs cold, a no-op
    call's round trip takes 0.84x the time it takes with pickle."""
    if type(obj) is not tuple:
        return None
    return _small_bytes(obj)


cdef object _small_get(const unsigned char* p, Py_ssize_t end, Py_ssize_t* pos, int depth):
    cdef Py_ssize_t at = pos[0], n, i
    cdef long long v
    cdef double d
    cdef object item, t
    if at >= end:
        raise ValueError("small message truncated")
    cdef unsigned char tag = p[at]
    at += 1
    if tag == SMALL_NONE or tag == SMALL_FALSE or tag == SMALL_TRUE:
        pos[0] = at
        return None if tag == SMALL_NONE else tag == SMALL_TRUE
    if tag == SMALL_INT or tag == SMALL_FLOAT:
        if at + 8 > end:
            raise ValueError("small message truncated")
        pos[0] = at + 8
        if tag == SMALL_INT:
            memcpy(&v, p + at, 8)
            return PyLong_FromLongLong(v)
        memcpy(&d, p + at, 8)
        return PyFloat_FromDouble(d)
    if tag != SMALL_STR and tag != SMALL_BYTES and tag != SMALL_TUPLE:
        raise ValueError(f"small message has an unknown tag {tag}")
    if at >= end:
        raise ValueError("small message truncated")
    n = p[at]
    at += 1
    if tag == SMALL_TUPLE:
        if depth >= SMALL_MAX_DEPTH:
            raise ValueError("small message nested too deep")
        pos[0] = at
        t = PyTuple_New(n)
        for i in range(n):
            item = _small_get(p, end, pos, depth + 1)
            Py_INCREF(item)
            PyTuple_SET_ITEM(t, i, item)
        return t
    if at + n > end:
        raise ValueError("small message truncated")
    pos[0] = at + n
    if tag == SMALL_STR:
        return PyUnicode_DecodeASCII(<const char*>p + at, n, "strict")
    return PyBytes_FromStringAndSize(<const char*>p + at, n)


def small_decode(data):
    """The tuple a ``small_encode`` message holds (``data``: any contiguous buffer).
    Raises ValueError for a malformed one."""
    return _small_decode(data)


cdef object _small_decode(data):
    cdef Py_buffer view
    cdef Py_ssize_t pos = 0
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        obj = _small_get(<const unsigned char*>view.buf, view.len, &pos, 0)
        if pos != view.len or type(obj) is not tuple:
            raise ValueError("small message malformed")
        return obj
    finally:
        PyBuffer_Release(&view)
