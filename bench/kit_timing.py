"""Timed loops: calls timed one by one with the GC off, settled first, and several callables
timed in alternating blocks or in turn so that the host's drift hits them alike.
"""

from __future__ import annotations

import gc
import time

# The first few hundred round trips after a spawn are slower (1.5x here) until the scheduler
# has spread the processes over the cores: calls for this long come first.
SETTLE_S = 0.5
MIN_SAMPLES = 3  # a timed loop cut short by its time budget still keeps this many


def settle(fns, seconds, min_rounds=0):
    """Call every fn in turn for ``seconds``, and at least ``min_rounds`` rounds."""
    end, i = time.perf_counter() + seconds, 0
    while i < min_rounds or time.perf_counter() < end:
        for fn in fns:
            fn()
        i += 1


def time_calls(fn, iters, warm=0, budget_s=None):
    """Seconds of each of ``iters`` calls of ``fn`` after ``warm`` untimed ones, with the GC off;
    fewer once ``budget_s`` is spent (but at least MIN_SAMPLES)."""
    for _ in range(warm):
        fn()
    out, clock = [], time.perf_counter_ns
    budget = None if budget_s is None else budget_s * 1e9
    gc.disable()
    try:
        begin = clock()
        for _ in range(iters):
            t0 = clock()
            fn()
            out.append((t1 := clock()) - t0)
            if budget is not None and t1 - begin > budget and len(out) >= MIN_SAMPLES:
                break
    finally:
        gc.enable()
    return [x / 1e9 for x in out]


def timed_us(fn, iters, warm=0):
    return [t * 1e6 for t in time_calls(fn, iters, warm)]


def interleaved(fns, warm, iters, blocks, settle_s=SETTLE_S):
    """{fn: [us per call]}: every fn settled first, then ``iters`` timed calls each, in ``blocks``
    alternating in order, so that the host's drift hits all alike."""
    settle(fns, settle_s, min_rounds=warm)
    out = {fn: [] for fn in fns}
    for b in range(blocks):
        for fn in (fns if b % 2 == 0 else fns[::-1]):
            out[fn] += timed_us(fn, max(1, iters // blocks))
    return out


def in_turn(fns, reps, warm):
    """[[seconds of each call] of each fn]: ``warm + reps`` rounds, the fns called in turn (the first
    one alternating), so that drift hits them alike."""
    out = [[] for _ in fns]
    for i in range(warm + reps):
        for f, ts in (zip(fns, out) if i % 2 == 0 else list(zip(fns, out))[::-1]):
            t0 = time.perf_counter()
            f()
            if i >= warm:
                ts.append(time.perf_counter() - t0)
    return out
