"""Shim clients: HELLO, their messages as policy events, and the policy's decisions as frames.

:class:`ShimSessions` is the part of :class:`~.server.GPUShareScheduler` that speaks to shims:
a HELLO is checked by :mod:`.translate`, its peer identified by :mod:`.access` (quota ceilings
and weights applied), then joins the policy under a client id that is unique among live shims
(docs/protocol.md, "Duplicate client ids"); each later message becomes one policy event, and
each decision one GRANT/REVOKE/EVICT frame.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..._version import __version__
from ...protocol import ErrorCode, Message, MsgType
from ...units import format_size
from ..core import events as ev
from ..features import nvml_check as nc
from ..features.allocations import cap_quota, confined
from ..features.mps import MPSManager
from . import translate as tr
from .access import Access
from .kernel_ids import MAX_SECRET, Binding, IdOwners, KernelIds, bound_id, secret_digest
from .metrics_feed import MetricsFeed
from .peer_process import PeerProcess
from .resume import KeptState, ResumeKey
from .transport import Connection, LogLimiter, PeerCred
from .users import Identity, Limits

__all__ = ["ShimSessions"]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


_NOBODY = Binding("?", "")


def _bytes(n: int) -> str:
    return f"bytes={n} ({format_size(n)})"


def _asked(n: int) -> str:
    """What an eviction asks to free (REVOKE/EVICT evict_bytes): the logged ``bytes`` are the
    client's managed memory, not the ask."""
    return f"asked={format_size(n) if n > 0 else 'all'}"


