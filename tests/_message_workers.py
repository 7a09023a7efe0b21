"""Worker classes of tests/executor/test_messages.py (module level, so that every start method
imports them)."""

from __future__ import annotations

import os
import time


class SlowNewcomer:
    """Ranks from ``slow_from_rank`` on (those a resize grows the group by) take
    ``slow_s`` in ``__init__``: long enough for something to happen meanwhile."""

    def __init__(self, ctx, slow_from_rank=None, slow_s=3.0):
        if slow_from_rank is not None and ctx.rank >= slow_from_rank:
            time.sleep(slow_s)
        self.ctx = ctx

    def who(self):
        return self.ctx.rank, os.getpid()
