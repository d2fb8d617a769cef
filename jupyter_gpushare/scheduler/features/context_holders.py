"""Which processes may hold a client's CUDA context: what an operator's forced evict checkpoints
(:meth:`.sleeping.DeepIdleShell._force_evict`).

The pid that said ``HELLO`` (``SO_PEERCRED``) need not be the one that holds the context: a
holder may fork a child that makes the context and keeps the socket, and a checkpoint of the
parent then finds nothing to take ("cuCheckpointProcessLock failed") while the child keeps the
GPU. So the candidates are the peer's process and its descendants (``/proc``'s parent links),
and, where NVML lists the device's processes, those of them that run as the peer's uid in the
peer's session (a child that left the tree by a double fork keeps its session). Only processes
of the peer's uid are ever named; the driver (or the agent, for its own user's) decides the rest.

Blocking (it reads ``/proc``): the shell calls it in an executor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["MAX_CANDIDATES", "context_holders", "process_tree"]

#: The most processes a forced evict tries (a holder's tree is a few processes).
MAX_CANDIDATES = 64


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of ``pid`` from ``/proc``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(fields[1]), int(fields[3])
    except (IndexError, ValueError):
        return None


def _uid(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def process_tree(root: int, uid: int, limit: int = MAX_CANDIDATES) -> list[int]:
    """``root`` and its descendants that run as ``uid``, breadth first (``root`` first when it
    is there and of ``uid``); at most ``limit``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[0], []).append(int(entry))
    out: list[int] = []
    queue = [root] if _stat(root) is not None else []
    seen = set(queue)
    while queue and len(out) < limit:
        pid = queue.pop(0)
        if _uid(pid) == uid:
            out.append(pid)
        for child in sorted(children.get(pid, [])):
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return out


def context_holders(peer_pid: int, uid: int, listed: Iterable[int] = ()) -> list[int]:
    """The processes a forced evict of the client of ``peer_pid`` (run as ``uid``) tries, in
    order: those NVML lists on its device (``listed``) first, of its tree or its session, then
    the rest of its tree. Empty when the peer's process and its tree are gone and NVML lists
    none of its session."""
    tree = process_tree(peer_pid, uid)
    peer = _stat(peer_pid)
    session = peer[1] if peer is not None else None
    on_device = []
    for pid in listed:
        st = _stat(pid)
        mine = pid in tree or (st is not None and session is not None and st[1] == session)
        if mine and _uid(pid) == uid and pid not in on_device:
            on_device.append(pid)
    rest = [pid for pid in tree if pid not in on_device]
    return (on_device + rest)[:MAX_CANDIDATES]
