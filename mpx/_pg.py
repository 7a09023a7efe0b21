"""Collectives over a process group, for ``MessageQueue.create_from_process_group*``.

``pg`` is a ``torch.distributed`` ProcessGroup (any backend that moves objects: gloo, or
nccl with a current device), or a vLLM StatelessProcessGroup-like object with ``rank``,
``world_size``, ``broadcast_obj(obj, src)`` and ``all_gather_obj(obj)``. Ranks are group
ranks. torch is imported only here, and only when such a constructor is called.
"""

from __future__ import annotations

import os
import socket
from typing import Any


def _torch_group(pg: Any):
    """``torch.distributed`` if ``pg`` is one of its groups, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if isinstance(pg, dist.ProcessGroup) else None


def rank_and_size(pg: Any) -> tuple[int, int]:
    """This process's group rank and the group's size."""
    dist = _torch_group(pg)
    if dist is not None:
        return dist.get_rank(pg), dist.get_world_size(pg)
    return pg.rank, pg.world_size


def broadcast(pg: Any, obj: Any, src: int) -> Any:
    """``obj`` of group rank ``src``, on every rank."""
    dist = _torch_group(pg)
    if dist is None:
        return pg.broadcast_obj(obj, src)
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, src), group=pg)
    return box[0]


def all_gather(pg: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in group rank order, on every rank."""
    dist = _torch_group(pg)
    if dist is None:
        return list(pg.all_gather_obj(obj))
    out: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, obj, group=pg)
    return out


def gather(pg: Any, obj: Any, dst: int) -> list[Any]:
    """Every rank's ``obj`` in group rank order on rank ``dst``; [] elsewhere."""
    dist = _torch_group(pg)
    if dist is None:
        objs = all_gather(pg, obj)
        return objs if pg.rank == dst else []
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    out: list[Any] | None = [None] * size if rank == dst else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(pg, dst), group=pg)
    return out or []


def node_id() -> tuple[str, str, int]:
    """What processes that can share a /dev/shm segment have in common: the host name,
    the boot id and the device of /dev/shm (another container has its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        dev = os.stat("/dev/shm").st_dev
    except OSError:
        dev = -1
    return socket.gethostname(), boot, dev


def same_node_as(pg: Any, src: int) -> list[bool]:
    """For each group rank, whether it runs on the node of group rank ``src``
    (collective)."""
    ids = all_gather(pg, node_id())
    return [i == ids[src] for i in ids]
