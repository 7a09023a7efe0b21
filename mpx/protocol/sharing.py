"""Tensors sent by reference: ``share(tensor)`` and what serde needs to pickle such tensors.

``share`` copies a CPU tensor once into a named POSIX shared-memory segment of its own
(``mpx/mechanism/segments.py``: mode 0600, the name carries the creator's pid) and returns
a tensor backed by it. serde (``mpx/protocol/serde.py``, with ``local_only``) pickles a
tensor that lives in such a segment, or any view of one, as the segment's name, a byte
offset, dtype, shape and strides (:func:`reference`, :func:`rebuild`); the receiver maps
the same memory, so writes on either side are visible to both and the view keeps its
strides.

Lifetime: the creator unlinks the name when the last tensor using the segment is garbage
collected, or when it exits (normally, or as a multiprocessing child). Mappings outlive
the name, so receivers that already unpickled keep working; one that unpickles after the
unlink gets ``SharedTensorGoneError``. A creator killed by a signal leaves its segments
behind until ``segments.reap_stale()`` (every new shared-memory queue, ``python -m mpx
cleanup``) removes them.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import threading
import weakref
from dataclasses import dataclass

from mpx import _debug
from mpx.errors import DeserializationError, SharedTensorGoneError, ShmError
from mpx.mechanism import segments

_MIN_SEGMENT = 64  # a segment of 0 bytes cannot be mapped (empty tensors)


@dataclass
class _Mapping:
    """One mapping of a segment in this process."""

    name: str
    size: int
    view: weakref.ref  # the memoryview every tensor on this mapping holds, via its storage
    creator_pid: int | None  # the pid that unlinks the name; None for a receiver's mapping


_lock = threading.RLock()  # a finalizer may run in a GC pass inside a locked section
by_base: dict[int, _Mapping] = {}   # base address -> mapping; serde checks it is non-empty
_by_name: dict[str, _Mapping] = {}
_exit_hook_pid = 0


def _torch():
    import torch
    return torch


def _forget(base: int, name: str, creator_pid: int | None) -> None:
    """The last tensor on a mapping was collected (the mapping is gone with it)."""
    with _lock:
        m = by_base.pop(base, None)
        if m is not None and _by_name.get(name) is m:
            del _by_name[name]
    _debug.dec("segments")  # segments.create/attach counted it; the mmap closes as the view goes
    if creator_pid == os.getpid():
        segments.unlink(name)


def _unlink_mine() -> None:
    """At exit: unlink the names of the segments this process created (tensors may live on
    in other processes' mappings)."""
    pid = os.getpid()
    with _lock:
        names = [m.name for m in list(by_base.values()) if m.creator_pid == pid]
    for name in names:
        segments.unlink(name)


def _hook_exit() -> None:
    global _exit_hook_pid
    if _exit_hook_pid == os.getpid():
        return
    _exit_hook_pid = os.getpid()
    atexit.register(_unlink_mine)
    # a forked multiprocessing child leaves through os._exit, skipping atexit, but it runs
    # multiprocessing's own exit finalizers first
    multiprocessing.util.Finalize(None, _unlink_mine, exitpriority=0)


def _register(name: str, mm, creator_pid: int | None):
    """A flat uint8 tensor over all of ``mm``, with the mapping registered."""
    torch = _torch()
    view = memoryview(mm)
    flat = torch.frombuffer(view, dtype=torch.uint8)
    base = flat.data_ptr()
    m = _Mapping(name, len(mm), weakref.ref(view), creator_pid)
    weakref.finalize(view, _forget, base, name, creator_pid).atexit = False
    with _lock:
        by_base[base] = m
        _by_name[name] = m
    return flat


def share(tensor):
    """A CPU tensor equal to ``tensor`` whose memory is an mpx shared-memory segment.

    Sending it (or any view of it) through an mpx queue or executor whose readers all use
    the shared-memory ring sends a reference, not the bytes: receivers map the same memory,
    and writes on any side are visible to all. Queues with ZeroMQ readers send a copy.
    A tensor that already lives in such a segment is returned as it is; any other one
    (also one that torch put in shared memory with ``share_memory_()``) is copied once.
    dtype, shape, ``requires_grad`` and ``nn.Parameter`` are kept; the result is contiguous.

    Keep the returned tensor (or a view of it) alive until every receiver has dequeued it:
    the segment's name is unlinked when the last tensor on it is garbage collected or this
    process exits, and a receiver that unpickles later gets ``mpx.SharedTensorGoneError``.
    Raises TypeError for a non-tensor, ValueError for a tensor not on the CPU or not
    strided, ``mpx.ShmError`` when /dev/shm lacks room.
    """
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"mpx.share takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"mpx.share takes CPU tensors, got one on {tensor.device}; CUDA tensors "
                         "already travel by CUDA IPC handle between processes of one node")
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise ValueError(f"mpx.share takes dense strided tensors, got layout {tensor.layout}"
                         f"{' (quantized)' if tensor.is_quantized else ''}"
                         f"{' (nested)' if tensor.is_nested else ''}")
    if locate(tensor) is not None:
        return tensor
    src = tensor.detach().resolve_conj().resolve_neg()
    nbytes = src.numel() * src.element_size()
    size = max(nbytes, _MIN_SEGMENT)
    free = segments.free_bytes()
    if size > free:
        raise ShmError(f"mpx.share needs {size} bytes of shared memory but /dev/shm has only "
                       f"{free} bytes free; enlarge it (e.g. docker --shm-size)")
    name, mm = segments.create(size)
    try:
        flat = _register(name, mm, os.getpid())
    except BaseException:
        segments.unlink(name)
        raise
    _hook_exit()
    out = flat[:nbytes].view(src.dtype).view(src.shape)
    out.copy_(src)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=tensor.requires_grad)
    return out.requires_grad_(tensor.requires_grad)


