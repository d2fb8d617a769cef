"""Events in, decisions out: the vocabulary of the scheduling policy.

The policy (:mod:`jupyter_gpushare.scheduler.core.policy`) is a pure state machine. It never reads a
clock, a socket or NVML: the asyncio shell (:mod:`jupyter_gpushare.scheduler.shell.server`),
the tests and the benchmark simulator all feed it these events, each stamped with the time
``now`` in seconds (any monotonic origin), and carry out the decisions it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# --------------------------------------------------------------------------------------------
# Events


@dataclass(frozen=True)
class Join:
    """A client connected and said HELLO."""

    now: float
    client: str
    device: str  # device UUID
    user: str  # fair-share key: the verified user name (or uid as a string)
    weight: float = 1.0
    quota: int = 0  # bytes, 0 = none
    context_bytes: int = 0
    uid: int = -1
    pid: int = 0
    label: str = ""
    # A shim reconnecting after the scheduler was lost (docs/reliability.md) says what it had:
    # its memory (used < 0: not said; the context estimate stands for it), whether it held the
    # device or waited for it ("holding" / "waiting" / ""), for how long (seconds) and its GPU time.
    used: int = -1
    managed: int = 0
    pinned: int = 0
    evicted: int = 0
    resume: str = ""
    since: float = 0.0
    gpu_seconds: float = 0.0


@dataclass(frozen=True)
class Request:
    """The client's GPU call is blocked: it wants the device. Carries its current memory use."""

    now: float
    client: str
    used: int = 0
    managed: int = 0
    pinned: int = 0
    evicted: int = 0
    # Bytes the driver refused on the device beyond what the pool's accounting left free (the
    # card fuller than the pool says): the room to make is at least this (docs/protocol.md).
    short: int = 0


@dataclass(frozen=True)
class Memory:
    """The client's memory use changed."""

    now: float
    client: str
    used: int
    managed: int
    pinned: int
    evicted: int
    precopied: int = 0  # resident bytes with a current host copy (a pre-copy's result)


@dataclass(frozen=True)
class Released:
    """The client finished its outstanding work and no longer uses the device.

    Either the answer to a Revoke decision, or unsolicited (``%gpushare release``).
    """

    now: float
    client: str
    evicted: bool = False
    bytes_moved: int = 0
    micros: int = 0
    evicted_bytes: int = -1  # the shim's total evicted bytes now; -1: not said


@dataclass(frozen=True)
class Evicted:
    """Answer to an Evict decision: the client's managed memory is on the host now.

    ``ok`` False: the eviction failed (a stream capture outlived the shim's bounded wait, or the
    driver refused the move): the memory is still on the GPU and must stay counted there.
    """

    now: float
    client: str
    bytes_moved: int = 0
    micros: int = 0
    ok: bool = True
    evicted_bytes: int = -1  # the shim's total evicted bytes now; -1: not said


@dataclass(frozen=True)
class Precopied:
    """Answer to a Precopy decision: ``precopied`` resident bytes now have a current host copy,
    so evicting them is an unmap (valid until the client's next GPU call)."""

    now: float
    client: str
    bytes_moved: int = 0
    micros: int = 0
    precopied: int = 0


@dataclass(frozen=True)
class Restored:
    """After a Grant with restore, or a RestoreAhead (``ahead``): the memory is back on the device.

    ``evicted_bytes``: what stayed on the host (a restore stops where the device has no room; -1:
    not said); ``precopied``: restored bytes whose host copy is still current (-1: not said).
    """

    now: float
    client: str
    bytes_moved: int = 0
    micros: int = 0
    ahead: bool = False
    evicted_bytes: int = -1
    precopied: int = -1


@dataclass(frozen=True)
class Idle:
    """The client is idle: the shim saw no GPU call for its window, or Jupyter's cell finished."""

    now: float
    client: str
    precopied: int = -1  # the shim's resident bytes with a current host copy; -1: not said
    # Jupyter's kernel watcher said so (kernel_state idle), not the shim's own detector: the
    # kernel is a notebook's even when the watcher missed its first cell's busy.
    from_jupyter: bool = False


@dataclass(frozen=True)
class Busy:
    """Jupyter says the kernel started executing a cell: it gets priority over idle holders."""

    now: float
    client: str


@dataclass(frozen=True)
class Coming:
    """Jupyter says a cell is coming for a kernel that does not hold the device (an execute
    request arrived while it is paused, evicted or waiting): its evicted memory may move back
    ahead of its turn (:mod:`.ahead`)."""

    now: float
    client: str


