"""The translator: frames and control messages in, checked requests and policy events out.

Everything a peer sends is checked here, and nothing here does I/O or reads a clock (the caller
passes ``now``): in the spirit of h11's ``_state.py``, what can reach the policy is decided in one
place that a test can drive without a socket. A message that does not check out becomes a
:class:`Refusal` (an error code and a text for the peer); the shell only sends it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...protocol import (
    ErrorCode,
    Message,
    MsgType,
    duplicate_client_id,
    encode,
    error_message,
    printable,
)
from ...units import parse_size
from ..core import events as ev
from .kernel_ids import bound_id, valid_digest

__all__ = [
    "CLIENT_ACTIONS",
    "MAX_CLIENT_ID",
    "MAX_DEVICE_NAME",
    "MAX_DEVICE_UUID",
    "ClientAction",
    "Hello",
    "MPSEnv",
    "Place",
    "Refusal",
    "bounded_memory",
    "check_client_action",
    "check_hello",
    "check_mps_env",
    "check_mps_terminate",
    "check_place",
    "check_status_request",
    "control_action",
    "decision_message",
    "encode_status",
    "free_client_id",
    "memory_after",
    "shim_event",
]

#: The longest device UUID and name a HELLO may carry ("GPU-" or "MIG-" UUIDs have 40 characters).
MAX_DEVICE_UUID = 64
MAX_DEVICE_NAME = 256
#: The longest client id a shim may ask for or a control action name.
MAX_CLIENT_ID = 256
#: Labels (a notebook path, a command line) are cut to this many characters: one client's label
#: must not fill the status frame and hide everyone else.
MAX_LABEL = 512
#: Actions on one client (each names it) and actions on the scheduler.
CLIENT_ACTIONS = ("release", "evict", "set_quota", "kernel_state")
#: What Jupyter tells of a kernel: a cell started (busy), ended (idle), or an execute request
#: arrived while it does not hold the device (coming: its memory may be restored ahead).
KERNEL_STATES = ("busy", "idle", "coming")
SCHEDULER_ACTIONS = (
    "reload",
    "place",
    "bind_kernel",
    "allocate",
    "prune_allocations",
    "history",
)
MPS_ACTIONS = ("mps_env", "mps_terminate")
AGENT_ACTIONS = ("checkpoint_agent", "checkpoint_done")  # deep idle: features/checkpoint_agent.py
_MEMORY_FIELDS = (
    ("used", "used_bytes"),
    ("managed", "managed_bytes"),
    ("pinned", "pinned_bytes"),
    ("evicted", "evicted_bytes"),
)


@dataclass(frozen=True)
class Refusal:
    """Why a message is refused: the ERROR frame's code and text."""

    code: ErrorCode
    text: str


# -- shims -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """A checked HELLO: what a shim says about itself (claims, until access and NVML agree)."""

    requested_id: str
    user: str
    token: str
    device_uuid: str
    device_name: str
    device_total: int
    weight: float
    quota: int
    context_bytes: int
    label: str
    pid: int
    version: str
    #: The Join fields of a reconnecting shim (docs/protocol.md, "Scheduler restarts").
    resume: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    #: What a reconnecting holder sends back of its last GRANT ('' when nothing).
    resume_secret: str = ""
    #: The kernel's secret (GPUSHARE_KERNEL_SECRET; .kernel_ids): '' when none.
    kernel_secret: str = ""

    def join(
        self,
        now: float,
        client_id: str,
        device: str,
        user: str,
        uid: int,
        weight: float,
        quota: int,
    ) -> ev.Join:
        return ev.Join(
            now,
            client_id,
            device,
            user,
            weight=weight,
            quota=quota,
            context_bytes=self.context_bytes,
            uid=uid,
            pid=self.pid,
            label=self.label,
            **self.resume,
        )


def _resume_fields(msg: Message) -> dict[str, Any]:
    """``resume``: 1 = it held the device when the scheduler was lost, 2 = it waited for it; its
    memory (``used_bytes`` ...) rides along, so the pool's accounting is right from the start."""
    out: dict[str, Any] = {}
    if "used_bytes" in msg:
        out["used"] = int(msg["used_bytes"])
        out["managed"] = int(msg.get("managed_bytes") or 0)
        out["pinned"] = int(msg.get("pinned_bytes") or 0)
        out["evicted"] = int(msg.get("evicted_bytes") or 0)
    if "resume" in msg:
        out["resume"] = {1: "holding", 2: "waiting"}.get(int(msg.get("resume") or 0), "")
        out["since"] = int(msg.get("since_ms") or 0) / 1000.0
        out["gpu_seconds"] = int(msg.get("gpu_ms") or 0) / 1000.0
    return out


