"""The drop log of a ZeroMQ queue end: what it received and threw away (forged, altered,
replayed, out of order), counted, and logged once per peer.

Used by one thread at a time: the holder of its end's lock (or a streamed message's one
consumer).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("mpx")


class DropLog:
    """Counts dropped frames and logs once per peer (for the first _LOGGED_PEERS peers)."""

    _LOGGED_PEERS = 64

    def __init__(self, where: str) -> None:
        self.where = where
        self.count = 0
        self._logged: set = set()

    def drop(self, peer: Any, why: str) -> None:
        self.count += 1
        if peer not in self._logged and len(self._logged) < self._LOGGED_PEERS:
            self._logged.add(peer)
            logger.warning("%s dropped a message from %r: %s (further drops from this "
                           "peer are counted, not logged)", self.where, peer, why)