@dataclass(frozen=True)
class Leave:
    """The client's connection closed (clean exit, crash or kill -9)."""

    now: float
    client: str


@dataclass(frozen=True)
class Tick:
    """Time passed; sent by the shell at the deadline that :meth:`Policy.next_deadline` gave."""

    now: float


@dataclass(frozen=True)
class AdminRelease:
    """An operator (or the kernel's owner) asks that the client give the device back."""

    now: float
    client: str
    evict: bool = False


@dataclass(frozen=True)
class SetQuota:
    """An operator changes the client's memory quota (bytes, 0 = none)."""

    now: float
    client: str
    quota: int


@dataclass(frozen=True)
class SetWeight:
    """The operator's weight for the client changed (a reloaded users config)."""

    now: float
    client: str
    weight: float


@dataclass(frozen=True)
class HostMemory:
    """The host memory a client's engine holds, as its shim says (MEMORY, REQUEST, a move's
    answer, a reconnecting HELLO): ``host`` all of it (staging, copies of evicted memory),
    ``staging`` the part that is staging of resident memory (an eviction of those blocks copies
    into it and takes no more host memory). Node-wide, these count against the host budget
    (:mod:`.host_budget`)."""

    now: float
    client: str
    host: int = 0
    staging: int = 0


Event = (
    Join
    | Request
    | Memory
    | Released
    | Evicted
    | Precopied
    | Restored
    | Idle
    | Busy
    | Coming
    | Leave
    | Tick
    | AdminRelease
    | SetQuota
    | SetWeight
    | HostMemory
)

# --------------------------------------------------------------------------------------------
# Decisions


@dataclass(frozen=True)
class Grant:
    """Tell the client it holds the device; ``restore``: prefetch its evicted memory first.

    ``room_bytes``: the most device memory the client may hold backed during this grant (None:
    no limit); an allocation past it is not backed, and its launches wait for a grant with more.
    It is a bound the grant carries, not part of what is decided (who runs, with or without a
    restore), so two grants that differ only in it compare equal.
    """

    client: str
    restore: bool = False
    room_bytes: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Revoke:
    """Ask the client to finish its work and give the device back; ``evict``: to host memory."""

    client: str
    evict: bool = False
    reason: str = ""
    evict_bytes: int = 0  # with evict: the bytes to free on the GPU (0: everything)


@dataclass(frozen=True)
class Evict:
    """Ask a client that does not hold the device to move its managed memory to the host.

    ``bytes``: free at least this many on the GPU (pre-copied blocks first, then least recently
    used ones); 0: everything (partial eviction, docs/architecture.md).
    """

    client: str
    reason: str = ""
    bytes: int = 0


@dataclass(frozen=True)
class Precopy:
    """Ask an idle, resident client to copy its memory to the host in the background while it
    stays resident, so that a later eviction is an unmap."""

    client: str


@dataclass(frozen=True)
class RestoreAhead:
    """Ask a client that does not hold the device to move its evicted memory back to the GPU now,
    without a grant: its launches stay gated until one comes, and its turn then starts warm.

    ``bytes``: what the policy counts as coming back (it counts them on the GPU from now on, so
    the pool is never exceeded). Answered by :class:`Restored` with ``ahead`` (:mod:`.ahead`).
    """

    client: str
    bytes: int = 0


@dataclass(frozen=True)
class Room:
    """Tell a holder its grant's room changed: the most device memory it may hold backed from now
    on (None: no limit). Kernels beside it became busy or idle, or their memory grew or left, so
    the room its grant gave is no longer what the pool can give it. An allocation past it is not
    backed: the holder gives the device back and asks again (docs/protocol.md, "Room"). Sent
    only while ``room_updates`` is on."""

    client: str
    room_bytes: int | None = None


@dataclass(frozen=True)
class Staging:
    """Tell a client how much host staging it may hold for its resident memory (its share of the
    node's host budget, :mod:`.host_budget`): its shim makes staging up to it and gives back the
    rest. Sent only while the host budget is on, to clients that report their host memory."""

    client: str
    bytes: int = 0


@dataclass(frozen=True)
class Refuse:
    """Tell a waiter that its memory can never fit: more than the device's pool and the node's
    host budget together. Its shim prints ``message``; it is said once per wait."""

    client: str
    message: str = ""


Decision = Grant | Revoke | Evict | Precopy | RestoreAhead | Room | Staging | Refuse
