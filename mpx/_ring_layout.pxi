# The ring segment's layout: the one source of these numbers for mpx/_ring.pyx.
# mpx/mechanism/layout.py documents the layout and carries the same names and values for Python;
# tests/test_ring.py parses this file and checks that the two agree.

cdef enum:
    # header (offsets in bytes)
    OFF_CHUNK_BYTES = 16
    OFF_N_CHUNKS = 24
    OFF_N_READERS = 32
    OFF_SLOT_STRIDE = 40
    OFF_WRITER_PID = 56
    OFF_WRITE_SEQ = 64
    OFF_PUBLISHED_NS = 72
    OFF_DATA_FUTEX = 128
    OFF_STATE = 132
    OFF_DATA_WOKEN = 136
    OFF_SPACE_FUTEX = 192
    OFF_WRITER_PARKED = 196
    OFF_SPACE_WOKEN = 200
    OFF_READERS = 256
    # the slots start at the first multiple of this after the reader blocks
    SLOTS_ALIGN = 4096

    # reader blocks
    READER_BLOCK = 64
    MAX_READERS = 1024
    RB_READ_SEQ = 0
    RB_PID = 8
    RB_ATTACHED = 16
    RB_CLOSED = 20
    RB_PARKED = 24
    RB_RELEASED = 28

    # slot header
    SLOT_HEADER = 64
    SH_LENGTH = 0
    SH_FLAGS = 8
    SH_KIND = 12
    SH_TOTAL = 16

    # slot flags
    F_BEGIN = 1
    F_END = 2
    F_ABORT = 4

    # state bits
    S_SHUTDOWN = 1
    S_CLOSED = 2

    # the bit of a message's kind that has it delivered as bytes (else a bytearray)
    KIND_AS_BYTES = 0x8000

    # wait results
    OK = 0
    TIMEOUT = 1
    INTERRUPTED = 2
    PEER_GONE = 3
    SHUTDOWN = 4
    SLICE = 5
    NUDGED = 6
    NO_MEMORY = 7
    CLOSED = 8  # (the shm end's, after close(); the ring never returns it)
