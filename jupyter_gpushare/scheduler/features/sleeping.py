"""The shell of deep idle: the pure :mod:`.deep_idle` decisions carried out on the event loop.

Checkpoint calls block for seconds: they run in the loop's thread executor. The order of a sleep:
the policy evicts the client's memory (an ``AdminRelease`` with eviction, as an operator's
``gpushare evict``), then ``cuCheckpointProcessLock`` + ``Checkpoint`` on the kernel's pid (the
one ``SO_PEERCRED`` gave, never the pid a HELLO claims), then ``SLEEP`` flag 1 tells the shim.
A wake (its ``REQUEST``, or its notebook's busy) runs ``Restore`` + ``Unlock``, then ``SLEEP``
flag 0, then the ``GRANT`` the policy decided meanwhile: a grant is never sent to a locked
process. Where the driver lacks the API (no symbol, or error 801) the feature says so once and
stays off.

Who makes the calls: the scheduler itself where the driver lets it (root, or the kernel's own
uid); otherwise a checkpoint agent of the kernel's user whose process the kernel descends from
(its Jupyter server: :mod:`.checkpoint_agent`). A kernel with neither never sleeps.

The same calls serve an operator's ``gpushare evict`` of a holder that does not answer its revoke
(:meth:`DeepIdleShell._force_evict`): its process is checkpointed without its help, its memory
is counted as gone from the GPU once the driver said so (not before: while the call runs, the
memory is still there), and it wakes only when the policy grants it the GPU again.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ...protocol import ErrorCode, Message, MsgType
from ...scheduler_client import REQUEST_SECONDS
from ...units import format_size
from ..core import events as ev
from ..shell.config import SchedulerConfig
from ..shell.transport import Connection, LogLimiter
from .checkpoint import CUDA_ERROR_NOT_SUPPORTED, CheckpointAPI, CheckpointError, may_checkpoint
from .checkpoint import load_cached as load_checkpoint_api
from .checkpoint_agent import ancestors, run_checkpoint
from .context_holders import context_holders
from .deep_idle import Action, ClientView, DeepIdle, EvictFirst, Phase, Sleep, Wake
from .nvml_check import ProcessMemory

#: Codes of failures that are not the driver's (CheckpointError.code).
NO_CHECKPOINTER = -1  # neither the scheduler nor an agent of the client's user may
AGENT_LOST = -2  # the agent's connection closed mid-call: what the driver did is unknown
#: How long an agent's call may take past the lock's own timeout (a checkpoint copies the
#: process's device memory to the host: seconds per tens of GiB) before its outcome is unknown.
AGENT_CALL_SECONDS = 300.0
#: How long a forced evict waits for checkpoint agents, past the lock's own timeout: this floor
#: plus FORCE_EVICT_SECONDS_PER_GIB for each GiB the holder has (the driver's checkpoint copied
#: 4 GiB in 3.5 s on an H100: 1 s a GiB leaves room). An agent of the holder's own user may
#: never answer (its user stops it on purpose): past this, the evict answers what it could do.
FORCE_EVICT_AGENT_SECONDS = 10.0
FORCE_EVICT_SECONDS_PER_GIB = 1.0
#: How long a client waits for the answer to an ``evict``: a holder that ignores its revoke is
#: checkpointed first, which copies its device memory to the host, and the answer waits for that
#: (the lock's timeout plus AGENT_CALL_SECONDS), then the request's own REQUEST_SECONDS. With the
#: REQUEST_SECONDS of every other request, an evict of a large holder on a loaded host was
#: reported as a scheduler that does not answer while it went on (``gpushare evict``, the server
#: extension's evict).
EVICT_REPLY_SECONDS = (
    float(SchedulerConfig.class_traits()["checkpoint_lock_timeout"].default_value)
    + AGENT_CALL_SECONDS
    + REQUEST_SECONDS
)

__all__ = ["DeepIdleShell"]


class DeepIdleShell:
    """Mixed into :class:`~.server.GPUShareScheduler`."""

    # Provided by the scheduler (server.py, shims.py, config.py).
    log: Any
    _log_limit: LogLimiter
    policy: Any
    deep_idle_seconds: float
    checkpoint_library: str
    checkpoint_lock_timeout: float
    revoke_warning_seconds: float
    _shims: dict[str, Connection]
    _stopping: bool
    _handle: Callable[[ev.Event], None]
    _execute: Callable[[list[ev.Decision]], None]
    _spawn: Callable[[Coroutine[Any, Any, None]], None]
    _notify_status: Callable[[], None]

    _deep_idle: DeepIdle
    _checkpoint_api: CheckpointAPI | None = None
    _held_grants: dict[str, ev.Grant]
    _deep_idle_timer: asyncio.TimerHandle | None = None
    _agents: dict[int, Connection]
    _agent_calls: dict[int, tuple[int, asyncio.Future[dict[str, Any]]]]  # seq: agent's serial
    _agent_seq: int = 0
    _last_processes: list[ProcessMemory]  # NVML's last sample (.shims)

    @property
    def _forced_pids(self) -> dict[str, list[int]]:
        """Client -> the processes its forced evict checkpointed (its wake restores them)."""
        return self.__dict__.setdefault("_forced_checkpointed", {})

    def _init_deep_idle(self) -> None:
        self._deep_idle = DeepIdle(0.0)  # off until start() found the API
        self._held_grants = {}
        self._deep_idle_timer = None
        self._checkpoint_api = None
        self._agents = {}
        self._agent_calls = {}
        self._agent_seq = 0

    async def _start_deep_idle(self) -> None:
        if self.deep_idle_seconds <= 0:
            self.log.info("gpushare: deep idle is off (deep_idle_seconds = 0)")
            return
        loop = asyncio.get_running_loop()
        timeout_ms = max(1, round(self.checkpoint_lock_timeout * 1000))
        api = await loop.run_in_executor(
            None, load_checkpoint_api, self.checkpoint_library, timeout_ms
        )
        if isinstance(api, str):
            self.log.warning(
                "gpushare: deep idle is off: the driver's process checkpoint API is missing (%s)",
                api,
            )
            return
        self._checkpoint_api = api
        self._deep_idle = DeepIdle(self.deep_idle_seconds)
        self.log.info(
            "gpushare: deep idle after %.0f s (process checkpoint through %s)",
            self.deep_idle_seconds,
            self.checkpoint_library,
        )

    def _stop_deep_idle(self) -> None:
        if self._deep_idle_timer is not None:
            self._deep_idle_timer.cancel()
            self._deep_idle_timer = None

    def _deep_idle_off(self, why: str) -> None:
        """The driver refused the API: say so once; nobody sleeps from now on (the asleep wake)."""
        if self._deep_idle.enabled:
            self.log.warning("gpushare: deep idle is off: %s", why)
        self._deep_idle.idle_seconds = 0.0

    # ----------------------------------------------------------------------------------------
    # Hooks the scheduler calls

    def _deep_idle_event(self, event: ev.Event) -> None:
        """Before the policy sees ``event``: a REQUEST or a busy notebook wakes a sleeper."""
        if isinstance(event, ev.Leave):
            self._deep_idle.leave(event.client)
            self._held_grants.pop(event.client, None)
        elif isinstance(event, ev.Request | ev.Busy):
            self._run_deep_idle(self._deep_idle.activity(event.client, event.now))

    def _deep_idle_holds(self, decision: ev.Decision) -> bool:
        """A grant to a client that is not awake waits for its wake (True: held here); a restore
        ahead of one is not sent (its process is locked, or about to be): the policy hears at
        once that everything stayed on the host, and the grant after the wake restores it."""
        if isinstance(decision, ev.RestoreAhead):
            if self._deep_idle.phase(decision.client) is Phase.AWAKE:
                return False
            stayed = ev.Restored(
                time.monotonic(), decision.client, ahead=True, evicted_bytes=1 << 62
            )
            asyncio.get_running_loop().call_soon(self._handle, stayed)
            return True
        if not isinstance(decision, ev.Grant):
            return False
        if not self._deep_idle.hold_grant(decision.client, time.monotonic()):
            return False
        self._held_grants[decision.client] = decision
        self.log.info("grant_held client=%s (waking it from deep idle first)", decision.client)
        if self._deep_idle.phase(decision.client) is Phase.ASLEEP:  # a forced sleeper, say
            self._run_deep_idle(self._deep_idle.activity(decision.client, time.monotonic()))
        return True

    def _deep_idle_pass(self) -> None:
        """After each event and timer: put the clients that are due to sleep; arm the timer."""
        if self._checkpoint_api is None or self.policy is None or self._stopping:
            return
        if not self._deep_idle.enabled:
            return  # turned off (by the driver): sleepers still wake
        now = time.monotonic()
        actions = self._deep_idle.observe(self._deep_idle_views(now), now)
        self._run_deep_idle(actions)
        self._arm_deep_idle_timer()

    def _deep_idle_overlay(self, devices: list[dict[str, Any]], now: float) -> None:
        """The status document says ``asleep`` (and ``waking``/``sleeping``) and counts the time
        grants waited for a wake into ``wait_seconds``."""
        for dev in devices:
            for client in dev.get("clients", []):
                cid = str(client.get("id"))
                phase = self._deep_idle.phase(cid)
                if phase is not Phase.AWAKE:  # a grant held for a wake is not running yet
                    client["state"] = phase.value
                extra = self._deep_idle.extra_wait(cid, now)
                if extra:
                    client["wait_seconds"] = float(client.get("wait_seconds") or 0.0) + extra

    # ----------------------------------------------------------------------------------------

    def _deep_idle_views(self, now: float) -> list[ClientView]:
        views = []
        for dev in self.policy.snapshot(now):
            for c in dev.get("clients", []):
                conn = self._shims.get(str(c["id"]))
                if conn is None or conn.closed:
                    continue
                resident = int(c.get("used_bytes") or 0) - int(c.get("pinned_bytes") or 0)
                resident -= int(c.get("evicted_bytes") or 0)
                views.append(
                    ClientView(
                        id=str(c["id"]),
                        pid=conn.peer.pid,
                        state=str(c.get("state")),
                        resident_bytes=max(0, resident),
                        idle=bool(c.get("idle")),
                        notebook=bool(c.get("notebook")),
                        may_checkpoint=self._checkpointer(conn, choose=False) is not None,
                    )
                )
        return views

    def _arm_deep_idle_timer(self) -> None:
        if self._deep_idle_timer is not None:
            self._deep_idle_timer.cancel()
            self._deep_idle_timer = None
        deadline = self._deep_idle.next_deadline()
        if deadline is None:
            return
        delay = max(0.01, deadline - time.monotonic())
        self._deep_idle_timer = asyncio.get_running_loop().call_later(delay, self._deep_idle_pass)

    def _run_deep_idle(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, EvictFirst):
                self.log.info("deep_idle client=%s step=evict (its memory first)", action.client)
                self._handle(ev.AdminRelease(time.monotonic(), action.client, evict=True))
            elif isinstance(action, Sleep):
                self._spawn(self._sleep_client(action))
            elif isinstance(action, Wake):
                self._spawn(self._wake_client(action))

    async def _sleep_client(self, action: Sleep) -> None:
        t0 = time.monotonic()
        ok = True
        conn = self._shims.get(action.client)
        try:
            if conn is None:
                raise CheckpointError("checkpoint", NO_CHECKPOINTER)
            await self._checkpoint_call(conn, "sleep", action.pid)
        except CheckpointError as exc:
            ok = exc.code == AGENT_LOST  # unknown: counted asleep, its wake puts it back
            if exc.code == CUDA_ERROR_NOT_SUPPORTED:
                self._deep_idle_off(f"{exc.call} answers CUDA_ERROR_NOT_SUPPORTED (801)")
            else:
                self.log.warning(
                    "sleep_failed client=%s pid=%d: %s; %s",
                    action.client,
                    action.pid,
                    exc,
                    "counted asleep: its wake puts back what was done" if ok else "it stays awake",
                )
        now = time.monotonic()
        if ok:
            self.log.info(
                "asleep client=%s pid=%d ms=%.1f", action.client, action.pid, (now - t0) * 1000
            )
            if conn is not None:
                conn.send(Message(MsgType.SLEEP, {"flag": 1}), self.log)
        follow = self._deep_idle.slept(action.client, ok, now)
        if not ok:
            self._send_held_grant(action.client)
        self._run_deep_idle(follow)
        self._notify_status()
        self._deep_idle_pass()

    async def _wake_client(self, action: Wake) -> None:
        t0 = time.monotonic()
        conn = self._shims.get(action.client)
        # A forced evict may have checkpointed its children rather than its own process: each
        # is woken, whatever became of the others.
        for pid in self._forced_pids.pop(action.client, None) or [action.pid]:
            try:
                if conn is None:
                    raise CheckpointError("wake", NO_CHECKPOINTER)
                await self._checkpoint_call(conn, "wake", pid)
            except CheckpointError as exc:
                # The process cannot be helped from here; its CUDA calls will fail and say so.
                self.log.error("wake_failed client=%s pid=%d: %s", action.client, pid, exc)
        now = time.monotonic()
        self.log.info("woke client=%s pid=%d ms=%.1f", action.client, action.pid, (now - t0) * 1000)
        self._deep_idle.woke(action.client, now)
        if conn is not None:
            conn.send(Message(MsgType.SLEEP, {"flag": 0}), self.log)
        self._send_held_grant(action.client)
        self._notify_status()
        self._deep_idle_pass()

    # ----------------------------------------------------------------------------------------
    # Who makes the driver's calls: the scheduler, or an agent of the client's user

    def _checkpointer(self, conn: Connection, choose: bool = True) -> str | Connection | None:
        """``"scheduler"`` when the driver lets this process checkpoint ``conn``'s (root, or
        its uid; never itself: an embedded scheduler shares the server's process), else a
        checkpoint agent of the client's uid: the one its process descends from, or any."""
        pid, uid = conn.peer.pid, conn.peer.uid
        if pid <= 0 or pid == os.getpid():
            return None
        if may_checkpoint(uid):
            return "scheduler"
        agents = [a for a in self._agents.values() if not a.closed and a.peer.uid == uid]
        if not agents or not choose:  # views ask after every event: no /proc walk for them
            return agents[0] if agents else None
        above = ancestors(pid)
        for agent in agents:
            if agent.peer.pid in above:
                return agent
        # A kernel its server adopted after a restart descends from no agent: another agent of
        # its uid may still try (the agent checks that it runs the shim; the driver decides).
        return agents[0]

    async def _checkpoint_call(
        self, conn: Connection, op: str, pid: int, agent_seconds: float | None = None
    ) -> str:
        """``op`` (sleep: lock + checkpoint; wake: restore + unlock) on ``pid``, a process of
        ``conn``'s, by the scheduler or an agent; who did it. An agent's answer is waited for
        ``agent_seconds`` (default: the lock's timeout plus AGENT_CALL_SECONDS). Raises
        CheckpointError."""
        who = self._checkpointer(conn)
        if who is None:
            raise CheckpointError(
                f"{op}: no checkpoint agent of uid {conn.peer.uid}", NO_CHECKPOINTER
            )
        loop = asyncio.get_running_loop()
        if who == "scheduler":
            api = await self._ensure_checkpoint_api()
            await loop.run_in_executor(None, run_checkpoint, api, op, pid)
            return "the scheduler"
        assert isinstance(who, Connection)
        self._agent_seq += 1
        seq = self._agent_seq
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._agent_calls[seq] = (who.serial, fut)
        body = {"action": "checkpoint", "op": op, "pid": pid, "seq": seq}
        who.send(Message(MsgType.CONTROL, {"body": body}), self.log)
        wait = self.checkpoint_lock_timeout + AGENT_CALL_SECONDS
        wait = wait if agent_seconds is None else agent_seconds
        deadline = time.monotonic() + wait
        try:
            while not fut.done():
                if who.closed or time.monotonic() > deadline:
                    why = "its connection closed" if who.closed else f"no answer in {wait:.0f} s"
                    raise CheckpointError(
                        f"{op} of pid {pid} by the agent of pid {who.peer.pid}: {why}", AGENT_LOST
                    )
                await asyncio.wait({fut}, timeout=0.2)
        finally:
            self._agent_calls.pop(seq, None)
        answer = fut.result()
        if not answer.get("ok"):
            code = answer.get("code")
            text = str(answer.get("error") or "failed")[:200]
            raise CheckpointError(
                f"{op} by the agent of pid {who.peer.pid}: {text}",
                code if isinstance(code, int) and code != 0 else 1,
            )
        return f"the checkpoint agent of uid {who.peer.uid} (pid {who.peer.pid})"

    async def _ensure_checkpoint_api(self) -> CheckpointAPI:
        api = self._checkpoint_api
        if api is None:
            loop = asyncio.get_running_loop()
            timeout_ms = max(1, round(self.checkpoint_lock_timeout * 1000))
            loaded = await loop.run_in_executor(
                None, load_checkpoint_api, self.checkpoint_library, timeout_ms
            )
            if isinstance(loaded, str):
                raise CheckpointError(f"the driver's checkpoint API: {loaded}", 801)
            api = self._checkpoint_api = loaded
        return api

    def _on_agent_control(self, conn: Connection, action: str, body: dict[str, Any]) -> None:
        """CONTROL ``checkpoint_agent`` (a process offers to checkpoint its own user's
        descendants) and ``checkpoint_done`` (its answer to a call)."""
        if action == "checkpoint_agent":
            for serial in [s for s, a in self._agents.items() if a.closed]:
                del self._agents[serial]
            self._agents[conn.serial] = conn
            self._log_limit.info(
                conn.peer.uid, "checkpoint_agent uid=%d pid=%d", conn.peer.uid, conn.peer.pid
            )
            body_out = {"ok": True, "action": action, "uid": conn.peer.uid}
            conn.send(Message(MsgType.CONTROL_REPLY, {"body": body_out}), self.log)
            self._deep_idle_pass()  # its user's idle kernels may sleep now
            return
        seq = body.get("seq")
        call = self._agent_calls.get(seq) if isinstance(seq, int) else None
        # Only the agent asked may answer: another's answer would count memory as gone.
        fut = call[1] if call is not None and call[0] == conn.serial else None
        if conn.serial not in self._agents or fut is None or fut.done():
            conn.error(ErrorCode.UNEXPECTED, "checkpoint_done without a call", self.log)
            return
        fut.set_result(dict(body))

    # ----------------------------------------------------------------------------------------
    # An operator's evict of a holder that does not answer (docs/reliability.md)

    def _may_force_evict(self, target: Connection) -> bool:
        """Whether an evict may take ``target``'s memory without its help: its revoke went
        unanswered past its deadline (``revoke_deadline_seconds``) or for as long as the
        scheduler waits before it warns (``revoke_warning_seconds``; a holder whose GPU work
        ends meanwhile answers by itself), and someone may checkpoint its process."""
        sent = target.revoked_at
        return (
            sent is not None
            and (target.overdue or time.monotonic() - sent >= self.revoke_warning_seconds)
            and target.client_id is not None
            and self._deep_idle.phase(target.client_id) is Phase.AWAKE
            and self._checkpointer(target) is not None
        )

    def _force_evict_seconds(self, used: int) -> float:
        """How long a forced evict waits for agents in all (FORCE_EVICT_AGENT_SECONDS)."""
        per_gib = FORCE_EVICT_SECONDS_PER_GIB * used / (1 << 30)
        return self.checkpoint_lock_timeout + FORCE_EVICT_AGENT_SECONDS + per_gib

    async def _force_evict(
        self, conn: Connection, target: Connection, reply: dict[str, Any]
    ) -> None:
        """Checkpoint the processes that may hold the holder's context (its process tree, and
        what NVML lists of its session: .context_holders); once the driver took memory off the
        GPU, the policy counts it as released and evicted, and its waiters run. Agents are
        waited for FORCE_EVICT_AGENT_SECONDS (and a second a GiB) in all. Answers ``conn``."""
        client = target.client_id
        assert client is not None and self.policy is not None
        used = 0
        for dev in self.policy.snapshot(time.monotonic()):
            for c in dev.get("clients", []):
                if c.get("id") == client:
                    used = int(c.get("used_bytes") or 0)
        t0 = time.monotonic()
        deadline = t0 + self._force_evict_seconds(used)
        device = (target.device or "").lower()
        listed = [p.pid for p in self._last_processes if p.device == device]
        loop = asyncio.get_running_loop()
        pids = await loop.run_in_executor(
            None, context_holders, target.peer.pid, target.peer.uid, listed
        )
        done: list[int] = []
        failures: list[str] = []
        who = ""
        for pid in pids or [target.peer.pid]:
            left = deadline - time.monotonic()
            if left <= 0:
                failures.append(f"pid {pid}: not tried, the evict's {deadline - t0:.0f} s ran out")
                continue
            try:
                who = await self._checkpoint_call(target, "sleep", pid, left)
                done.append(pid)
            except CheckpointError as exc:
                failures.append(str(exc))
        if not done:
            # Unknown outcomes included: its memory stays counted until the driver said so.
            why = "; ".join(failures) or "no process to checkpoint"
            self._log_limit.warning(
                target.peer.uid, "force_evict_failed client=%s: %s", client, why
            )
            reply["effect"] = f"{reply['effect']}; its process could not be checkpointed: {why}"
            self._reply_control(conn, reply)
            return
        now = time.monotonic()
        if target.closed or target.client_id is None:
            reply["effect"] = f"{reply['effect']}; it left meanwhile"
            self._reply_control(conn, reply)
            return
        self._forced_pids[client] = done  # what its wake restores (_wake_client)
        self._deep_idle.forced(client, target.peer.pid)
        self._held_grants.pop(client, None)
        target.send(Message(MsgType.SLEEP, {"flag": 1}), self.log)
        self.log.warning(
            "force_evict client=%s pid=%d checkpointed=%s by=%r %s ms=%.1f: checkpointed "
            "without its help; it wakes when it is granted the GPU again",
            client,
            target.peer.pid,
            ",".join(map(str, done)),
            who,
            format_size(used),
            (now - t0) * 1000,
        )
        self._handle(ev.Memory(now, client, used=used, managed=used, pinned=0, evicted=used))
        self._handle(ev.Released(now, client, evicted=True))
        target.revoked_at = None
        target.revoking = target.overdue = False
        reply["done"] = reply["checkpointed"] = True
        reply["effect"] = (
            f"its process was checkpointed by {who}: {format_size(used)} left the GPU without its "
            "help; it wakes when it is granted the GPU again"
        )
        if done != [target.peer.pid]:
            reply["effect"] += f" (processes checkpointed: {', '.join(map(str, done))})"
        self._reply_control(conn, reply)
        self._notify_status()

    def _reply_control(self, conn: Connection, body: dict[str, Any]) -> None:
        conn.send(Message(MsgType.CONTROL_REPLY, {"body": body}), self.log)

    def _send_held_grant(self, client: str) -> None:
        grant = self._held_grants.pop(client, None)
        if grant is not None:
            self._execute([grant])