def check_hello(msg: Message, peer_pid: int) -> Hello | Refusal:
    uuid, name = str(msg.get("device_uuid") or ""), str(msg.get("device_name") or "")
    if len(uuid) > MAX_DEVICE_UUID or len(name) > MAX_DEVICE_NAME:
        # Devices learnt from HELLOs are never forgotten, so a peer must not be able to grow
        # that table without bound (real UUIDs are 40 characters, names a few dozen).
        return Refusal(
            ErrorCode.BAD_REQUEST,
            f"HELLO: device_uuid may have at most {MAX_DEVICE_UUID} characters and "
            f"device_name at most {MAX_DEVICE_NAME}",
        )
    pid = peer_pid or int(msg.get("pid") or 0)
    requested = str(msg.get("client_id") or "") or f"pid-{msg.get('pid') or peer_pid}"
    if len(requested) > MAX_CLIENT_ID or not requested.isprintable():
        # Ids are shown in status tables and logs and named by control actions: printable, short.
        return Refusal(
            ErrorCode.BAD_REQUEST,
            f"HELLO: client_id must be at most {MAX_CLIENT_ID} printable characters",
        )
    label = printable(str(msg.get("label") or ""))
    if len(label) > MAX_LABEL:
        label = label[: MAX_LABEL - 1] + "\u2026"
    return Hello(
        requested_id=requested,
        user=str(msg.get("user") or ""),
        token=str(msg.get("token") or ""),
        device_uuid=uuid,
        device_name=printable(name),
        device_total=int(msg.get("device_total") or 0),
        weight=int(msg.get("weight_milli") or 1000) / 1000.0,
        quota=int(msg.get("quota") or 0),
        context_bytes=int(msg.get("context_bytes") or 0),
        label=label,
        pid=pid,
        version=str(msg.get("version", "?")),
        resume=_resume_fields(msg),
        memory=memory_after({}, msg) if "used_bytes" in msg else {},
        resume_secret=str(msg.get("resume_secret") or ""),
        kernel_secret=str(msg.get("kernel_secret") or ""),
    )


def free_client_id(requested: str, pid: int, taken: Mapping[str, object]) -> str:
    """The id a second live client asking for ``requested`` gets: ``<id>#<pid>``, then
    ``<id>#<pid>.<n>`` (a kernel's subprocess inherits its GPUSHARE_CLIENT_ID)."""
    n = 1
    candidate = duplicate_client_id(requested, pid)
    while candidate in taken:
        n += 1
        candidate = duplicate_client_id(requested, pid, n)
    return candidate


def memory_after(memory: Mapping[str, int], msg: Message, cap: int = 0) -> dict[str, int]:
    """``memory`` updated with the memory fields ``msg`` carries (absent ones keep their value),
    bounded as :func:`bounded_memory` says."""
    out = {"used": 0, "managed": 0, "pinned": 0, "evicted": 0, **memory}
    for key, name in _MEMORY_FIELDS:
        if name in msg:
            out[key] = int(msg[name])
    return bounded_memory(out, cap)


def bounded_memory(mem: Mapping[str, int], cap: int) -> dict[str, int]:
    """A client's memory claim made consistent and bounded: what it uses is at most ``cap``
    (its quota, else its device's size; 0 = unknown), and its managed and pinned parts at most
    what it uses, its evicted part at most its managed part. A claim is only a claim: a
    ``pinned`` of 2**60 must not make everyone else take turns beside a 1 GiB kernel."""
    used = max(0, mem["used"])
    if cap > 0:
        used = min(used, cap)
    managed = min(max(0, mem["managed"]), used)
    return {
        "used": used,
        "managed": managed,
        "pinned": min(max(0, mem["pinned"]), used),
        "evicted": min(max(0, mem["evicted"]), managed),
    }


def precopied(msg: Message, memory: Mapping[str, int]) -> int:
    """A client's pre-copied bytes: a claim, bounded by what it says it could evict."""
    return max(0, min(int(msg.get("precopied_bytes") or 0), int(memory.get("managed", 0))))