class ShimSessions:
    """Shim clients' sessions; mixed into the scheduler, whose state it reads (below)."""

    # What the scheduler provides (see server.py).
    log: Any
    access: Access
    metrics: Any
    base_quantum: float
    revoke_warning_seconds: float
    revoke_deadline_seconds: float
    revoke_signal: str
    revoke_signal_grace: float
    _mps: MPSManager | None
    _spawn: Callable[[Any], None]
    _stopping: bool
    _shims: dict[str, Connection]
    _device_totals: dict[str, int]
    _resume_key: ResumeKey
    _kept: KeptState | None
    #: client id -> the user whose client last had it (each user's bounded on its own)
    _id_owners: IdOwners
    _kernel_ids: KernelIds
    _metrics_feed: MetricsFeed
    _handle: Callable[[ev.Event], None]
    _keep_state: Callable[[], None]
    _decide: Callable[[ev.Event], list[ev.Decision]]
    _reschedule: Callable[[], None]
    _deep_idle_holds: Callable[[ev.Decision], bool]
    _device_for_hello: Callable[[tr.Hello, int], str | tr.Refusal]
    _log_limit: LogLimiter
    _device_snapshot: Callable[[str], dict[str, Any] | None]
    limits_for: Callable[[Identity], Limits]
    identify: Callable[[PeerCred, Message], Awaitable[Identity | str]]
    policy: Any
    own_uid: int
    unmanaged_memory: str
    _devices: dict[str, str]
    pool_for: Callable[[int], int]

    #: NVML's last sample of the devices' processes (none yet, or no NVML).
    _last_processes: list[nc.ProcessMemory] = []  # replaced by each sample, never changed

    @property
    def unmanaged_bytes(self) -> dict[str, int]:
        """Lower-case device uuid -> bytes NVML sees held by processes of no client."""
        return self.__dict__.setdefault("_unmanaged_bytes", {})

    @property
    def _unmanaged_seen(self) -> set[tuple[str, int]]:
        return self.__dict__.setdefault("_unmanaged_logged", set())

    @_unmanaged_seen.setter
    def _unmanaged_seen(self, value: set[tuple[str, int]]) -> None:
        self.__dict__["_unmanaged_logged"] = value

    @property
    def _former_clients(self) -> set[tuple[str, int]]:
        """(device, pid) of clients that left and whose process NVML may still list: it
        exits after its GOODBYE, and is no unmanaged process meanwhile."""
        return self.__dict__.setdefault("_former_client_processes", set())

    def _peer_processes(self) -> dict[int, PeerProcess]:
        """Connection serial -> the pidfd of its peer process, taken at HELLO (revoke_signal)."""
        return self.__dict__.setdefault("_peer_process_table", {})

    def _info(self, conn: Connection, msg: str, *args: Any) -> None:
        """An info line a peer's message caused: within its uid's budget (A11)."""
        self._log_limit.info(conn.peer.uid, msg, *args)

    def _send(self, conn: Connection, msg: Message) -> bool:
        return conn.send(msg, self.log)

    def _refuse(self, conn: Connection, refusal: tr.Refusal) -> None:
        conn.error(refusal.code, refusal.text, self.log)

    def _shim_gone(self, conn: Connection, why: str) -> None:
        """The shim's connection is done: Leave at once (its grant and memory go)."""
        if conn.kind != "shim" or conn.left or conn.client_id is None:
            return
        conn.left = True
        if conn.device and conn.peer.pid > 0:
            self._former_clients.add((conn.device.lower(), conn.peer.pid))
        if (process := self._peer_processes().pop(conn.serial, None)) is not None:
            process.close()
        now = time.monotonic()
        self._metrics_feed.account(conn, now)
        if self._shims.get(conn.client_id) is conn:
            del self._shims[conn.client_id]
        if self._stopping:
            return
        held = None if conn.granted_at is None else now - conn.granted_at
        self._info(
            conn,
            "leave client=%s (%s) %s held_ms=%s",
            conn.client_id,
            why,
            _bytes(conn.memory["used"]),
            _ms(held),
        )
        self._handle(ev.Leave(now, conn.client_id))

    def _remember_owner(self, client_id: str, user: str) -> None:
        self._id_owners.remember(client_id, user)

    def _bind_refusal(self, client_id: str, user: str) -> str | None:
        """Why ``user`` may not bind ``client_id`` to a kernel secret (None: it may): the id is
        bound to another user's kernel, a live client of another user holds it (or the same
        kernel's id on another GPU, ``<id>/<n>``), or it is another user's (.kernel_ids)."""
        binding = self._kernel_ids.binding(client_id)
        if binding is not None and binding.user != user:
            return f"the id {client_id!r} is bound to another user's kernel"
        for cid, holder in self._shims.items():
            if bound_id(cid) != client_id or holder.left:
                continue
            if holder.identity is None or holder.identity.user != user:
                return f"the id {client_id!r} is held by a live client of another user"
        owner = self._id_owners.get(client_id)
        if owner is not None and owner != user:
            return f"the id {client_id!r} is another user's"
        return None

    def _memory_cap(self, conn: Connection) -> int:
        """The most a client's memory claim may say: its quota, else its device's size."""
        total = self._device_totals.get((conn.device or "").lower(), 0)
        return min(q for q in (conn.quota, total) if q > 0) if conn.quota or total else 0

    def _resume_secret(self, conn: Connection) -> str:
        """The secret a GRANT gives ``conn``'s shim: bound to the id it asked for, its uid and
        this grant (.resume)."""
        if not conn.grant:
            conn.grant = secrets.token_hex(8)
        return self._resume_key.secret(conn.requested_id, conn.peer.uid, conn.grant)

    def _resume_proven(self, conn: Connection, hello: tr.Hello) -> bool:
        """Does the HELLO prove the hold its id had when the last scheduler stopped? The secret
        of that very grant, kept by the last scheduler (.resume.KeptState); once only."""
        kept = self._kept.find(hello.requested_id, conn.peer.uid) if self._kept else None
        if kept is None or not hello.resume_secret:
            return False
        if not self._resume_key.verify(
            hello.requested_id, conn.peer.uid, kept.grant, hello.resume_secret
        ):
            return False
        conn.grant = kept.grant  # the same hold goes on: the shim's secret stays good
        assert self._kept is not None
        self._kept.clients.remove(kept)
        return True

    def _bounded_resume(self, conn: Connection, hello: tr.Hello) -> tr.Hello:
        """A reconnecting shim's ``since_ms`` cut to what the last scheduler kept of its wait or
        hold (none kept: now): a forged one must not put it ahead of those who waited."""
        if "since" not in hello.resume:
            return hello
        kept = self._kept.find(hello.requested_id, conn.peer.uid) if self._kept else None
        kept_since = kept.since if kept is not None and kept.since is not None else None
        allowed = 0.0 if kept_since is None else max(0.0, time.time() - kept_since)
        since = min(max(0.0, float(hello.resume["since"])), allowed)
        return dataclasses.replace(hello, resume={**hello.resume, "since": since})

    def _disown(self, holder: Connection, why: str) -> None:
        """``holder`` loses its id to the kernel the id is bound to: its connection closes, and
        its shim reconnects as ``<id>#<pid>`` (.kernel_ids)."""
        self._log_limit.warning(
            holder.peer.uid,
            "client id %s is bound to a kernel of user %s: %s loses it (%s)",
            holder.client_id,
            (self._kernel_ids.binding(holder.client_id or "") or _NOBODY).user,
            holder.name,
            why,
        )
        self._shim_gone(holder, "its id is bound to another kernel")
        holder.closed = True
        if holder.writer is not None:
            holder.writer.close()

    def _bound_client_id(self, requested: str, conn: Connection, secret: str) -> str | None:
        """For an id bound to a kernel secret (.kernel_ids): ``<id>#<pid>`` when ``secret``
        does not prove it; None when it does (the id may be this client's), after an unproven
        holder of the id lost it. Also None for an id no kernel secret bound."""
        if self._kernel_ids.binding(requested) is None:
            return None
        conn.id_proven = self._kernel_ids.proves(requested, secret)
        existing = self._shims.get(requested)
        if not conn.id_proven:
            client_id = tr.free_client_id(
                requested, conn.peer.pid, {requested: None, **self._shims}
            )
            self._log_limit.warning(
                conn.peer.uid,
                "client id %s is bound to a kernel secret that the HELLO of %s does not give: "
                "it is %s",
                requested,
                conn.name,
                client_id,
            )
            return client_id
        if existing is not None and not existing.id_proven and existing.peer != conn.peer:
            self._disown(existing, f"the kernel with its secret came: {conn.name}")
        return None

    def _bind_by_hello(self, requested: str, conn: Connection, secret: str) -> None:
        """A kernel whose id nobody bound (its provisioner could not reach the scheduler)
        binds it with the secret its HELLO gives, under a ``bind_kernel``'s rules: never an id
        that another user holds or owns (.kernel_ids)."""
        base = bound_id(requested)
        user = conn.identity.user if conn.identity is not None else ""
        if not secret or len(secret) > MAX_SECRET or not user:
            return
        if self._kernel_ids.binding(base) is not None:
            return
        if self._bind_refusal(base, user) is not None:
            return  # first come, first served, as an id no provisioner bound
        refusal = self._kernel_ids.bind(base, user, secret_digest(secret))
        if refusal is None:
            self._remember_owner(base, user)
            self._info(conn, "bind_kernel client=%s by the HELLO of %s", base, conn.name)
            self._keep_state()

    def _assign_client_id(
        self, requested: str, conn: Connection, proven: bool = False, secret: str = ""
    ) -> str:
        """The id of a new shim asking for ``requested``; ``proven``: its resume secret proves
        that the id was granted to its uid (it wins over whoever took the id since); ``secret``:
        its kernel secret (an id bound to one goes only to a client that gives it; an unbound id
        is bound by it, .kernel_ids)."""
        self._bind_by_hello(requested, conn, secret)
        bound = self._bound_client_id(requested, conn, secret)
        if bound is not None:
            return bound
        proven = proven or conn.id_proven
        existing = self._shims.get(requested)
        user = conn.identity.user if conn.identity is not None else ""
        owner = self._id_owners.get(requested)
        if existing is None and owner not in (None, user) and not proven:
            # The id was last another user's (a kernel restarting, a leaked id): bound to that
            # user, so the newcomer gets its own id and the owner's control actions stay its own.
            client_id = tr.free_client_id(requested, conn.peer.pid, {requested: None})
            self._log_limit.warning(
                conn.peer.uid,
                "client id %s belongs to user %s: the client of %s (pid %d) is %s",
                requested,
                owner,
                user,
                conn.peer.pid,
                client_id,
            )
            return client_id
        if existing is None:
            return requested
        if existing.peer.pid > 0 and existing.peer == conn.peer:
            self._info(conn, "client %s reconnected: the old connection leaves", requested)
            self._shim_gone(existing, "replaced by a reconnection")
            if existing.writer is not None:
                existing.writer.close()
            return requested
        client_id = tr.free_client_id(requested, conn.peer.pid, self._shims)
        self._info(
            conn,
            "client id %s is taken by %s: the new client (pid %d) is %s",
            requested,
            existing.name,
            conn.peer.pid,
            client_id,
        )
        return client_id

    async def _on_hello(self, conn: Connection, msg: Message) -> None:
        assert self.policy is not None
        hello = tr.check_hello(msg, conn.peer.pid)
        if isinstance(hello, tr.Refusal):
            self._refuse(conn, hello)
            return
        # The process that connected, held before anything is awaited (its pid may be reused).
        process = PeerProcess(conn.peer) if self.revoke_signal else None
        ident = await self.identify(conn.peer, msg)
        if conn.closed or self._stopping:
            return
        if isinstance(ident, str):
            self._log_limit.warning(conn.peer.uid, "refused HELLO of %s: %s", conn.name, ident)
            conn.error(ErrorCode.FORBIDDEN, ident, self.log)
            conn.closed = True  # the reader loop ends and closes the socket after the ERROR
            return
        device = self._device_for_hello(hello, conn.peer.uid)
        if isinstance(device, tr.Refusal):
            self._log_limit.warning(
                conn.peer.uid, "refused HELLO of %s: %s", conn.name, device.text
            )
            self._refuse(conn, device)
            return
        conn.identity = ident = confined(ident, conn)
        hello = self._bounded_resume(conn, hello)
        proven = self._resume_proven(conn, hello)
        client_id = self._assign_client_id(hello.requested_id, conn, proven, hello.kernel_secret)
        conn.kind, conn.client_id, conn.device = "shim", client_id, device
        conn.requested_id = hello.requested_id
        if process is not None:
            self._peer_processes()[conn.serial] = process
        self._shims[client_id] = conn
        self._remember_owner(client_id, ident.user)
        limits = self.limits_for(ident)
        conn.requested_quota, conn.requested_weight = hello.quota, hello.weight
        conn.context_bytes = hello.context_bytes
        quota = conn.quota = cap_quota(limits.effective_quota(hello.quota), conn.ceiling)
        if quota != hello.quota:
            self._info(
                conn,
                "quota of client=%s user=%s clamped to its ceiling %s (asked %s)",
                client_id,
                ident.user,
                format_size(quota),
                format_size(hello.quota) if hello.quota else "none",
            )
        weight = round(limits.effective_weight(hello.weight) * 1000) / 1000.0
        join = hello.join(
            time.monotonic(), client_id, device, ident.user, conn.peer.uid, weight, quota
        )
        if hello.memory:  # a reconnecting shim's memory: bounded as every later claim
            memory = tr.bounded_memory(hello.memory, self._memory_cap(conn))
            conn.memory.update(memory)
            join = dataclasses.replace(join, **memory)
        self._info(
            conn,
            "join client=%s device=%s user=%s uid=%d pid=%d quota=%s weight=%.3g label=%r shim=%s",
            client_id,
            device,
            ident.user,
            conn.peer.uid,
            hello.pid,
            format_size(quota) if quota else "none",
            weight,
            hello.label,
            hello.version,
        )
        if hello.resume.get("resume") == "holding" and not proven:
            # Unproven, a holding claim would let anyone take the grant during the recovery
            # window (docs/reliability.md): it waits like any other client instead.
            self._log_limit.warning(
                conn.peer.uid,
                "resume client=%s uid=%d: its claim to hold the device has no valid "
                "resume_secret; it waits",
                client_id,
                conn.peer.uid,
            )
            join = dataclasses.replace(join, resume="waiting")
        if hello.resume:
            self._info(conn, "resume client=%s %s", client_id, hello.resume)
        rest: list[ev.Decision] = []
        resumed = 0
        for decision in self._decide(join):
            if isinstance(decision, ev.Grant) and decision.client == client_id:
                # A resumed grant: the WELCOME says so (resume = 1); no GRANT follows.
                resumed = 1
                conn.granted_at = time.monotonic()
                self._info(conn, "grant client=%s resumed", client_id)
            else:
                rest.append(decision)
        dev = self._device_snapshot(device)
        base_ms = int(self.base_quantum * 1000)
        quantum_ms = int(dev.get("quantum_ms", base_ms)) if dev else 0
        welcome = {
            "pool_bytes": int(dev.get("pool_bytes", 0)) if dev else 0,
            "quota": quota,
            "quantum_ms": quantum_ms or base_ms,
            "version": __version__,
        }
        if "resume" in hello.resume:
            welcome["resume"] = resumed
        if resumed:
            welcome["resume_secret"] = self._resume_secret(conn)
        self._send(conn, Message(MsgType.WELCOME, welcome))
        self._execute(rest)
        if host := tr.host_event(msg, client_id, time.monotonic(), conn.memory["used"]):
            self._handle(host)  # a reconnecting shim's host memory
        self._reschedule()

    def _on_shim_message(self, conn: Connection, client_id: str, msg: Message) -> None:
        now = time.monotonic()
        cap = self._memory_cap(conn)
        event = tr.shim_event(msg, client_id, now, conn.memory, cap)
        if isinstance(event, ev.Leave):
            self.log.debug("goodbye client=%s", client_id)
            self._shim_gone(conn, "goodbye")
            return
        conn.memory.update(tr.memory_after(conn.memory, msg, cap))
        if (host := tr.host_event(msg, client_id, now, conn.memory["used"])) is not None:
            self._handle(host)  # first: the event's decisions weigh the host memory it says
            if self.log.isEnabledFor(logging.DEBUG) and self.policy is not None:
                held = self.policy.host_snapshot()["held_bytes"]
                self.log.debug("host client=%s %s node_held=%d", client_id, _bytes(host.host), held)
        if isinstance(event, ev.Released | ev.Evicted | ev.Restored):
            conn.moved_at = now  # NVML's readings before now say nothing of its residency
        if conn.observed and isinstance(event, ev.Request | ev.Memory):
            # Never less than NVML last saw its process hold (.nvml_check).
            mem = nc.corrected(conn.memory, conn.observed, conn.observed_at > conn.moved_at)
            event = dataclasses.replace(
                event, used=mem["used"], pinned=mem["pinned"], evicted=mem["evicted"]
            )
        if isinstance(event, ev.Request):
            if conn.requested_at is None:
                conn.requested_at = now
            self.log.debug("request client=%s %s", client_id, _bytes(event.used))
        elif isinstance(event, ev.Released):
            moved, ms = event.bytes_moved, event.micros / 1000.0
            held = None if conn.granted_at is None else now - conn.granted_at
            self._info(
                conn,
                "release client=%s evicted=%d %s ms=%.1f held_ms=%s",
                client_id,
                int(event.evicted),
                _bytes(moved),
                ms,
                _ms(held),
            )
            if event.evicted:
                self._info(
                    conn, "evicted client=%s %s ms=%.1f (on release)", client_id, _bytes(moved), ms
                )
            self._metrics_feed.account(conn, now)
            if self.metrics is not None:
                self.metrics.released(
                    conn.device or "", conn.revoking, moved if event.evicted else 0
                )
            conn.granted_at = conn.accounted_at = conn.revoked_at = None
            conn.revoking = conn.overdue = False
        elif isinstance(event, ev.Idle):
            self.log.debug("idle client=%s idle_ms=%s", client_id, msg.get("idle_ms", 0))
        elif isinstance(event, ev.Precopied):
            self._info(
                conn,
                "precopied client=%s %s ms=%.1f valid=%s",
                client_id,
                _bytes(event.bytes_moved),
                event.micros / 1000.0,
                _bytes(event.precopied),
            )
        elif isinstance(event, (ev.Evicted, ev.Restored)):
            # The scheduler's log and metrics name the two directions of a move.
            evict = isinstance(event, ev.Evicted)
            if not evict:  # a restore ahead may leave some on the host (no room): it says so
                ahead = isinstance(event, ev.Restored) and event.ahead
                conn.memory["evicted"] = max(0, event.evicted_bytes) if ahead else 0
            done = "evicted" if evict else "restored"
            ms = event.micros / 1000.0
            if isinstance(event, ev.Evicted) and not event.ok:
                self._log_limit.warning(
                    conn.peer.uid,
                    "eviction failed client=%s: its memory stays counted on the device",
                    client_id,
                )
            else:
                self._info(
                    conn, "%s client=%s %s ms=%.1f", done, client_id, _bytes(event.bytes_moved), ms
                )
            if self.metrics is not None:
                direction = "evict" if evict else "restore"
                self.metrics.moved(conn.device or "", direction, event.bytes_moved)
        self._handle(event)

    def _cross_check_memory(
        self, processes: list[nc.ProcessMemory], taken: float | None = None
    ) -> None:
        """Count each client as using at least what NVML sees its process hold on its device
        (:mod:`.nvml_check`); called with each NVML sample (``taken``: when its reading
        started, monotonic), on the loop."""
        self._last_processes = processes  # a forced evict's candidates (features/sleeping.py)
        shims = [c for c in self._shims.values() if c.client_id and c.device and not c.left]
        claims = [
            nc.ClientClaim(
                c.client_id or "",
                (c.device or "").lower(),
                c.peer.pid,
                c.peer.uid,
                c.memory["used"],
            )
            for c in shims
        ]
        seen = nc.observed(claims, processes)
        # A client that left is forgotten once NVML no longer lists its pid (which may be gone
        # from /proc already, so the pid alone tells).
        self._former_clients.intersection_update({(p.device, p.pid) for p in processes})
        others = [p for p in processes if (p.device, p.pid) not in self._former_clients]
        self._count_unmanaged(nc.unmanaged(claims, others))
        now = time.monotonic()
        taken = now if taken is None else taken
        for conn in shims:
            client_id = conn.client_id or ""
            before = nc.corrected(conn.memory, conn.observed, conn.observed_at > conn.moved_at)
            conn.observed, conn.observed_at = seen.get(client_id, 0), taken
            residency = taken > conn.moved_at
            after = nc.corrected(conn.memory, conn.observed, residency)
            if after == before:
                continue
            claimed = nc.on_device(conn.memory) if residency else conn.memory["used"]
            level = nc.under_claim(claimed, conn.observed, conn.context_bytes)
            if level > conn.claim_logged:  # once per client and level
                conn.claim_logged = level
                # A warning (within its uid's budget) when the context cannot explain it.
                limited = self._log_limit.log_for(conn.peer.uid)
                log = limited.warning if level > 1 else limited.info
                log(
                    "memory claim corrected client=%s uid=%d pid=%d claimed=%d nvml=%d: counted "
                    "as %s",
                    client_id,
                    conn.peer.uid,
                    conn.peer.pid,
                    claimed,
                    conn.observed,
                    format_size(after["used"]),
                )
            used, managed, pinned, evicted = (after[k] for k in nc.MEMORY_KEYS)
            self._handle(ev.Memory(now, client_id, used, managed, pinned, evicted))

    def _count_unmanaged(self, found: dict[str, list[nc.ProcessMemory]]) -> None:
        """GPU processes that never registered (``unmanaged_memory``): shown in the status,
        logged once each, and with "count" taken off their device's pool while NVML sees them."""
        if self.policy.recovering(time.monotonic()):
            # Just restarted: the GPU processes NVML lists are the previous run's clients, which
            # come back within the window. Counted as unmanaged, they shrank the pool a
            # resuming holder's WELCOME gives its shim, and its next allocation failed there
            # (H100, tests/gpu/test_gpu_reliability.py: 24 GiB less 15.1 GiB under 14.5 GiB).
            return
        # Under MPS, the control daemon the scheduler started is no one's client.
        mps_uid = self.own_uid if self._mps is not None else None
        totals: dict[str, int] = {}
        for device, procs in found.items():
            if device not in self._devices:
                continue
            procs = [p for p in procs if p.uid != mps_uid or mps_uid is None]
            totals[device] = sum(p.used for p in procs)
            for proc in procs:
                if self.unmanaged_memory == "ignore" or (device, proc.pid) in self._unmanaged_seen:
                    continue
                self._unmanaged_seen.add((device, proc.pid))
                self._log_limit.log_for(proc.uid).warning(
                    "unmanaged GPU process pid=%d uid=%d on %s holds %s (%s)",
                    proc.pid,
                    proc.uid,
                    self._devices[device],
                    format_size(proc.used),
                    "counted against the pool"
                    if self.unmanaged_memory == "count"
                    else "not counted",
                )
        self._unmanaged_seen &= {(d, p.pid) for d, procs in found.items() for p in procs}
        changed = False
        for device in set(totals) | set(self.unmanaged_bytes):
            now_bytes = totals.get(device, 0)
            if self.unmanaged_bytes.get(device, 0) == now_bytes:
                continue
            if now_bytes:
                self.unmanaged_bytes[device] = now_bytes
            else:
                self.unmanaged_bytes.pop(device, None)
            changed |= self.unmanaged_memory == "count"
        if changed:
            for device, uuid in self._devices.items():
                total = self._device_totals.get(device, 0)
                pool = self.pool_for(total)
                if self.unmanaged_memory == "count":
                    pool = max(0, pool - self.unmanaged_bytes.get(device, 0))
                self.policy.add_device(uuid, total_bytes=total, pool_bytes=pool)
            self._handle(ev.Tick(time.monotonic()))  # a pool that grew lets waiters in

    def _set_quota(self, conn: Connection, quota: int, now: float) -> None:
        """Tell the shim and the policy a client's effective quota."""
        if conn.client_id is None:
            return
        conn.quota = quota = cap_quota(quota, conn.ceiling)  # not even an admin lifts it
        self._info(
            conn,
            "quota client=%s quota=%s",
            conn.client_id,
            format_size(quota) if quota else "none",
        )
        self._send(conn, Message(MsgType.SET_QUOTA, {"quota": quota}))
        self._handle(ev.SetQuota(now, conn.client_id, quota))

    def _execute(self, decisions: list[ev.Decision]) -> None:
        now = time.monotonic()
        for decision in decisions:
            conn = self._shims.get(decision.client)
            if conn is None or conn.closed:
                self.log.debug("decision %r for a client that is gone", decision)
                continue
            if self._deep_idle_holds(decision):
                continue  # sent once the client's process is restored (sleeping.py)
            mem = conn.memory
            if isinstance(decision, ev.Grant):
                waited = None if conn.requested_at is None else now - conn.requested_at
                moving = mem["evicted"] if decision.restore else mem["used"]
                self._info(
                    conn,
                    "grant client=%s restore=%d %s waited_ms=%s",
                    decision.client,
                    int(decision.restore),
                    _bytes(moving),
                    _ms(waited),
                )
                conn.requested_at = None
                conn.granted_at = conn.accounted_at = now
                if self.metrics is not None:
                    self.metrics.granted(conn.device or "", waited)
            elif isinstance(decision, ev.Revoke):
                held = None if conn.granted_at is None else now - conn.granted_at
                self._info(
                    conn,
                    "revoke client=%s evict=%d %s%s held_ms=%s reason=%r",
                    decision.client,
                    int(decision.evict),
                    _bytes(mem["managed"] if decision.evict else mem["used"]),
                    " " + _asked(decision.evict_bytes) if decision.evict else "",
                    _ms(held),
                    decision.reason,
                )
                conn.revoking, conn.overdue = True, False
                self._watch_revoke(conn, now)
            elif isinstance(decision, ev.Precopy):
                self._info(conn, "precopy client=%s %s", decision.client, _bytes(mem["managed"]))
            elif isinstance(decision, ev.RestoreAhead):
                self._info(
                    conn, "restore_ahead client=%s %s", decision.client, _bytes(decision.bytes)
                )
            elif isinstance(decision, ev.Staging):
                self.log.debug("staging client=%s %s", decision.client, _bytes(decision.bytes))
            elif isinstance(decision, ev.Refuse):
                self._info(conn, "refuse client=%s: %s", decision.client, decision.message)
            elif isinstance(decision, ev.Room):
                room = decision.room_bytes
                self.log.debug(
                    "room client=%s %s", decision.client, "none" if room is None else _bytes(room)
                )
            else:
                self._info(
                    conn,
                    "evict client=%s %s %s reason=%r",
                    decision.client,
                    _bytes(mem["managed"]),
                    _asked(decision.bytes),
                    decision.reason,
                )
            message = tr.decision_message(decision)
            if isinstance(decision, ev.Grant):
                conn.grant = ""  # a new grant: a new secret (the old one proves nothing)
                message.fields["resume_secret"] = self._resume_secret(conn)
            self._send(conn, message)

    def _watch_revoke(self, conn: Connection, sent: float) -> None:
        """Warn the operator once when a revoke goes unanswered for revoke_warning_seconds: a
        GPU kernel that runs that long keeps the device from everyone who waits."""
        conn.revoked_at = sent
        loop = asyncio.get_running_loop()
        if self.revoke_warning_seconds > 0:
            loop.call_later(self.revoke_warning_seconds, self._revoke_unanswered, conn, sent)
        if self.revoke_deadline_seconds > 0:
            loop.call_later(self.revoke_deadline_seconds, self._revoke_overdue, conn, sent)

    def _still_revoking(self, conn: Connection, sent: float) -> bool:
        return not (conn.closed or conn.left or conn.revoked_at != sent or self._stopping)

    def _revoke_unanswered(self, conn: Connection, sent: float) -> None:
        if self._still_revoking(conn, sent):
            self._log_limit.warning(
                conn.peer.uid,
                "gpushare: client %s (pid %d) has not released the GPU %.0f s after it was asked: "
                "its GPU work still runs while others wait (interrupt or end the kernel)",
                conn.client_id,
                conn.peer.pid,
                time.monotonic() - sent,
            )

    def _revoke_overdue(self, conn: Connection, sent: float) -> None:
        """The holder let its revoke deadline pass: stop waiting for it (docs/reliability.md)."""
        if not self._still_revoking(conn, sent) or conn.client_id is None:
            return
        conn.overdue = True
        action = "counted as released, its memory still on the GPU"
        if self._mps is not None:
            action = "terminate_client of its processes (MPS)"
            self._spawn(self._mps.terminate_process(conn.peer.pid, tree=True))
        elif self.revoke_signal:
            action += f"; {self.revoke_signal} in {self.revoke_signal_grace:.0f} s"
            loop = asyncio.get_running_loop()
            loop.call_later(self.revoke_signal_grace, self._signal_overdue, conn, sent)
        self._log_limit.warning(
            conn.peer.uid,
            "revoke_overdue client=%s pid=%d after_s=%.0f: %s",
            conn.client_id,
            conn.peer.pid,
            time.monotonic() - sent,
            action,
        )
        # Waiters that fit beside its memory run now; the rest wait for it to go.
        self._handle(ev.Released(time.monotonic(), conn.client_id, False, 0, 0))

    def _signal_overdue(self, conn: Connection, sent: float) -> None:
        if not self._still_revoking(conn, sent):
            return
        signum = getattr(signal, self.revoke_signal)
        # Through the pidfd taken at HELLO: the process that connected or none, never whoever
        # has its pid now (issue 22, item 6).
        process = self._peer_processes().get(conn.serial)
        why = process.signal(signum) if process is not None else "no pidfd was taken at HELLO"
        if why:
            self._log_limit.warning(
                conn.peer.uid,
                "not sending %s to client %s (pid %d): %s",
                self.revoke_signal,
                conn.client_id,
                conn.peer.pid,
                why,
            )
            return
        self._log_limit.warning(
            conn.peer.uid,
            "revoke_signal client=%s pid=%d signal=%s",
            conn.client_id,
            conn.peer.pid,
            self.revoke_signal,
        )
