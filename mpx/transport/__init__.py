"""Transports: how a queue's writer reaches its readers: shared memory for readers on this
node, ZeroMQ over TCP for the others (``base`` is the interface both implement)."""
