"""Named POSIX shared-memory segments: create (0600, size-checked), attach, unlink, reap.

The rings' segments (``mpx/transport/shm.py``) and the tensors of ``mpx.share``
(``mpx/protocol/sharing.py``) are made here. Every name mpx creates is
``/mpx-<creator pid>-<random>``, so a later process can tell which segments a dead creator
left behind (``reap_stale``: every new ring, ``python -m mpx cleanup``).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets

import posix_ipc

from mpx import _debug
from mpx._procinfo import files_of_dead_pids
from mpx._units import human_size
from mpx.errors import ShmError

PREFIX = "mpx-"
_NAME_RE = re.compile(r"^mpx-(\d+)-[0-9a-f]+$")


def new_name() -> str:
    """A fresh segment name carrying this process's pid."""
    return f"/{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def free_bytes(shm_dir: str = "/dev/shm") -> int:
    """Bytes an unprivileged process may still allocate in ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def require_free(size: int, shm_dir: str, what: str) -> None:
    """ShmError unless ``shm_dir`` has ``size`` bytes free for ``what`` (e.g. 'a ring'),
    naming the bytes needed and free and what to do about it."""
    try:
        free = free_bytes(shm_dir)
    except OSError as e:
        raise ShmError(f"cannot check the free space of {shm_dir}: {e}") from e
    if size > free:
        raise ShmError(
            f"{what} needs {size} bytes ({human_size(size)}) of shared memory, but "
            f"{shm_dir} has {free} bytes free ({human_size(free)}); enlarge it (e.g. docker "
            "--shm-size), lower max_chunks / max_chunk_bytes (MPX_MAX_CHUNKS, "
            "MPX_MAX_CHUNK_BYTES), or use transport 'auto' or 'zmq'")


def create(size: int, shm_dir: str = "/dev/shm") -> tuple[str, mmap.mmap]:
    """Create a zero-filled segment of ``size`` bytes, mode 0600, and map it.

    The pages are reserved up front (``posix_fallocate``), so a full /dev/shm is an
    ``ShmError`` here and never a SIGBUS later.
    """
    require_free(size, shm_dir, "a ring")
    name = new_name()
    try:
        seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    except (posix_ipc.Error, OSError) as e:
        raise ShmError(f"cannot create shared-memory segment {name} ({size} bytes): {e}") from e
    try:
        try:
            os.posix_fallocate(seg.fd, 0, size)
        except OSError as e:
            raise ShmError(
                f"cannot reserve {size} bytes in {shm_dir} for segment {name}: {e} "
                f"({free_bytes(shm_dir)} bytes free)") from e
        mm = mmap.mmap(seg.fd, size)
    except BaseException:
        unlink(name)
        raise
    finally:
        seg.close_fd()
    _debug.inc("segments")
    return name, mm


def attach(name: str) -> mmap.mmap:
    """Map an existing segment read-write."""
    try:
        seg = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError as e:
        raise ShmError(
            f"shared-memory segment {name} does not exist: its creator died or every reader "
            f"already attached and it was unlinked") from e
    except (posix_ipc.Error, OSError) as e:
        raise ShmError(f"cannot open shared-memory segment {name}: {e}") from e
    try:
        mm = mmap.mmap(seg.fd, seg.size)
    finally:
        seg.close_fd()
    _debug.inc("segments")
    return mm


def close(mm: mmap.mmap) -> None:
    """Unmap a segment that :func:`create` or :func:`attach` mapped."""
    mm.close()
    _debug.dec("segments")


def unlink(name: str) -> bool:
    """Remove ``name`` from the namespace; mappings stay valid. False if already gone."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


# Where Linux keeps POSIX shared memory, whatever Config.shm_dir says about free space.
SHM_ROOT = "/dev/shm"


def stale_segments() -> list[str]:
    """Names of mpx segments whose creator process no longer exists.

    Judged by the pid in the name: a creator in another pid namespace that shares this
    /dev/shm (containers with --ipc=host) looks dead from here, so don't share /dev/shm
    across pid namespaces with mpx.
    """
    return ["/" + os.path.basename(p) for p in files_of_dead_pids(SHM_ROOT, _NAME_RE)]


def reap_stale() -> list[str]:
    """Unlink every mpx segment whose creator is dead; returns the names removed."""
    return [name for name in stale_segments() if unlink(name)]
