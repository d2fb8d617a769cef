"""Deep idle: when a kernel gives back everything, its CUDA context included, and when it wakes.

A pure state machine beside the policy (:mod:`.policy`): views of the clients and events in,
actions out; no I/O and no clock of its own. The shell (:mod:`.sleeping`) carries the actions out
with the driver's process checkpoint API (:mod:`.checkpoint`).

The rules:

* A client is *due* once it has been quiet for ``idle_seconds`` without interruption: the policy's
  state ``idle`` (it neither holds the device, nor waits, nor is being evicted), or a holder whose
  cell ended.
* A due client whose memory is still on the GPU, or that still holds the device (an idle holder
  keeps its grant while nobody else wants it), is first released with eviction
  (:class:`EvictFirst`, once per idle period): its data goes to the host through the memory engine
  as any eviction, so the checkpoint that follows only has the context left to save, and a locked
  process never holds a grant (its next call would block in the driver without asking). One
  whose memory is on the host (or that has none) is put to sleep (:class:`Sleep`).
* A sleeping or asleep client that asks for the device (``REQUEST``) or whose notebook turns busy
  is woken (:class:`Wake`); a wake asked while the checkpoint is still in flight follows it at once.
* A grant to a client that is not awake is held back until the wake has completed
  (:meth:`DeepIdle.may_grant`): the driver blocks the locked process's CUDA calls anyway, but the
  shim must not believe it holds the device before its context is back.
* A sleep that fails leaves the client awake; it is not tried again in the same idle period. A
  client nobody may checkpoint (another uid, the scheduler not root, and no checkpoint agent of
  the client's user above its process: :mod:`.checkpoint_agent`) is never due.
* A sleep whose outcome is unknown (the agent making it was lost mid-call) counts as done: the
  client is asleep, and its wake puts back whatever the driver did.
* An operator's ``evict`` of a holder that does not answer its revoke may checkpoint it
  (:meth:`DeepIdle.forced`): it is asleep, and its activity does not wake it; only a grant does
  (the policy counted its memory as evicted, so a wake before the grant would put it back on the
  GPU beside the waiters that took its room).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "Action",
    "ClientView",
    "DeepIdle",
    "EvictFirst",
    "Phase",
    "Sleep",
    "Wake",
]


class Phase(enum.Enum):
    AWAKE = "awake"
    SLEEPING = "sleeping"  # lock + checkpoint in flight
    ASLEEP = "asleep"
    WAKING = "waking"  # restore + unlock in flight


@dataclass(frozen=True)
class ClientView:
    """What deep idle needs to know of one client (from the policy's status)."""

    id: str
    pid: int
    state: str  # the policy's: running, revoking, waiting, evicting, idle
    resident_bytes: int  # movable memory still on the GPU (used - pinned - evicted)
    idle: bool = False  # its cell ended: a holder that is idle may sleep (after a revoke)
    may_checkpoint: bool = True  # the scheduler's uid may checkpoint this process
    # Jupyter reports its cells. Only such a kernel sleeps: its notebook's busy wakes it before
    # the cell's first CUDA call. Another program's first call after a sleep may be one the shim
    # does not gate (cuCtxGetCurrent, say): the locked driver blocks it before the shim can ask
    # for a wake (seen on an H100: a plain PyTorch program never woke).
    notebook: bool = True


@dataclass(frozen=True)
class EvictFirst:
    """Have the policy evict the client's memory (its data goes to the host first)."""

    client: str


@dataclass(frozen=True)
class Sleep:
    """Lock and checkpoint the client's process."""

    client: str
    pid: int


@dataclass(frozen=True)
class Wake:
    """Restore and unlock the client's process."""

    client: str
    pid: int


Action = EvictFirst | Sleep | Wake


@dataclass
class _Entry:
    pid: int
    phase: Phase = Phase.AWAKE
    idle_since: float | None = None
    evict_asked: bool = False
    failed: bool = False  # a sleep failed in this idle period: not again until it runs
    wake_wanted: bool = False  # asked while the checkpoint was in flight
    wake_started: float | None = None
    grant_held_since: float | None = None  # a grant waits for the wake to complete
    forced: bool = False  # checkpointed by an operator's evict: only a grant wakes it
    held_seconds: float = 0.0  # time grants waited for wakes (counted into its wait)
    sleeps: int = 0


@dataclass
class DeepIdle:
    """Deep-idle state of every client; ``idle_seconds`` <= 0 turns the feature off."""

    idle_seconds: float
    _clients: dict[str, _Entry] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.idle_seconds > 0

    # ----------------------------------------------------------------------------------------
    # Inputs

    def observe(self, views: Iterable[ClientView], now: float) -> list[Action]:
        """Take the clients as the policy sees them now; return the sleeps (and evictions
        before a sleep) that are due."""
        out: list[Action] = []
        seen: set[str] = set()
        for v in views:
            seen.add(v.id)
            e = self._clients.setdefault(v.id, _Entry(v.pid))
            e.pid = v.pid or e.pid
            if e.phase is not Phase.AWAKE:
                continue
            holder = v.state == "running"
            if not (v.state == "idle" or (holder and v.idle)):
                if v.state not in ("evicting", "revoking"):  # its own release before a sleep
                    self._active(e)
                continue
            if not (v.may_checkpoint and v.notebook and v.pid > 0):
                e.idle_since = None  # never due: no deadline either
                continue
            if e.idle_since is None:
                e.idle_since = now
            if not self._due(e, v, now):
                continue
            if (holder or v.resident_bytes > 0) and not e.evict_asked:
                e.evict_asked = True
                out.append(EvictFirst(v.id))
            elif holder:
                continue  # its revoke is answered first: a locked holder would never ask again
            else:
                e.phase = Phase.SLEEPING
                out.append(Sleep(v.id, e.pid))
        for gone in set(self._clients) - seen:
            del self._clients[gone]
        return out

    def activity(self, client: str, now: float) -> list[Action]:
        """The client asked for the device, or its notebook turned busy: wake it if it sleeps."""
        e = self._clients.get(client)
        if e is None:
            return []
        self._active(e)
        if e.forced and e.grant_held_since is None:
            return []  # its room went to others: a grant wakes it (hold_grant)
        if e.phase is Phase.ASLEEP:
            e.phase = Phase.WAKING
            e.wake_started = now
            return [Wake(client, e.pid)]
        if e.phase is Phase.SLEEPING:
            e.wake_wanted = True
        return []

    def slept(self, client: str, ok: bool, now: float) -> list[Action]:
        """The checkpoint finished (``ok``) or failed (the process runs on, awake)."""
        e = self._clients.get(client)
        if e is None or e.phase is not Phase.SLEEPING:
            return []
        if not ok:
            e.phase = Phase.AWAKE
            e.failed = True
            e.wake_wanted = False
            if e.grant_held_since is not None:
                e.held_seconds += max(0.0, now - e.grant_held_since)
                e.grant_held_since = None
            return []
        e.phase = Phase.ASLEEP
        e.sleeps += 1
        if e.wake_wanted:
            e.wake_wanted = False
            e.phase = Phase.WAKING
            e.wake_started = now
            return [Wake(client, e.pid)]
        return []

    def forced(self, client: str, pid: int) -> None:
        """An operator's evict checkpointed the client (a holder that ignored its revoke)."""
        e = self._clients.setdefault(client, _Entry(pid))
        e.phase = Phase.ASLEEP
        e.forced = True
        e.sleeps += 1

    def woke(self, client: str, now: float) -> None:
        """Restore and unlock finished (failed or not: the process is not locked any more)."""
        e = self._clients.get(client)
        if e is None or e.phase is not Phase.WAKING:
            return
        e.phase = Phase.AWAKE
        e.forced = False
        e.wake_started = None
        if e.grant_held_since is not None:
            e.held_seconds += max(0.0, now - e.grant_held_since)
            e.grant_held_since = None
        self._active(e)

    def leave(self, client: str) -> None:
        self._clients.pop(client, None)

    # ----------------------------------------------------------------------------------------
    # Questions

    def asleep(self) -> list[str]:
        return [cid for cid, e in self._clients.items() if e.phase is Phase.ASLEEP]

    def phase(self, client: str) -> Phase:
        e = self._clients.get(client)
        return Phase.AWAKE if e is None else e.phase

    def may_grant(self, client: str) -> bool:
        """A grant may go out: the client's process is neither locked nor being locked."""
        return self.phase(client) is Phase.AWAKE

    def hold_grant(self, client: str, now: float) -> bool:
        """Whether a grant the policy decided now must wait for the client's wake (its process
        is locked, or being locked). The time it waits counts into the client's wait."""
        e = self._clients.get(client)
        if e is None or e.phase is Phase.AWAKE:
            return False
        if e.grant_held_since is None:
            e.grant_held_since = now
        if e.phase is Phase.SLEEPING:
            e.wake_wanted = True
        return True

    def extra_wait(self, client: str, now: float) -> float:
        """Seconds the client's grants have waited for wakes (one in flight counts to ``now``);
        the policy, which granted at once, does not count them as waiting."""
        e = self._clients.get(client)
        if e is None:
            return 0.0
        current = 0.0 if e.grant_held_since is None else max(0.0, now - e.grant_held_since)
        return e.held_seconds + current

    def next_deadline(self) -> float | None:
        """When the next awake, idle client becomes due (None: nobody will)."""
        if not self.enabled:
            return None
        times = [
            e.idle_since + self.idle_seconds
            for e in self._clients.values()
            if e.phase is Phase.AWAKE
            and e.idle_since is not None
            and not e.failed
            and not e.evict_asked  # its Evicted answer is the next event to look at
        ]
        return min(times, default=None)

    # ----------------------------------------------------------------------------------------

    def _due(self, e: _Entry, v: ClientView, now: float) -> bool:
        return (
            self.enabled
            and not e.failed
            and e.idle_since is not None
            and now - e.idle_since >= self.idle_seconds
        )

    @staticmethod
    def _active(e: _Entry) -> None:
        e.idle_since = None
        e.evict_asked = False
        e.failed = False