def shim_event(
    msg: Message, client_id: str, now: float, memory: Mapping[str, int], cap: int = 0
) -> ev.Event:
    """The policy event of a shim message after HELLO (GOODBYE is a Leave); ``cap``: see
    :func:`bounded_memory`."""
    mtype = msg.type
    moved = int(msg.get("bytes_moved") or 0)
    micros = int(msg.get("micros") or 0)
    # What is on the host now, as the shim says (a partial eviction: the part that left).
    total = int(msg.get("evicted_bytes") or 0) if "evicted_bytes" in msg else -1
    if mtype in (MsgType.REQUEST, MsgType.MEMORY):
        mem = memory_after(memory, msg, cap)
        said = (now, client_id, mem["used"], mem["managed"], mem["pinned"], mem["evicted"])
        if mtype == MsgType.MEMORY:
            return ev.Memory(*said, precopied(msg, mem))
        short = int(msg.get("short_bytes") or 0)
        return ev.Request(*said, min(short, cap) if cap > 0 else short)
    if mtype == MsgType.RELEASED:
        return ev.Released(now, client_id, bool(msg.get("flag", 0)), moved, micros, total)
    if mtype == MsgType.IDLE:
        said = "precopied_bytes" in msg
        return ev.Idle(now, client_id, precopied(msg, memory_after(memory, msg)) if said else -1)
    if mtype == MsgType.PRECOPIED:
        return ev.Precopied(
            now, client_id, moved, micros, precopied(msg, memory_after(memory, msg))
        )
    if mtype == MsgType.EVICTED:
        # flag 0: the eviction failed and the memory is still on the GPU; shims before the flag
        # never reported a failure.
        return ev.Evicted(
            now, client_id, moved, micros, ok=bool(msg.get("flag", 1)), evicted_bytes=total
        )
    if mtype == MsgType.RESTORED:
        # flag 1: the answer to a RESTORE_AHEAD (what stayed on the host, what is clean).
        said = "precopied_bytes" in msg
        pre = precopied(msg, memory_after(memory, msg)) if said else -1
        return ev.Restored(now, client_id, moved, micros, bool(msg.get("flag", 0)), total, pre)
    if mtype == MsgType.GOODBYE:
        return ev.Leave(now, client_id)
    raise ValueError(f"{msg.type_name} is not a shim message")  # the dispatcher checked


def host_event(msg: Message, client_id: str, now: float, cap: int) -> ev.HostMemory | None:
    """The host memory a shim message says its engine holds (None: it says nothing): a claim,
    cut to ``cap`` (what the client says it uses on the device: each block has one staging
    buffer, so a claim past it would only take the others' host room), staging at most the
    whole."""
    if "host_bytes" not in msg:
        return None
    host = min(max(0, int(msg["host_bytes"])), max(0, cap))
    return ev.HostMemory(now, client_id, host, min(int(msg.get("staging_bytes") or 0), host))


def decision_message(decision: ev.Decision) -> Message:
    """The frame that carries a policy decision to its shim.

    ``evict_bytes`` (REVOKE with evict, EVICT) and ``room_bytes`` (GRANT) are sent only when
    they limit something: absent means everything (evict_bytes) and no limit (room_bytes).
    """
    if isinstance(decision, ev.Grant):
        fields: dict[str, Any] = {"flag": int(decision.restore)}
        if decision.room_bytes is not None:
            fields["room_bytes"] = max(0, decision.room_bytes)
        return Message(MsgType.GRANT, fields)
    if isinstance(decision, ev.Revoke):
        fields = {"flag": int(decision.evict), "reason": decision.reason}
        if decision.evict and decision.evict_bytes > 0:
            fields["evict_bytes"] = decision.evict_bytes
        return Message(MsgType.REVOKE, fields)
    if isinstance(decision, ev.Precopy):
        return Message(MsgType.PRECOPY, {})
    if isinstance(decision, ev.RestoreAhead):
        return Message(MsgType.RESTORE_AHEAD, {})  # everything evicted comes back
    if isinstance(decision, ev.Room):
        room = {} if decision.room_bytes is None else {"room_bytes": max(0, decision.room_bytes)}
        return Message(MsgType.ROOM, room)
    if isinstance(decision, ev.Staging):
        return Message(MsgType.STAGING, {"staging_bytes": max(0, decision.bytes)})
    if isinstance(decision, ev.Refuse):
        return error_message(ErrorCode.NO_ROOM, decision.message)
    fields = {"reason": decision.reason}
    if decision.bytes > 0:
        fields["evict_bytes"] = decision.bytes
    return Message(MsgType.EVICT, fields)


