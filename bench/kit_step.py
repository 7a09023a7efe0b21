"""An LLM engine's scheduler step, as its driver broadcasts it each step, and its pickled size.
"""

from __future__ import annotations

import pickle
import random


def make_step(step=0, scale=1.0, seed=0):
    """A scheduler step as an LLM engine's driver broadcasts it: request ids, token lists, block
    tables and sampling parameters in plain containers, and two small tensors. 290 requests (x
    ``scale``) of 16-64 new tokens over 40-120 blocks pickle to ~150 KB."""
    import torch
    rng = random.Random(seed)
    n = max(1, int(290 * scale))
    ids = [f"cmpl-{rng.getrandbits(64):016x}-0" for _ in range(n)]
    tokens = [[rng.randrange(152_000) for _ in range(rng.randrange(16, 64))] for _ in ids]
    blocks = [[rng.randrange(1 << 16) for _ in range(rng.randrange(40, 120))] for _ in ids]
    return {"step": step, "req_ids": ids, "new_token_ids": dict(zip(ids, tokens)),
            "block_tables": dict(zip(ids, blocks)),
            "num_scheduled_tokens": {r: len(t) for r, t in zip(ids, tokens)},
            "sampling": {r: {"temperature": 0.7, "top_p": 0.95, "seed": i} for i, r in enumerate(ids)},
            "finished_req_ids": set(ids[: n // 32]), "positions": torch.arange(n, dtype=torch.int64),
            "slot_mapping": torch.arange(n * 4, dtype=torch.int32)}


def pickled_size(obj):
    return len(pickle.dumps(obj, protocol=5))
