# cython: language_level=3, annotation_typing=False, binding=False
"""``CoreSettings``: what the futures core is told of the rest of mpx, which it does not
import (mpx/_driver/ledger.py and future_core.py import no mpx module outside the core).
The call registry (mpx/_driver/registry.py) builds one for its executor and gives it to
each ``Call`` and ``RPCFuture`` made for it; nothing is set into a module at import.

One source, two builds (Cython's pure-Python mode): compiled with the C fields of
mpx/_driver/core_settings.pxd into ``mpx._driver.core_settings``, else run as plain Python.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import cython
except ImportError:  # Cython is a build dependency only: plain Python needs cython.compiled
    from mpx.mechanism import _cython_shim as cython  # type: ignore[no-redef]

IMPLEMENTATION = "cython" if cython.compiled else "python"


class CoreSettings:
    """``ok`` and ``err``: the wire's statuses of a call's reply, the only replies a
    ``Call`` records (OK: the payload is the result; ERR: an error's ``(type name, message,
    traceback)``); ``not_owner(what, owner_pid, this_pid)``: the error a future raises when
    used outside the process that made it; ``delivery_of(loop)``: the delivery of an event
    loop (mpx/_driver/futures.py's ``_LoopDelivery``: ``loop()``, ``running_thread``,
    ``awaiting``, ``reading``, ``wakeups``, ``add``, ``_read``), made on first use."""

    __slots__ = ("ok", "err", "not_owner", "delivery_of")

    def __init__(self, ok: Any, err: Any, not_owner: Callable[[str, int, int], BaseException],
                 delivery_of: Callable[[Any], Any]) -> None:
        self.ok = ok
        self.err = err
        self.not_owner = not_owner
        self.delivery_of = delivery_of