def encode_status(doc: dict[str, Any]) -> bytes:
    """The STATUS frame of ``doc``, cut down to fit the 64 KiB frame (and saying so).

    Over the limit the labels go first; then (hundreds of clients) the devices stay and the
    per-client detail goes; still
    over (devices learnt from HELLOs with long names), the devices go too. Without this the
    encoding raised and STATUS failed for every peer (found by test_protocol_fuzz.py).
    """
    try:
        return encode(Message(MsgType.STATUS, {"body": doc}))
    except ValueError:
        pass
    # Labels first: every client stays listed, none can hide the others by its size.
    for dev in doc["devices"]:
        for client in dev.get("clients", []):
            client.pop("label", None)
    doc["labels_truncated"] = True
    try:
        return encode(Message(MsgType.STATUS, {"body": doc}))
    except ValueError:
        pass
    for dev in doc["devices"]:
        dev["clients_truncated"] = len(dev.get("clients", []))
        dev["clients"] = []
    doc["truncated"] = True
    try:
        return encode(Message(MsgType.STATUS, {"body": doc}))
    except ValueError:
        doc["devices_truncated"] = len(doc["devices"])
        doc["devices"] = []
        return encode(Message(MsgType.STATUS, {"body": doc}))


# -- control peers -----------------------------------------------------------------------------


def control_action(msg: Message) -> str | Refusal:
    """The action a CONTROL message asks for (``status`` for a STATUS_REQUEST)."""
    if msg.type == MsgType.STATUS_REQUEST:
        return "status"
    body = msg.get("body")
    if not isinstance(body, dict):
        return Refusal(ErrorCode.BAD_REQUEST, "CONTROL needs a body object with 'action'")
    action = body.get("action")
    known = CLIENT_ACTIONS + SCHEDULER_ACTIONS + MPS_ACTIONS + AGENT_ACTIONS
    if action not in known:
        return Refusal(
            ErrorCode.BAD_REQUEST,
            f"unknown action {action!r} (one of: {', '.join(CLIENT_ACTIONS + SCHEDULER_ACTIONS)})",
        )
    return str(action)


def check_status_request(msg: Message) -> str | Refusal | None:
    """The device a STATUS_REQUEST narrows the status to (None: all)."""
    body = msg.get("body")
    if body is None:
        return None
    if not isinstance(body, dict):
        return Refusal(ErrorCode.BAD_REQUEST, "the STATUS_REQUEST body must be an object")
    device = body.get("device")
    if device is not None and not isinstance(device, str):
        return Refusal(ErrorCode.BAD_REQUEST, "'device' must be a device UUID string")
    return device


