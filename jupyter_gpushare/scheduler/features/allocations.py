"""Per-allocation sockets: a Kubernetes pod's GPU memory ceiling that the pod cannot change.

The device plugin (jupyter_gpushare/deviceplugin) answers the kubelet's Allocate by asking the
scheduler, over its control socket, for an *allocation*: a ceiling in bytes and the unit IDs the
kubelet chose. The scheduler opens one more listening socket for it,
``<allocation_dir>/<id>/<socket name>``, and the device plugin mounts that directory (read-only)
into the container where the shared socket directory used to go. Every connection accepted on
that socket carries the allocation's ceiling: the quota a shim gets there is at most the ceiling
whatever its HELLO declares (GPUSHARE_MEMORY_LIMIT unset or raised changes nothing), and a
``set_quota`` cannot lift it either. Which socket a connection came in on is the kernel's word
(the listener's address), so nothing the pod sends or unsets moves it, and no /proc parsing is
needed (docs/architecture.md, "GPU memory ceilings from Kubernetes", says why this design).

Lifetime. The kubelet never says that a pod is gone, but it never gives one unit to two live
pods: when an allocation asks for units that an older one holds, the older one's pod is gone and
it is retired (listener closed, socket and directory removed). Live allocations are therefore
pairwise disjoint, so there are never more of them than units. Sooner than that, the device plugin
reports which units live pods hold (the kubelet's pod-resources API) with ``prune_allocations``:
an allocation that no live pod holds and no client uses, continuously for the grace period the
plugin gives, is retired too (:func:`prunable`). Allocations survive a scheduler
restart: they are written to ``<state_dir>/allocations.json`` (directory 0700, file 0600) and
their sockets are opened again, in the same directories, on start; a container's bind mount of
the directory sees the new socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ...protocol import ErrorCode, Message, MsgType
from ..shell.transport import Connection, LogLimiter, SocketFile, listen
from ..shell.users import Identity

__all__ = [
    "Allocation",
    "AllocationControl",
    "AllocationRequest",
    "AllocationSockets",
    "AllocationStore",
    "cap_quota",
    "check_allocation_request",
    "confined",
    "prunable",
    "superseded",
]

#: The control actions the device plugin sends: open one (body: ceiling, units); retire those no
#: live pod holds (body: held, the units live pods hold; grace, seconds).
ACTION = "allocate"
PRUNE = "prune_allocations"
STATE_FILE = "allocations.json"
OnConnection = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass(frozen=True)
class Allocation:
    """One Allocate of the device plugin: its socket directory's name, ceiling and units."""

    id: str
    ceiling: int
    units: tuple[str, ...]


@dataclass(frozen=True)
class AllocationRequest:
    ceiling: int
    units: tuple[str, ...]


# -- pure -------------------------------------------------------------------------------------


def cap_quota(quota: int, ceiling: int) -> int:
    """The quota under an allocation's ``ceiling`` (0: none): a client may ask for less, never
    for more, and asking for nothing (0) gets the ceiling."""
    if ceiling <= 0:
        return quota
    return ceiling if quota <= 0 else min(quota, ceiling)


def confined(ident: Identity, conn: Connection) -> Identity:
    """A peer on an allocation's socket is a pod's: never an admin, whatever its uid (a pod
    running as root is uid 0 on the node without user namespaces)."""
    return replace(ident, admin=False) if conn.allocation and ident.admin else ident


def check_allocation_request(body: Any) -> AllocationRequest | str:
    """The ``allocate`` control body, checked; or why it is refused."""
    ceiling = body.get("ceiling") if isinstance(body, dict) else None
    units = body.get("units") if isinstance(body, dict) else None
    if not isinstance(ceiling, int) or isinstance(ceiling, bool) or ceiling <= 0:
        return "'ceiling' must be a positive number of bytes"
    if not isinstance(units, list) or not units or not all(isinstance(u, str) for u in units):
        return "'units' must be a non-empty list of unit IDs"
    return AllocationRequest(ceiling, tuple(units))


def prunable(
    allocations: Iterable[Allocation],
    held: Iterable[str],
    busy: Iterable[str],
    now: float,
    grace: float,
    unheld_since: dict[str, float],
) -> tuple[list[str], dict[str, float]]:
    """The allocations to retire, and since when each of the others has been unheld.

    ``held``: the units live pods hold; ``busy``: allocations with a client connected. One that
    is neither held nor busy is retired once it has been so, at every look, for ``grace``
    seconds since the first look that found it so (a pod the kubelet has not recorded yet, or a
    kubelet that restarts and lists nothing for a moment, does not lose its allocation)."""
    held_units, busy_ids = set(held), set(busy)
    retire: list[str] = []
    since: dict[str, float] = {}
    for alloc in allocations:
        if alloc.id in busy_ids or held_units.intersection(alloc.units):
            continue
        first = unheld_since.get(alloc.id, now)
        if now - first >= grace:
            retire.append(alloc.id)
        else:
            since[alloc.id] = first
    return retire, since


