"""Memory claims cross-checked with what NVML sees each process hold (docs/reliability.md, item 7).

A shim says how much device memory its process holds (``used_bytes``, its context estimate
included); the scheduler bounds that claim above (quota, device size), and here below: where NVML
reports the process's memory on the device (``nvmlDeviceGetComputeRunningProcesses``), the client
counts as using the larger of its claim and NVML's figure. NVML's figure includes the process's
real CUDA context, which the claim stands for with an estimate (``GPUSHARE_CONTEXT_BYTES``), so
nothing is subtracted: a context larger than its estimate is memory on the device, and counts.

The part of NVML's figure the claim does not cover counts as pinned: the shim never declared it,
so no eviction the scheduler asks for can move it.

Pure: the NVML readings come in as :class:`ProcessMemory` samples taken off the event loop
(:meth:`.devices.UtilizationSampler.processes`); nothing here reads a clock, a file or NVML.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "MEMORY_KEYS",
    "ClientClaim",
    "ProcessMemory",
    "corrected",
    "observed",
    "on_device",
    "pids_comparable",
    "under_claim",
    "unmanaged",
]


#: A client's memory as the shell keeps it (``Connection.memory``) and policy events carry it.
MEMORY_KEYS = ("used", "managed", "pinned", "evicted")


@dataclass(frozen=True)
class ProcessMemory:
    """One process NVML lists on one device: its pid (as NVML gives it), its bytes there, and
    the uid owning that pid in the scheduler's ``/proc`` (-1: no such process there)."""

    device: str  # lower-case device uuid
    pid: int
    used: int
    uid: int


@dataclass(frozen=True)
class ClientClaim:
    """A shim client as the scheduler knows it: its process (``SO_PEERCRED``) and its claim."""

    client: str
    device: str  # lower-case device uuid
    pid: int  # in the scheduler's pid namespace; 0: unknown
    uid: int
    used: int  # what it claims to use (bounded above already)


def pids_comparable(proc_self_status: str) -> bool:
    """Whether NVML's pids can be matched with ``SO_PEERCRED``'s, from ``/proc/self/status``.

    NVML names processes by their pid in the host's (initial) pid namespace; ``SO_PEERCRED``
    gives them in the scheduler's. The two agree only when the scheduler runs in the initial
    namespace, where its ``NSpid`` line holds one pid (a container adds one per level). A kernel
    without the line (before 4.1) cannot say: not comparable.
    """
    for line in proc_self_status.splitlines():
        if line.startswith("NSpid:"):
            return len(line.split()[1:]) == 1
    return False


def observed(claims: Iterable[ClientClaim], processes: Iterable[ProcessMemory]) -> dict[str, int]:
    """The bytes NVML sees for each client, 0 where it sees none it can match.

    A process matches a client when its device and pid are the client's and the pid belongs to
    the client's uid (a pid reused by another user's process is not the client). When several
    clients share one process and device, NVML's one figure is theirs together: the first (by id)
    is given what the others' claims leave of it.
    """
    seen = {(p.device, p.pid): p for p in processes if p.pid > 0}
    groups: dict[tuple[str, int], list[ClientClaim]] = {}
    out: dict[str, int] = {}
    for claim in claims:
        out[claim.client] = 0
        proc = seen.get((claim.device, claim.pid))
        if claim.pid > 0 and proc is not None and proc.uid == claim.uid:
            groups.setdefault((claim.device, claim.pid), []).append(claim)
    for key, group in groups.items():
        first, *others = sorted(group, key=lambda c: c.client)
        out[first.client] = max(0, seen[key].used - sum(max(0, c.used) for c in others))
    return out


def corrected(memory: Mapping[str, int], seen: int, residency: bool = True) -> dict[str, int]:
    """``memory`` (a bounded claim: used, managed, pinned, evicted) counted as at least ``seen``
    bytes used; what the claim leaves out of ``seen`` is pinned.

    ``residency``: the reading was taken after the client's last eviction or restore, so it
    checks the claim's residency too. What the claim says is on the device (``used`` less
    ``evicted``) is then at least ``seen``: memory claimed as evicted that NVML still sees on
    the card (A14d) is not evicted, and counts as pinned (no eviction the scheduler asks for
    moves it), so the client's footprint off its turn is NVML's figure."""
    out = {"used": 0, "managed": 0, "pinned": 0, "evicted": 0, **memory}
    missing = seen - out["used"]
    if missing > 0:
        out["used"] = seen
        out["pinned"] += missing
    if residency:
        hidden = min(out["evicted"], seen - on_device(out))
        if hidden > 0:
            out["evicted"] -= hidden
            out["pinned"] = min(out["used"], out["pinned"] + hidden)
    return out


def on_device(memory: Mapping[str, int]) -> int:
    """What a claim says is on the device: what it uses less what it says is on the host."""
    return max(0, memory.get("used", 0) - memory.get("evicted", 0))


def under_claim(claimed: int, seen: int, context_estimate: int) -> int:
    """How far a claim falls short of what NVML sees: 0 not at all; 1 by no more than the
    client's context estimate (a real context larger than its estimate: honest); 2 by more (a
    lie, or memory the shim did not see allocated). Only what is logged depends on it."""
    missing = seen - claimed
    if missing <= 0:
        return 0
    return 1 if missing <= context_estimate else 2


def unmanaged(
    claims: Iterable[ClientClaim], processes: Iterable[ProcessMemory]
) -> dict[str, list[ProcessMemory]]:
    """The processes NVML lists that are no client's, by device: neither the pid of a client
    on that device nor, when it is, of the client's uid (a pid reused by another user). Their
    memory is on the card and no scheduling moves it (issue 22, item 8)."""
    clients = {(c.device, c.pid, c.uid) for c in claims if c.pid > 0}
    out: dict[str, list[ProcessMemory]] = {}
    for proc in processes:
        if proc.used > 0 and (proc.device, proc.pid, proc.uid) not in clients:
            out.setdefault(proc.device, []).append(proc)
    return out
