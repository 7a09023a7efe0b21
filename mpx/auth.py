"""HMAC-SHA256 framing for what crosses a network: the queue's ZeroMQ chunks and the node
control channel. A frame is ``header + parts + HMAC(header + parts)`` under the
deployment's key; a receiver checks it before it parses or unpickles anything.

A :class:`Signer` hashes the key into HMAC's inner and outer states once and copies them for
each frame (``hmac.new`` per frame costs ~3 us more: the key is hashed into both pads every
time); the module's functions make one for a single frame.

Two SHA-256s do the hashing. A frame of up to ``SMALL_FRAME`` bytes (a call, a reply, what
a reader says) is hashed by CPython's own (``_interp.SHA256_BUILTIN``): copying its state is
a plain copy of memory, where OpenSSL's copy allocates and goes through its provider, which
on a core that ran other work since the last frame costs ~1 us more a frame (a no-op's round
trip over ZeroMQ seals and checks four). A larger one is hashed by hashlib's (OpenSSL, with
the CPU's SHA instructions: ~1.8 GB/s, against ~0.3 for CPython's). Both give the same HMAC.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from mpx import _interp

DIGEST_SIZE = hashlib.sha256().digest_size
# The largest frame (header and parts, without the HMAC) hashed by CPython's own SHA-256:
# ~10 of its 64-byte blocks, where its extra cost per block (~0.18 us) would undo what its
# cheap copy saves.
SMALL_FRAME = 512
_BLOCK = hashlib.sha256().block_size
_SMALL_SHA256 = _interp.SHA256_BUILTIN or hashlib.sha256
_INNER_PAD = bytes(x ^ 0x36 for x in range(256))  # (translation tables: each key byte xor'd)
_OUTER_PAD = bytes(x ^ 0x5C for x in range(256))
_compare = hmac.compare_digest


def _keyed(sha256, key: bytes) -> tuple:
    """HMAC's ``(inner, outer)`` states for ``key`` (RFC 2104), hashed by ``sha256``."""
    if len(key) > _BLOCK:
        key = hashlib.sha256(key).digest()
    key = key.ljust(_BLOCK, b"\0")
    return sha256(key.translate(_INNER_PAD)), sha256(key.translate(_OUTER_PAD))


class Signer:
    """Seals and checks frames under one key. The keyed states are only ever copied, never
    updated, so any number of threads may share one."""

    __slots__ = ("_small", "_large")

    def __init__(self, key: bytes) -> None:
        self._small = _keyed(_SMALL_SHA256, key)
        self._large = _keyed(hashlib.sha256, key)

    def digest(self, data) -> bytes:
        """HMAC-SHA256 of ``data`` (a bytes-like object)."""
        data = memoryview(data)
        inner, outer = self._small if data.nbytes <= SMALL_FRAME else self._large
        inner = inner.copy()
        inner.update(data)
        outer = outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def seal(self, header: bytes, parts: Iterable, nbytes: int = -1) -> bytes:
        """One frame: header, the parts, and the HMAC of both; ``nbytes``: the parts' length,
        where the caller knows it (else it is counted here). (One frame, not a multipart
        message: libzmq 4.3 aborts when a multipart message meets a reader's full pipe.)"""
        parts = tuple(parts)
        if nbytes < 0:
            nbytes = sum([memoryview(p).nbytes for p in parts])
        inner, outer = self._small if len(header) + nbytes <= SMALL_FRAME else self._large
        inner = inner.copy()
        inner.update(header)
        for p in parts:
            inner.update(p)
        outer = outer.copy()
        outer.update(inner.digest())
        return b"".join((header, *parts, outer.digest()))

    def unseal(self, frame) -> memoryview | None:
        """The frame (a bytes-like object) without its HMAC if the HMAC checks out, else
        None."""
        mv = memoryview(frame)
        if mv.nbytes < DIGEST_SIZE:
            return None
        body = mv[:-DIGEST_SIZE]
        return body if _compare(self.digest(body), mv[-DIGEST_SIZE:]) else None


def seal(key: bytes, header: bytes, parts: Iterable) -> bytes:
    """:meth:`Signer.seal` under ``key``."""
    return Signer(key).seal(header, parts)


def unseal(key: bytes, frame) -> memoryview | None:
    """:meth:`Signer.unseal` under ``key``."""
    return Signer(key).unseal(frame)