def superseded(allocations: Iterable[Allocation], units: Iterable[str]) -> list[str]:
    """The allocations holding any of ``units``: the kubelet gives a unit to one live pod at a
    time, so their pods are gone."""
    wanted = set(units)
    return [a.id for a in allocations if wanted.intersection(a.units)]


# -- persistence (blocking: run in an executor) -----------------------------------------------


@dataclass(frozen=True)
class AllocationStore:
    """``allocations.json`` in the scheduler's private state directory."""

    state_dir: str

    @property
    def path(self) -> str:
        return os.path.join(self.state_dir, STATE_FILE)

    def load(self) -> list[Allocation]:
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            return []
        return [
            Allocation(str(a["id"]), int(a["ceiling"]), tuple(map(str, a["units"])))
            for a in doc.get("allocations", [])
        ]

    def save(self, allocations: Iterable[Allocation]) -> None:
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)  # private: the ceilings are the node's promises
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"allocations": [asdict(a) for a in allocations]}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


# -- the sockets ------------------------------------------------------------------------------


class AllocationSockets:
    """The allocations' listeners; each accepted connection is told its allocation through
    :meth:`lookup` (the scheduler calls it with the connection's local address)."""

    def __init__(self, allocation_dir: str, state_dir: str, socket_name: str, log: Any) -> None:
        self.allocation_dir = allocation_dir
        self.store = AllocationStore(state_dir)
        self.socket_name = socket_name
        self.log = log
        self.allocations: dict[str, Allocation] = {}
        self._servers: dict[str, tuple[asyncio.AbstractServer, SocketFile]] = {}
        self._by_address: dict[str, str] = {}  # listener's bound address -> allocation id
        self._on_connection: OnConnection | None = None
        self._unheld_since: dict[str, float] = {}  # allocation id -> monotonic time (prunable)
        self._lock = asyncio.Lock()

    def directory(self, alloc_id: str) -> str:
        return os.path.join(self.allocation_dir, alloc_id)

    def lookup(self, address: Any) -> Allocation | None:
        """The allocation whose socket accepted a connection of local ``address``."""
        alloc_id = self._by_address.get(address) if isinstance(address, str) else None
        return None if alloc_id is None else self.allocations.get(alloc_id)

    async def start(self, on_connection: OnConnection) -> None:
        """Open the persisted allocations' sockets again (a restart must not lose a ceiling)."""
        self._on_connection = on_connection
        loop = asyncio.get_running_loop()
        try:
            persisted = await loop.run_in_executor(None, self.store.load)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Fail closed: the pods of a lost allocation find no socket, not one without ceiling.
            self.log.error("allocations: cannot read %s: %s", self.store.path, exc)
            persisted = []
        for alloc in persisted:
            self.allocations[alloc.id] = alloc
            try:
                await self._listen(alloc)
            except (OSError, RuntimeError) as exc:
                self.log.error("allocation %s: cannot listen again: %s", alloc.id, exc)
        if self.allocations:
            self.log.info(
                "allocations: %d reopened from %s", len(self.allocations), self.store.path
            )

    async def open(self, request: AllocationRequest) -> Allocation:
        """A new allocation (its socket listening, the state saved); the allocations that held
        any of its units are retired first."""
        loop = asyncio.get_running_loop()
        async with self._lock:
            for old in superseded(self.allocations.values(), request.units):
                await self._retire(old, "its units went to a new allocation")
            alloc = Allocation(self._new_id(), request.ceiling, request.units)
            self.allocations[alloc.id] = alloc
            try:
                await self._listen(alloc)
                await loop.run_in_executor(None, self.store.save, self.allocations.values())
            except BaseException:
                await self._retire(alloc.id)
                raise
        self.log.info(
            "allocation %s: ceiling %d bytes, %d unit(s), socket %s",
            alloc.id,
            alloc.ceiling,
            len(alloc.units),
            self.directory(alloc.id),
        )
        return alloc

    def _new_id(self) -> str:
        """A fresh directory name: short (socket paths are limited to 107 bytes), unguessable
        is not needed (the directory is mounted, not found), unused here and on disk."""
        while True:
            alloc_id = secrets.token_hex(6)
            if alloc_id not in self.allocations and not os.path.lexists(self.directory(alloc_id)):
                return alloc_id

    async def prune(self, held: list[str], busy: set[str], grace: float) -> list[str]:
        """Retire the allocations :func:`prunable` names; their ids."""
        async with self._lock:
            retire, self._unheld_since = prunable(
                self.allocations.values(), held, busy, time.monotonic(), grace, self._unheld_since
            )
            for alloc_id in retire:
                await self._retire(alloc_id, "no live pod holds its units")
        return retire

    async def _listen(self, alloc: Allocation) -> None:
        assert self._on_connection is not None
        sock_file = SocketFile(
            os.path.join(self.directory(alloc.id), self.socket_name), mode=0o666, dir_mode=0o755
        )
        server, _ = await listen(sock_file, self._on_connection, self.log)
        self._servers[alloc.id] = (server, sock_file)
        for sock in server.sockets:
            self._by_address[sock.getsockname()] = alloc.id

    async def _retire(self, alloc_id: str, why: str = "its socket could not open") -> None:
        self.allocations.pop(alloc_id, None)
        self._by_address = {k: v for k, v in self._by_address.items() if v != alloc_id}
        await self._close(alloc_id)
        directory = self.directory(alloc_id)

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(directory):
                    os.unlink(os.path.join(directory, name))
                os.rmdir(directory)
            self.store.save(self.allocations.values())

        await asyncio.get_running_loop().run_in_executor(None, remove)
        self.log.info("allocation %s retired: %s", alloc_id, why)

    async def _close(self, alloc_id: str) -> asyncio.AbstractServer | None:
        entry = self._servers.pop(alloc_id, None)
        if entry is None:
            return None
        server, sock_file = entry
        server.close()
        await asyncio.get_running_loop().run_in_executor(None, sock_file.remove)
        return server

    async def stop(self) -> None:
        """Stop listening; the directories stay (containers' mounts point at them) and the
        state file keeps the ceilings for the next start."""
        for alloc_id in list(self._servers):
            await self._close(alloc_id)
        self._by_address.clear()


