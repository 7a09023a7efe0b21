"""The protocol every process of a group speaks: what a message is and how objects become
messages. Above the mechanism (``mpx.mechanism``), below the transports.

    wire.py        every message that crosses a process boundary, in one catalogue
    serde.py       objects <-> messages: pickle 5, out-of-band buffers, the small codec
    sharing.py     tensors in shared memory, sent by reference (``mpx.share``)
"""
