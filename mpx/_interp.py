"""The interpreter adapter: the one place that names the private parts of CPython and its
standard library that mpx relies on, with what mpx assumes of each. tests/tree/test_interp.py
checks every one of them on the running Python and on each Python that pyenv has
(3.10 to 3.13). Plain Python, base layer: it imports no mpx module.

A name that mpx only reads is taken from here. A name that mpx must *define* (a slot of
a compiled class, a property of a subclass) is spelled where it is defined, as it must be,
and listed here with who defines it; the test checks that the standard library still
looks for exactly that name.

concurrent.futures (``mpx.RPCFuture``, mpx/_driver/futures.py, is a
``concurrent.futures.Future`` whose state is held by the compiled ``FutureCore``,
mpx/_driver/future_core.py; it never runs ``Future.__init__``):

- ``PENDING``, ``RUNNING``, ``CANCELLED``, ``CANCELLED_AND_NOTIFIED``, ``FINISHED``: the
  values of a future's ``_state``, which the module's functions compare with ``==`` and
  ``in``. An RPCFuture is RUNNING from the start and FINISHED once its call is settled.
- ``FUTURE_FIELDS``: what ``wait``, ``as_completed`` (and their ``_AcquireFutures``) read
  on any future they are given: ``_condition`` (entered, ``acquire()``/``release()``),
  ``_state``, ``_waiters`` (a list they append a waiter to and remove it from, under the
  condition's lock). FutureCore defines ``_state`` (a C field) and ``_waiters`` (a
  property), RPCFuture ``_condition`` (a property).
- ``WAITER_METHODS``: what a future calls on each of those waiters when it completes
  (``add_result(future)``, ``add_exception(future)``; ``add_cancelled`` for a cancel,
  which an RPCFuture never has): FutureCore's ``_finish_locked``.
- ``FUTURES_LOGGER``: the module's logger, which logs what a done callback raised;
  FutureCore logs there too.

threading:

- ``CONDITION_LOCK_NEEDS``: what ``threading.Condition(lock)`` needs of a lock that has no
  ``_is_owned``, ``_release_save`` or ``_acquire_restore`` of its own (it then falls back to
  ``acquire``/``release``, judges ownership by a non-blocking ``acquire``, and is entered
  through the lock's ``__enter__``/``__exit__``): the C lock of a compiled future
  (``CLock``, mpx/_driver/locks.py) is such a lock.

asyncio (an RPCFuture is awaited through a ``Waiter``, mpx/_driver/waiters.py):

- ``ASYNCIO_BLOCKING``: ``_asyncio_future_blocking``, the attribute by which a Task knows
  that what a step yielded is a future to wait for (it must not be None; the Task sets it
  False, then calls ``get_loop()``, ``add_done_callback(fn, context=...)`` and, to cancel,
  ``cancel(msg=...)``), and by which ``asyncio.isfuture`` knows a future: the class has the
  attribute and the instance's value is not None. ``Waiter`` defines it as a slot.
- ``is_asyncio_callback(fn)``: whether ``fn`` is a callback of asyncio's own, such as the
  one ``asyncio.wait`` (3.11 on) adds to each future it waits for, which must run in its
  loop: a function whose ``__module__`` is asyncio or one of its submodules.

pickle, as mpx/mechanism/codec.py's ``Sink`` uses it (the codec imports no mpx module, so
it measures what it needs at import, ``CHUNK_REFS``, and keeps everything in band where the
measure fails; these are what it assumes, and the test checks each):

- ``PICKLER_HANDS_OVER_FROM``: the C pickler hands a bytes or bytearray of this size or
  more to ``file.write`` as the caller's own object, not a copy, right after a write that
  ends with its opcode and length (BINBYTES, BINBYTES8, BYTEARRAY8): the codec takes it
  out of band there. The pickler's own chunks are fresh objects that only it holds, so a
  reference count (``sys.getrefcount``; ``Py_REFCNT`` compiled) tells the two apart.
- ``PICKLER_MEMO``: a pickler's ``memo`` may be replaced by a new dict (``pickler.memo =
  {}``), which the codec does after a large message since ``clear_memo()`` walks the
  whole table, and the pickler binds ``file.write`` when it is built.
- ``copyreg.dispatch_table`` stays the one dict that ``pickle`` reads for a Pickler with no
  dispatch table of its own (the codec's kept pickler watches it for registrations).

hashlib:

- ``SHA256_BUILTIN``: CPython's own SHA-256 constructor, the one hashlib falls back to where
  OpenSSL has none (module ``_sha256``; ``_sha2`` from 3.12), or None where this Python was
  built without it. ``mpx.auth`` hashes small frames with it: it takes bytes, and its
  ``copy()``, ``update()`` and ``digest()`` are hashlib's.
"""

from __future__ import annotations

import concurrent.futures._base as _futures_base
import importlib
import logging
from collections.abc import Callable
from typing import Any

# concurrent.futures.Future's states (equal strings since Python 3.2; taken from the module
# itself, so that ``is`` holds too)
PENDING: str = _futures_base.PENDING
RUNNING: str = _futures_base.RUNNING
CANCELLED: str = _futures_base.CANCELLED
CANCELLED_AND_NOTIFIED: str = _futures_base.CANCELLED_AND_NOTIFIED
FINISHED: str = _futures_base.FINISHED

# what concurrent.futures.wait and as_completed read on a future
FUTURE_FIELDS = ("_condition", "_state", "_waiters")
# what a completing future calls on each waiter in its _waiters
WAITER_METHODS = ("add_result", "add_exception", "add_cancelled")
# concurrent.futures' logger (logging.getLogger("concurrent.futures"))
FUTURES_LOGGER: logging.Logger = _futures_base.LOGGER

# what threading.Condition uses of a lock with no _is_owned, _release_save and
# _acquire_restore of its own
CONDITION_LOCK_NEEDS = ("acquire", "release", "__enter__", "__exit__")

# the attribute by which asyncio's Task and isfuture know a future
ASYNCIO_BLOCKING = "_asyncio_future_blocking"


def is_asyncio_callback(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a function of asyncio's own (the done callback ``asyncio.wait``
    adds, which must run in its event loop)."""
    module = getattr(fn, "__module__", None)
    return type(module) is str and (module == "asyncio" or module.startswith("asyncio."))


# the size from which CPython's C pickler hands a caller's bytes or bytearray to
# file.write as they are (its _Pickler_write_bytes: payloads of 64 KiB and up)
PICKLER_HANDS_OVER_FROM = 64 << 10
# the pickler attribute the codec replaces to shrink the memo table
PICKLER_MEMO = "memo"


def _builtin_sha256() -> Callable[..., Any] | None:
    for name in ("_sha2", "_sha256"):  # (3.12 on; before)
        try:
            return importlib.import_module(name).sha256
        except (ImportError, AttributeError):
            continue
    return None


# CPython's own SHA-256 (see the module docstring)
SHA256_BUILTIN: Callable[..., Any] | None = _builtin_sha256()
