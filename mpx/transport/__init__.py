"""Transports: how a queue's writer reaches its readers (shared memory, later ZeroMQ)."""
