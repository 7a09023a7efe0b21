"""A scheduler step as an LLM engine's driver broadcasts it: request ids, per-request token
lists, block tables and sampling parameters in plain Python containers, plus two small
tensors (shared by bench_engine_step.py and bench_inband.py)."""

from __future__ import annotations

import pickle
import random

import torch

# 290 requests of 16-64 new tokens each over 40-120 blocks pickle to ~150 KB (the
# scheduler output the issue measures); scale= changes the request count.
REQUESTS = 290


def make_step(step: int = 0, scale: float = 1.0, seed: int = 0) -> dict:
    rng = random.Random(seed)
    n = max(1, int(REQUESTS * scale))
    req_ids = [f"cmpl-{rng.getrandbits(64):016x}-0" for _ in range(n)]
    new_tokens = [[rng.randrange(152_000) for _ in range(rng.randrange(16, 64))]
                  for _ in range(n)]
    blocks = [[rng.randrange(1 << 16) for _ in range(rng.randrange(40, 120))]
              for _ in range(n)]
    return {
        "step": step,
        "req_ids": req_ids,
        "new_token_ids": dict(zip(req_ids, new_tokens)),
        "block_tables": dict(zip(req_ids, blocks)),
        "num_scheduled_tokens": {r: len(t) for r, t in zip(req_ids, new_tokens)},
        "sampling": {r: {"temperature": 0.7, "top_p": 0.95, "seed": i}
                     for i, r in enumerate(req_ids)},
        "finished_req_ids": set(req_ids[: n // 32]),
        "positions": torch.arange(n, dtype=torch.int64),
        "slot_mapping": torch.arange(n * 4, dtype=torch.int32),
    }


def pickled_size(step: dict) -> int:
    return len(pickle.dumps(step, protocol=5))
