"""Child processes of tests/transport/test_channel.py: readers that answer through the channel."""

from __future__ import annotations

import mpx


def channel_echo(handle, rank, key, conn):
    """Attach as reader ``rank``; make a one-reader answer queue (the parent attaches to
    it with the handle sent over ``conn``); answer each object with ``("got", obj)`` through
    ``writing_end().send`` until None comes."""
    config = mpx.Config(auth_key=key, heartbeat_s=1.0) if key else mpx.Config()
    calls = mpx.MessageQueue.create_from_handle(handle, rank, config=config)
    answers = mpx.MessageQueue(1, 0 if key else 1, config=config)
    try:
        conn.send(answers.export_handle())
        calls.wait_until_ready(30)
        answers.wait_until_ready(30)
        inbox, out = calls.reading_end(), answers.writing_end()
        while (obj := inbox.recv(mpx.queue.deadline_of(30))) is not None:
            out.send(("got", obj), mpx.queue.deadline_of(30))
        out.send(("bye", rank), mpx.queue.deadline_of(30))
    finally:
        answers.close()
        calls.close()
