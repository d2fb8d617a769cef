"""Control peers' actions: status, release, evict, set_quota, kernel_state, reload, place, MPS.

:class:`ControlActions` is the part of :class:`~.server.GPUShareScheduler` that answers control
peers (the CLI, the server extension, the provisioner): each message is checked by
:mod:`.translate`, authorised by :mod:`.access`, and only then reaches the policy or the MPS
daemons. docs/protocol.md lists the actions and their answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..._version import __version__
from ...protocol import ErrorCode, Message, MsgType
from ...units import format_size, parse_size
from ..core import events as ev
from ..core.policy import Policy
from ..features.allocations import confined
from ..features.mps import MPSManager
from ..features.mps_control import mps_env, mps_terminate
from ..features.placement import PlacementError
from ..features.reservations import Reservations
from . import translate as tr
from .access import Access
from .devices import Discovery
from .kernel_ids import IdOwners, KernelIds
from .transport import Connection
from .users import Identity
from .views import filter_status, fit_status

__all__ = ["ControlActions"]


class ControlActions:
    """Answers to control peers; mixed into the scheduler, whose state it reads (below)."""

    # What the scheduler provides (see server.py).
    log: Any
    policy: Policy | None
    access: Access
    discovery: Discovery
    socket_path: str
    placement_estimate: int | str
    placement_timeout: float
    _shims: dict[str, Connection]
    _devices: dict[str, str]
    _utilization: dict[str, int]
    unmanaged_bytes: dict[str, int]
    _mps: MPSManager | None
    _reservations: Reservations
    _handle: Callable[[ev.Event], None]
    _decide: Callable[[ev.Event], list[ev.Decision]]
    _execute: Callable[[list[ev.Decision]], None]
    _reschedule: Callable[[], None]
    _deep_idle_overlay: Callable[[list[dict[str, Any]], float], None]
    _set_quota: Callable[[Connection, int, float], None]
    _spawn: Callable[[Coroutine[Any, Any, None]], None]
    _device_index: Callable[[str], int | None]
    reload: Callable[[], Coroutine[Any, Any, bool]]
    _refuse: Callable[[Connection, tr.Refusal], None]
    _on_allocate: Callable[[Connection, Identity, Any], Coroutine[Any, Any, None]]
    _on_prune_allocations: Callable[[Connection, Identity, Any], Coroutine[Any, Any, None]]
    _id_owners: IdOwners
    _kernel_ids: KernelIds
    _disown: Callable[[Connection, str], None]
    _keep_state: Callable[[], None]
    _remember_owner: Callable[[str, str], None]
    _bind_refusal: Callable[[str, str], str | None]
    _on_agent_control: Callable[[Connection, str, dict[str, Any]], None]
    _may_force_evict: Callable[[Connection], bool]
    _force_evict: Callable[[Connection, Connection, dict[str, Any]], Coroutine[Any, Any, None]]

    def _reply(self, conn: Connection, body: dict[str, Any]) -> None:
        conn.send(Message(MsgType.CONTROL_REPLY, {"body": body}), self.log)

    def _device_snapshot(self, uuid: str) -> dict[str, Any] | None:
        assert self.policy is not None
        for dev in self.policy.snapshot(time.monotonic()):
            if dev.get("uuid") == uuid:
                return dev
        return None

    def status_document(
        self, device: str | None = None, viewer: Identity | None = None
    ) -> dict[str, Any]:
        """The status document of docs/protocol.md (``gpushare status --json`` prints it).

        ``waiting_since`` is a Unix time (seconds); the rest is the policy's snapshot unchanged,
        plus ``version``, ``socket`` and ``nvml`` (true, or why NVML discovery failed). For a
        ``viewer`` who is not an admin, other users' clients are summed per user
        (:func:`.views.filter_status`); ``None`` (an in-process caller) sees everything.
        """
        now = time.monotonic()
        wall = time.time()
        devices = self.policy.snapshot(now) if self.policy is not None else []
        if device:
            devices = [d for d in devices if str(d.get("uuid", "")).lower() == device.lower()]
        for dev in devices:
            dev["index"] = self._device_index(str(dev.get("uuid")))
            dev["utilization_percent"] = self._utilization.get(str(dev.get("uuid")))
            dev["unmanaged_bytes"] = self.unmanaged_bytes.get(str(dev.get("uuid")).lower(), 0)
            for client in dev.get("clients", []):
                # The policy's clock is monotonic; readers want a wall-clock (Unix) time.
                since = client.get("waiting_since")
                if isinstance(since, (int, float)):
                    client["waiting_since"] = round(wall - (now - since), 3)
        self._deep_idle_overlay(devices, now)
        doc = {
            "version": __version__,
            "socket": self.socket_path,
            "nvml": True if self.discovery.error is None else self.discovery.error,
            "devices": devices,
            # The node's host memory (docs/architecture.md, "Host memory is a budget").
            "host": self.policy.host_snapshot() if self.policy is not None else None,
        }
        if self._mps is not None:
            doc["mps"] = self._mps.describe()
        return doc if viewer is None else filter_status(doc, viewer)

    async def _on_control_message(self, conn: Connection, msg: Message) -> None:
        if conn.kind == "new":
            conn.kind = "control"
        if conn.kind == "control":
            # Each control message is identified on its own (it may carry user and token); a
            # shim asking on its own connection is who its HELLO proved.
            ident = await self.identify(conn.peer, msg)
            if conn.closed:
                return
            if isinstance(ident, str):
                conn.error(ErrorCode.FORBIDDEN, ident, self.log)
                return
            conn.identity = confined(ident, conn)
        ident = conn.identity
        if ident is None:  # pragma: no cover - a shim has its HELLO's identity
            conn.error(ErrorCode.FORBIDDEN, "unidentified peer", self.log)
            return
        action = tr.control_action(msg)
        body = msg.get("body")
        if isinstance(action, tr.Refusal):
            self._refuse(conn, action)
        elif action == "status":
            self._on_status_request(conn, msg, ident)
        elif action in tr.MPS_ACTIONS:
            await self._on_mps_control(conn, action, body)
        elif action == "reload":
            self._on_reload_request(conn, ident)
        elif action == "place":
            self._on_place(conn, body, ident)
        elif action == "bind_kernel":
            self._on_bind_kernel(conn, body, ident)
        elif action == "allocate":
            await self._on_allocate(conn, ident, body)
        elif action == "prune_allocations":
            await self._on_prune_allocations(conn, ident, body)
        elif action in tr.AGENT_ACTIONS:
            self._on_agent_control(conn, action, body)
        elif action == "history":
            self._reply(conn, {"ok": True, "action": action, "history": self.history_view(ident)})
        else:
            self._on_client_action(conn, ident, action, body)

    def _on_status_request(self, conn: Connection, msg: Message, viewer: Identity) -> None:
        device = tr.check_status_request(msg)
        if isinstance(device, tr.Refusal):
            self._refuse(conn, device)
            return
        doc = fit_status(self.status_document(device, viewer))
        conn.write_frame(tr.encode_status(doc), self.log)

    def _on_client_action(
        self, conn: Connection, who: Identity, action: str, body: dict[str, Any]
    ) -> None:
        request = tr.check_client_action(action, body)
        if isinstance(request, tr.Refusal):
            self._refuse(conn, request)
            return
        client_id = request.client_id
        target = self._shims.get(client_id)
        if target is None or self.policy is None or not self.policy.has_client(client_id):
            conn.error(ErrorCode.NOT_FOUND, f"no client {client_id!r}", self.log)
            return
        if not self.access.may_act(who, target.identity):
            # Another user's client is not found, as one that does not exist: the answer must
            # not confirm that an id guessed or leaked is live (docs/protocol.md).
            owner = target.identity.user if target.identity is not None else "?"
            self._log_limit.warning(
                conn.peer.uid,
                "forbidden: %s asked %s on %s (user %s)",
                who.describe(),
                action,
                client_id,
                owner,
            )
            conn.error(ErrorCode.NOT_FOUND, f"no client {client_id!r}", self.log)
            return
        limited = self._log_limit.log_for(conn.peer.uid)
        log = limited.debug if action == "kernel_state" else limited.info
        log("control %s client=%s by %s %s", action, client_id, who.describe(), body)
        now = time.monotonic()
        if action == "set_quota":
            refusal = self.access.quota_refusal(who, target.identity, request.quota)
            if refusal:
                self._log_limit.warning(conn.peer.uid, "forbidden: %s: %s", who.describe(), refusal)
                conn.error(ErrorCode.FORBIDDEN, refusal, self.log)
                return
            target.requested_quota = request.quota
            target.quota_by_admin = who.admin
            self._set_quota(target, request.quota, now)
            # The quota in force: an allocation's ceiling (allocations.py) may have cut it.
            self._reply(conn, {**request.reply(), "quota": target.quota})
            return
        if action == "kernel_state":
            self._handle(request.event(now))
            for device_client in self._device_clients(client_id, target):
                self._handle(tr.ClientAction(action, device_client, state=request.state).event(now))
            self._reply(conn, request.reply())
            return
        # release / evict: say what happened, not only that the request was taken.
        decisions = self._decide(request.event(now))
        reply = {**request.reply(), **_effect(target, decisions, now)}
        self._execute(decisions)
        self._reschedule()
        if action == "evict" and who.admin and not reply["done"] and self._may_force_evict(target):
            # It does not answer its revoke: the driver's checkpoint takes its memory (sleeping.py).
            self._spawn(self._force_evict(conn, target, reply))
            return
        self._reply(conn, reply)

    def _device_clients(self, client_id: str, target: Connection) -> list[str]:
        """The clients of the same process on its other GPUs: ``<id>/<ordinal>``
        (docs/protocol.md, "Several devices"). Jupyter's view of a kernel (busy, idle) is of the
        whole process, so it applies to each of them too."""
        assert self.policy is not None
        prefix = f"{client_id}/"
        return [
            cid
            for cid, conn in self._shims.items()
            if cid.startswith(prefix)
            and conn.peer.pid == target.peer.pid
            and self.policy.has_client(cid)
        ]

    def _on_reload_request(self, conn: Connection, who: Identity) -> None:
        if not who.admin:
            conn.error(ErrorCode.FORBIDDEN, f"{who.user} may not reload: admins only", self.log)
            return
        self.log.info("reload asked by %s", who.describe())

        async def run() -> None:
            if await self.reload():
                self._reply(conn, {"ok": True, "action": "reload"})
            else:
                text = (
                    "reload failed: the configuration did not load (see the scheduler's log); "
                    "the previous one is still in force"
                )
                conn.error(ErrorCode.BAD_REQUEST, text, self.log)

        self._spawn(run())

    # ----------------------------------------------------------------------------------------
    # MPS mode (scheduler/features/mps.py does the work; docs/mps.md)

    async def _on_mps_control(self, conn: Connection, action: str, body: dict[str, Any]) -> None:
        """The ``mps_env`` and ``mps_terminate`` control actions (docs/protocol.md)."""
        reply: dict[str, Any] = {"ok": True, "action": action, "enabled": self._mps is not None}
        if action == "mps_env":
            counts = {
                str(dev.get("uuid", "")).lower(): len(dev.get("clients", []))
                for dev in (self.policy.snapshot(time.monotonic()) if self.policy else [])
            }
            refusal = mps_env(self._mps, body, reply, counts)
            if refusal is None and "env" in reply:
                self._log_limit.info(
                    conn.peer.uid,
                    "mps_env client=%s device=%s env=%s",
                    body.get("client"),
                    reply["device"],
                    reply["env"],
                )
        else:
            shims = list(self._shims.values())
            refusal = await mps_terminate(self._mps, self.access, conn, body, reply, shims)
        if refusal is not None:
            if refusal.code == ErrorCode.FORBIDDEN:
                self._log_limit.warning(conn.peer.uid, "forbidden: %s", refusal.text)
            self._refuse(conn, refusal)
        else:
            self._reply(conn, reply)

    # ----------------------------------------------------------------------------------------
    # Placement (several GPUs): see placement.py for the rule

    def place(
        self,
        client: str,
        need: int | None = None,
        device: str | int | None = None,
        reachable: list[str] | None = None,
        owner: str = "",
    ) -> dict[str, Any]:
        """Choose the GPU of a kernel about to start and reserve room there until it connects
        (``owner``: the user placing it, whose pending reservations are bounded).

        Raises PlacementError (no device known, or a pin naming none).
        """
        assert self.policy is not None
        estimate = parse_size(self.placement_estimate)
        return self._reservations.place(
            time.monotonic(),
            self.status_document()["devices"],
            self.policy.has_client,
            client,
            estimate if need is None or need <= 0 else need,
            estimate,
            self.placement_timeout,
            device,
            reachable,
            owner,
        )

    def _on_place(self, conn: Connection, body: dict[str, Any], who: Identity) -> None:
        """CONTROL ``place`` (docs/protocol.md) -> the chosen device's uuid and index.

        The provisioner places each kernel before it starts: the kernel's id becomes its
        caller's (no owner yet, or already theirs), so another user who reads the id in ``ps``
        and says ``HELLO`` with it first gets ``<id>#<pid>``, not the id."""
        request = tr.check_place(body)
        if isinstance(request, tr.Refusal):
            self._refuse(conn, request)
            return
        owner = self._id_owners.get(request.client_id)
        if owner is None or owner == who.user:
            self._remember_owner(request.client_id, who.user)
        try:
            answer = self.place(
                request.client_id, request.need, request.device, request.reachable, who.user
            )
        except PlacementError as exc:
            # No device at all (no NVML, nothing connected yet): not_found, the caller goes on
            # without placement. A pin naming no device: bad_request, the caller's mistake.
            code = ErrorCode.BAD_REQUEST if self._devices else ErrorCode.NOT_FOUND
            conn.error(code, f"place: {exc}", self.log)
            return
        self._log_limit.log_for(conn.peer.uid).info(  # within the caller's budget (A11)
            "place client=%s device=%s index=%s need=%s fits=%s reason=%r by uid %d",
            request.client_id,
            answer["device"],
            answer["index"],
            format_size(answer["need"]),
            answer["fits"],
            answer["reason"],
            conn.peer.uid,
        )
        self._reply(conn, {"ok": True, "action": "place", "client": request.client_id, **answer})

    def _on_bind_kernel(self, conn: Connection, body: dict[str, Any], who: Identity) -> None:
        """CONTROL ``bind_kernel`` (docs/protocol.md, "Kernel ids"): the provisioner binds a
        kernel's id to the SHA-256 of the secret it gives the kernel, before the kernel starts.
        Refused for an id bound to another user's kernel, held by a live client of another user
        or remembered as another user's; a client of the binder's own that holds the id without
        that secret loses it (.kernel_ids)."""
        request = tr.check_bind_kernel(body)
        if isinstance(request, tr.Refusal):
            self._refuse(conn, request)
            return
        client_id, digest = request
        refusal = self._bind_refusal(client_id, who.user) or self._kernel_ids.bind(
            client_id, who.user, digest
        )
        if refusal is not None:
            self._log_limit.warning(
                conn.peer.uid, "refused bind_kernel by %s: %s", who.describe(), refusal
            )
            conn.error(ErrorCode.FORBIDDEN, refusal, self.log)
            return
        self._remember_owner(client_id, who.user)
        holder = self._shims.get(client_id)
        if holder is not None and not holder.id_proven and not holder.left:
            self._disown(holder, f"{who.describe()} bound the id to its kernel")
        self._log_limit.log_for(conn.peer.uid).info(
            "bind_kernel client=%s by %s", client_id, who.describe()
        )
        self._keep_state()
        self._reply(conn, {"ok": True, "action": "bind_kernel", "client": client_id})


def _effect(target: Connection, decisions: list[ev.Decision], now: float) -> dict[str, Any]:
    """What a release or evict did to ``target``: ``done`` (a REVOKE or EVICT went out) and
    ``effect``, a sentence for people (docs/protocol.md)."""
    mine = [d for d in decisions if d.client == target.client_id]
    if any(isinstance(d, ev.Revoke) for d in mine):
        evict = any(isinstance(d, ev.Revoke) and d.evict for d in mine)
        text = "revoke sent: it releases the GPU when its current GPU work ends"
        return {"done": True, "effect": text + (", then evicts" if evict else "")}
    if any(isinstance(d, ev.Evict) for d in mine):
        return {"done": True, "effect": "eviction asked: its memory moves to the host"}
    if target.revoked_at is not None:
        text = f"already asked to release {now - target.revoked_at:.0f} s ago; not answered yet"
        if target.overdue:
            text += " (past its revoke deadline: the scheduler no longer waits for it)"
        return {"done": False, "effect": text}
    return {"done": False, "effect": "nothing to do: it does not hold the GPU"}
