"""Transports: how a queue's writer reaches its readers, one Writer/Reader interface with two
ends (of the transport layer, mpx/__init__.py: above the protocol, below the queue).

    base.py     the interface the queue talks to: Writer, Reader, the reader's handle
    shm.py      shared memory (the ring) for the readers on this node; its ends' hot path,
                compiled, in shm_end.py, which calls the ring through shm_primitives
    zmq_*.py    ZeroMQ over TCP, HMAC-signed frames, for the readers on other nodes: the
                writer and the reader (zmq_writer, zmq_reader), and what they share or
                hand off: the frames (zmq_framing), the context of a process and its
                fork rules (zmq_context), who may connect (zmq_admission), chunks into
                messages (zmq_reassembly), the drop log (zmq_drops)
"""
