"""The multi-node control channel: HMAC-sealed pickles of :mod:`mpx.wire`'s node messages
between the leader (in the driver) and each follower node. Every frame is sealed with the
group's key; a frame that does not verify is dropped before anything is unpickled."""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle
import zmq

from mpx.auth import seal, unseal

_TAG = b"MPXC"
POLL_MS = 100


def pack(key: bytes, msg: Any) -> bytes:
    return seal(key, _TAG, [cloudpickle.dumps(msg)])


def unpack(key: bytes, frame: Any) -> Any:
    """The node-control message (a :mod:`mpx.wire` dataclass) in ``frame``, or None when
    the frame is not authentic."""
    body = unseal(key, frame)
    if body is None or bytes(body[:4]) != _TAG:
        return None
    return pickle.loads(body[4:])


def control_socket(kind: int) -> zmq.Socket:
    sock: zmq.Socket = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock
