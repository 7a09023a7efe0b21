"""Checks of the paths and network addresses a :class:`mpx.Config` holds, run when it is
built: each returns why a value is refused (``Config`` names the field), or None.

What they judge is the value and the directories it names; binding is the proof, and mpx
binds what it can (the stats socket, a queue's or the leader's port) before any worker
starts."""

from __future__ import annotations

import errno
import ipaddress
import os
import re

# sockaddr_un.sun_path is 108 bytes on Linux, the last one the path's terminating NUL
UNIX_PATH_MAX = 107

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")


def nul_byte(value: str) -> str | None:
    """Refuses a string that holds a NUL byte (no path or address can)."""
    return "holds a NUL byte" if "\0" in value else None


def unix_socket_path(path: str) -> str | None:
    """Refuses a path a Unix socket can never be bound at: too long, or in a directory that
    does not exist. (What is at the path is judged at bind, before any worker starts: mpx
    replaces only a stale socket of its own.)"""
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX:
        return (f"is {size} bytes long, and a Unix socket's path holds at most "
                f"{UNIX_PATH_MAX}: choose a shorter one (under /tmp or $XDG_RUNTIME_DIR)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"is in {parent!r}, which is not an existing directory: create it first"
    return None


def host(value: str) -> str | None:
    """Refuses what is not one IP address or host name: empty, several words (``hostname
    -i`` prints every address of a host), a dotted quad out of range (``256.1.1.1``), or
    a name no DNS label allows."""
    if not value:
        return "is empty: give an IP address or a host name"
    if any(c.isspace() for c in value):
        return ("holds several words (`hostname -i` can print several addresses): give one "
                "address")
    bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    labels = value.rstrip(".").split(".")
    kind: type = ipaddress.IPv6Address if ":" in bare else ipaddress.IPv4Address
    try:
        kind(bare)
        return None
    except ValueError as e:
        if kind is ipaddress.IPv6Address or all(label.isdigit() for label in labels):
            return f"is not a valid IP address ({e})"
    if len(value) > 253 or not all(_LABEL.match(label) for label in labels):
        return "is neither an IP address nor a valid host name"
    return None


def bind_failed(fields: str, address: str, error: Exception) -> OSError:
    """The error of a socket that could not be bound at ``address``, which ``fields``
    (Config fields and their variables) gave: what failed, and what to do."""
    code = getattr(error, "errno", None)
    text = getattr(error, "strerror", None) or str(error)
    hint = ("another process (an executor or leader still running?) uses it: stop it or "
            "choose another" if code == errno.EADDRINUSE else
            "give an address of this node (`ip -brief address` lists them)")
    return OSError(code, f"cannot bind {address} ({fields}): {text}; {hint}")
