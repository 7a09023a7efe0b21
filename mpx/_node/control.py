"""The multi-node control channel: HMAC-sealed pickles of :mod:`mpx.protocol.wire`'s node messages
between the leader (in the driver) and each follower node. Every frame is sealed with the
group's key; a frame that does not verify is dropped before anything is unpickled.

A node whose key differs learns only that: the leader answers a frame it cannot verify
with :data:`BAD_KEY`, a plain frame that carries nothing else, and records the sender's
address for its own error. Neither side unpickles, trusts or changes anything on such a
frame: the follower keeps trying (the hint is unauthenticated, so it may only reword the
error it ends with), and the leader keeps waiting for a follower with the right key."""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle
import zmq

from mpx.auth import DIGEST_SIZE, seal, unseal

_TAG = b"MPXC"
POLL_MS = 100
# The leader's answer to a frame that fails authentication (not sealed: the keys differ).
BAD_KEY = b"mpx node: bad key"


def pack(key: bytes, msg: Any) -> bytes:
    return seal(key, _TAG, [cloudpickle.dumps(msg)])


def unpack(key: bytes, frame: Any) -> Any:
    """The node-control message (a :mod:`mpx.protocol.wire` dataclass) in ``frame``, or None when
    the frame is not authentic."""
    body = unseal(key, frame)
    if body is None or bytes(body[:4]) != _TAG:
        return None
    return pickle.loads(body[4:])


def sealed_by_mpx(frame: bytes) -> bool:
    """Whether ``frame``, which did not verify, has the shape of a control frame: an mpx
    node sealed it, under another key (else it is junk, or another protocol's)."""
    return len(frame) > len(_TAG) + DIGEST_SIZE and frame.startswith(_TAG)


def control_socket(kind: int) -> zmq.Socket:
    sock: zmq.Socket = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def peer_address(frame: zmq.Frame) -> str:
    """The address of the peer that sent ``frame`` (received with ``copy=False``), for
    messages; "an unknown address" where the transport does not say."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, ValueError):
        return "an unknown address"