@dataclass(frozen=True)
class ClientAction:
    """A checked action on one client: release, evict, set_quota or kernel_state."""

    action: str
    client_id: str
    quota: int = 0
    state: str = ""

    def event(self, now: float) -> ev.Event:
        if self.action == "set_quota":
            return ev.SetQuota(now, self.client_id, self.quota)
        if self.action == "kernel_state":
            if self.state == "busy":
                return ev.Busy(now, self.client_id)
            if self.state == "coming":
                return ev.Coming(now, self.client_id)
            return ev.Idle(now, self.client_id, from_jupyter=True)
        return ev.AdminRelease(now, self.client_id, evict=self.action == "evict")

    def reply(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": True, "action": self.action, "client": self.client_id}
        if self.action == "set_quota":
            out["quota"] = self.quota
        elif self.action == "kernel_state":
            out["state"] = self.state
        return out


def check_client_action(action: str, body: Mapping[str, Any]) -> ClientAction | Refusal:
    client_id = body.get("client")
    if not isinstance(client_id, str) or not client_id:
        return Refusal(ErrorCode.BAD_REQUEST, f"{action}: 'client' (a client id) is needed")
    if action == "set_quota":
        raw = body.get("quota")
        try:
            if raw is None or isinstance(raw, (bool, float)):
                raise ValueError(f"invalid size {raw!r}")
            # parse_size refuses what a u64 (SET_QUOTA) cannot carry: a larger quota made the
            # frame's encoding fail after the policy took it (found by test_protocol_fuzz.py).
            quota = parse_size(raw)
        except ValueError as exc:
            return Refusal(ErrorCode.BAD_REQUEST, f"set_quota: 'quota': {exc}")
        return ClientAction(action, client_id, quota=quota)
    if action == "kernel_state":
        state = body.get("state")
        if state not in KERNEL_STATES:
            return Refusal(
                ErrorCode.BAD_REQUEST, "kernel_state: 'state' must be 'busy', 'idle' or 'coming'"
            )
        return ClientAction(action, client_id, state=str(state))
    return ClientAction(action, client_id)


@dataclass(frozen=True)
class Place:
    """A checked ``place``: a kernel about to start asks which GPU to use."""

    client_id: str
    need: int | None
    device: str | int | None
    reachable: list[str] | None


def check_place(body: Mapping[str, Any]) -> Place | Refusal:
    client_id, need = body.get("client"), body.get("need")
    device, reachable = body.get("device"), body.get("reachable")
    if reachable is not None and (
        not isinstance(reachable, list)
        or len(reachable) > 64
        or not all(isinstance(u, str) and len(u) <= MAX_DEVICE_UUID for u in reachable)
    ):
        return Refusal(ErrorCode.BAD_REQUEST, "place: 'reachable' must list GPU UUIDs")
    if not isinstance(client_id, str) or not client_id or len(client_id) > MAX_CLIENT_ID:
        return Refusal(ErrorCode.BAD_REQUEST, "place: 'client' (a client id) is needed")
    if need is not None and (not isinstance(need, int) or isinstance(need, bool) or need < 0):
        return Refusal(ErrorCode.BAD_REQUEST, "place: 'need' must be a byte count")
    if device is not None and (not isinstance(device, (str, int)) or isinstance(device, bool)):
        return Refusal(ErrorCode.BAD_REQUEST, "place: 'device' must be an index or a UUID")
    return Place(client_id, need, device, reachable)


def check_bind_kernel(body: Mapping[str, Any]) -> tuple[str, str] | Refusal:
    """A checked ``bind_kernel``: (the kernel's id, the SHA-256 of its secret, hex)."""
    client_id, digest = body.get("client"), body.get("secret_sha256")
    if not isinstance(client_id, str) or not client_id or len(client_id) > MAX_CLIENT_ID:
        return Refusal(ErrorCode.BAD_REQUEST, "bind_kernel: 'client' (a kernel id) is needed")
    if not client_id.isprintable() or bound_id(client_id) != client_id or "#" in client_id:
        return Refusal(ErrorCode.BAD_REQUEST, "bind_kernel: 'client' is not a kernel id")
    if not valid_digest(digest):
        return Refusal(ErrorCode.BAD_REQUEST, "bind_kernel: 'secret_sha256' must be 64 hex digits")
    return client_id, str(digest)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class MPSEnv:
    """A checked ``mps_env``: the environment of a kernel about to start in MPS mode."""

    client_id: object
    weight: float
    quota: int
    compute_share: float | None
    device: str | None


def check_mps_env(body: Mapping[str, Any]) -> MPSEnv | Refusal:
    weight, quota = body.get("weight", 1.0), body.get("quota", 0)
    share, device = body.get("compute_share"), body.get("device")
    try:
        if not _is_number(weight) or not 0 < weight < math.inf:  # NaN fails this too
            raise ValueError(f"'weight' must be a positive number, got {weight!r}")
        if share is not None and (not _is_number(share) or not 0 <= share <= 100):
            raise ValueError(f"'compute_share' must be a percentage, got {share!r}")
        if device is not None and not isinstance(device, str):
            raise ValueError("'device' must be a device UUID or index string")
        quota_bytes = 0 if quota in (None, "", 0) else parse_size(quota)
    except ValueError as exc:
        return Refusal(ErrorCode.BAD_REQUEST, f"mps_env: {exc}")
    return MPSEnv(
        body.get("client"), float(weight), quota_bytes, float(share) if share else None, device
    )


def check_mps_terminate(body: Mapping[str, Any]) -> tuple[int, bool] | Refusal:
    """The pid (and whether its process tree too) an ``mps_terminate`` names."""
    pid = body.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        return Refusal(ErrorCode.BAD_REQUEST, "mps_terminate: 'pid' (a process id) is needed")
    return pid, bool(body.get("tree", True))