def locate(tensor) -> _Mapping | None:
    """The mpx segment mapping ``tensor``'s storage starts at, if any."""
    if not by_base:
        return None
    return by_base.get(tensor.untyped_storage().data_ptr())


def reference(tensor) -> tuple | None:
    """The arguments of :func:`rebuild` for ``tensor``, or None if it is not in a segment."""
    m = locate(tensor)
    if m is None:
        return None
    torch = _torch()
    offset = tensor.storage_offset() * tensor.element_size()
    return (m.name, m.size, offset, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
            tensor.requires_grad, isinstance(tensor, torch.nn.Parameter))


def _attach(name: str, size: int):
    """A flat uint8 tensor over this process's mapping of ``name`` (mapped now if needed)."""
    torch = _torch()
    with _lock:
        m = _by_name.get(name)
        view = m.view() if m is not None else None
    if view is not None:
        return torch.frombuffer(view, dtype=torch.uint8)
    try:
        mm = segments.attach(name)
    except ShmError as e:
        raise SharedTensorGoneError(
            f"the shared-memory segment {name} of a tensor sent with mpx.share() no longer "
            "exists: the sender freed the tensor or exited before this receiver unpickled it "
            "(keep the shared tensor alive until every receiver has it)", name) from e
    if len(mm) < size:
        segments.close(mm)
        raise DeserializationError(f"shared-memory segment {name} has {len(mm)} bytes, "
                                   f"the sender's has {size}: not the same segment")
    return _register(name, mm, None)


def rebuild(name: str, size: int, offset: int, dtype, shape: tuple, strides: tuple,
            requires_grad: bool, is_param: bool):
    """The receiver's tensor over the sender's memory (the inverse of :func:`reference`)."""
    torch = _torch()
    itemsize = torch.empty((), dtype=dtype).element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
    if offset < 0 or offset % itemsize or offset + extent * itemsize > size:
        raise DeserializationError(f"a shared tensor's view (offset {offset}, shape {shape}, "
                                   f"strides {strides}) does not fit segment {name}")
    flat = _attach(name, size)
    usable = (size - offset) // itemsize * itemsize
    t = torch.as_strided(flat[offset:offset + usable].view(dtype), shape, strides)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)
