"""Transports: how a queue's writer reaches its readers, one Writer/Reader interface with two
ends (of the transport layer, mpx/__init__.py: above the protocol, below the queue).

    base.py     the interface the queue talks to: Writer, Reader, the reader's handle
    shm.py      shared memory (the ring) for the readers on this node
    zmq.py      ZeroMQ over TCP, HMAC-signed frames, for the readers on other nodes
"""
