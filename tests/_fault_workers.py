"""Worker classes and results of tests/failures/test_worker_faults.py: results that user code makes
awkward to probe, and methods that raise what is not an Exception; module level so that
every start method imports them."""

from __future__ import annotations

import asyncio
import sys

import mpx


class AttrDict(dict):
    """The common pattern: keys as attributes, so a missing attribute is a KeyError."""

    __getattr__ = lambda self, k: self[k]  # noqa: E731 (the pattern as users write it)


class Custom(BaseException):
    """A user's exception that is no Exception."""


def _raise(exc: BaseException) -> None:
    raise exc


class RaisesOnPickle:
    """A result whose pickling (in the worker) raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self):
        raise self.exc


def _rebuild_raising(what: str) -> None:
    RAISE[what]()


class RaisesOnUnpickle:
    """An object whose unpickling (wherever it is received) raises RAISE[``what``]."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __reduce__(self):
        return _rebuild_raising, (self.what,)


class RaisesInGetOutput:
    """A result whose ``get_output()`` raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def get_output(self):
        raise self.exc


async def _cancelled() -> None:
    task = asyncio.ensure_future(asyncio.sleep(10))
    asyncio.get_running_loop().call_soon(task.cancel)
    await task


# What a method raises, by name (BaseExceptions do not all pickle across the call).
RAISE = {
    "cancelled": lambda: asyncio.run(_cancelled()),
    "generator_exit": lambda: _raise(GeneratorExit("closed")),
    "custom": lambda: _raise(Custom("a user's BaseException")),
    "system_exit": lambda: sys.exit(6),
    "keyboard_interrupt": lambda: _raise(KeyboardInterrupt()),
}


class Awkward:
    """Methods that return awkward results or raise what is not an Exception, on ``ranks``
    (all by default); the other ranks return their rank."""

    def __init__(self, ctx: mpx.WorkerContext) -> None:
        self.ctx = ctx

    def _mine(self, ranks) -> bool:
        return ranks is None or self.ctx.rank in ranks

    def ident(self, x):
        return x

    def unpicklable_in_driver(self, what, ranks=None):
        return RaisesOnUnpickle(what) if self._mine(ranks) else self.ctx.rank

    def attrdict(self, **items):
        return AttrDict(items, rank=self.ctx.rank)

    def raise_(self, what, ranks=None):
        if self._mine(ranks):
            RAISE[what]()
        return self.ctx.rank

    def result(self, kind, what, ranks=None):
        """A result whose pickling ('pickle') or get_output ('get_output') raises ``what``."""
        if not self._mine(ranks):
            return self.ctx.rank
        try:
            RAISE[what]()
        except BaseException as e:
            exc = e
        return (RaisesOnPickle if kind == "pickle" else RaisesInGetOutput)(exc)