# -- the scheduler's part ---------------------------------------------------------------------


class AllocationControl:
    """The ``allocate`` control action and the allocations' sockets; mixed into the scheduler,
    whose state it reads (below)."""

    log: Any
    _log_limit: LogLimiter
    socket_path: str
    allocation_dir: str
    state_dir: str
    _connections: dict[int, Connection]
    _allocation_sockets: AllocationSockets | None = None

    @property
    def allocation_sockets(self) -> AllocationSockets:
        if self._allocation_sockets is None:
            base = os.path.dirname(self.socket_path) or "."
            self._allocation_sockets = AllocationSockets(
                self.allocation_dir or os.path.join(base, "alloc"),
                self.state_dir or os.path.join(base, "state"),
                os.path.basename(self.socket_path),
                self.log,
            )
        return self._allocation_sockets

    def accepted_on(self, address: Any) -> tuple[str, int]:
        """(allocation id, ceiling) of a connection of local ``address``; ("", 0) for the
        shared socket."""
        alloc = self.allocation_sockets.lookup(address)
        return ("", 0) if alloc is None else (alloc.id, alloc.ceiling)

    def _refused(self, conn: Connection, who: Identity, what: str) -> bool:
        """Refuse (FORBIDDEN) anyone but an admin on the node's own socket: the device plugin."""
        if who.admin and not conn.allocation:
            return False
        text = f"{who.user} may not {what}: admins on the node's own socket only"
        self._log_limit.warning(conn.peer.uid, "forbidden: %s", text)
        conn.error(ErrorCode.FORBIDDEN, text, self.log)
        return True

    async def _on_allocate(self, conn: Connection, who: Identity, body: Any) -> None:
        """Open an allocation for the device plugin (an admin on the shared socket only)."""
        if self._refused(conn, who, "allocate"):
            return
        request = check_allocation_request(body)
        if isinstance(request, str):
            conn.error(ErrorCode.BAD_REQUEST, request, self.log)
            return
        try:
            alloc = await self.allocation_sockets.open(request)
        except (OSError, RuntimeError) as exc:
            self.log.error("allocation failed: %s", exc)
            text = f"cannot open the allocation's socket: {exc}"
            conn.error(ErrorCode.BAD_REQUEST, text, self.log)
            return
        reply = {
            "ok": True,
            "action": ACTION,
            "allocation": alloc.id,
            "ceiling": alloc.ceiling,
            "directory": self.allocation_sockets.directory(alloc.id),
            "socket": self.allocation_sockets.socket_name,
        }
        conn.send(Message(MsgType.CONTROL_REPLY, {"body": reply}), self.log)

    async def _on_prune_allocations(self, conn: Connection, who: Identity, body: Any) -> None:
        """Retire the allocations no live pod holds (the device plugin's look at the kubelet)."""
        if self._refused(conn, who, "prune allocations"):
            return
        held = body.get("held") if isinstance(body, dict) else None
        grace = body.get("grace") if isinstance(body, dict) else None
        if not isinstance(held, list) or not all(isinstance(u, str) for u in held):
            conn.error(ErrorCode.BAD_REQUEST, "'held' must be a list of unit IDs", self.log)
            return
        if not isinstance(grace, (int, float)) or isinstance(grace, bool) or grace < 0:
            conn.error(ErrorCode.BAD_REQUEST, "'grace' must be seconds (0 or more)", self.log)
            return
        busy = {c.allocation for c in self._connections.values() if c.allocation and not c.closed}
        retired = await self.allocation_sockets.prune(held, busy, float(grace))
        reply = {"ok": True, "action": PRUNE, "retired": retired,
                 "allocations": len(self.allocation_sockets.allocations)}  # fmt: skip
        conn.send(Message(MsgType.CONTROL_REPLY, {"body": reply}), self.log)
