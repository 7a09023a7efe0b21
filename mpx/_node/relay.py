"""A follower node's relay (runs in the follower process): one network read per call for
the whole node."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from mpx import _debug
from mpx.config import Config
from mpx.errors import Cancelled, MessageAbortedError, PeerDiedError, QueueClosedError
from mpx.queue import MessageQueue
from mpx.transport.shm import ShmWriter


def relay_reader(local: int, node: int) -> int:
    """The reader rank of follower ``node``'s relay on the driver's broadcast queue (with
    ``local`` ranks a node: readers ``0..local-1`` are the leader's own ranks)."""
    return local + node - 1


def relayed_node(local: int, reader: int) -> int:
    """The follower node whose relay reads the broadcast queue as ``reader``."""
    return reader - local + 1


class Relay:
    """Takes each call once off the network and rebroadcasts it, as it is (no unpickling),
    through a shared-memory ring to this node's workers, chunk by chunk as it arrives."""

    def __init__(self, handle: Any, reader_rank: int, local: int, cfg: Config) -> None:
        self.up = MessageQueue.create_from_handle(handle, reader_rank, config=cfg)
        self.down = MessageQueue(local, local, config=dataclasses.replace(cfg, transport="shm"))
        # a worker that dies is released, and the calls go on to the others (its rank,
        # started again, reads the driver directly: Config.max_restarts)
        end = self.down.writing_end()
        assert isinstance(end, ShmWriter)
        end.release_gone_readers()
        self.handle = self.down.export_handle()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_debug.counted_thread(self._run),
                                        name="mpx-relay", daemon=True)

    def start(self) -> None:
        self.down.wait_until_ready(timeout=30)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:  # each chunk goes on as soon as it has arrived and been checked
                kind, total, pieces = self.up.dequeue_stream(cancel=self._stop)
                try:
                    self.down.enqueue_stream(kind, total, pieces)
                except MessageAbortedError:
                    pass  # the driver gave up on it part way; the workers never see it
        except (Cancelled, PeerDiedError, QueueClosedError):
            pass
        finally:
            self.down.close()  # the workers read what was relayed, then stop

    def reconnect(self) -> None:
        """The leader was silent and is heard again: take the network link up again now
        (see MessageQueue.reconnect_links)."""
        self.up.reconnect_links()

    def stop(self) -> None:
        self._stop.set()
        self.down.shutdown()
        if self._thread.is_alive():
            self._thread.join(5)

    def close(self) -> None:
        self.up.close()
        self.down.close()
