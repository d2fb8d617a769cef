"""The shell of deep idle: the pure :mod:`.deep_idle` decisions carried out on the event loop.

Checkpoint calls block for seconds: they run in the loop's thread executor. The order of a sleep:
the policy evicts the client's memory (an ``AdminRelease`` with eviction, as an operator's
``gpushare evict``), then ``cuCheckpointProcessLock`` + ``Checkpoint`` on the kernel's pid (the
one ``SO_PEERCRED`` gave, never the pid a HELLO claims), then ``SLEEP`` flag 1 tells the shim.
A wake (its ``REQUEST``, or its notebook's busy) runs ``Restore`` + ``Unlock``, then ``SLEEP``
flag 0, then the ``GRANT`` the policy decided meanwhile: a grant is never sent to a locked
process. Where the driver lacks the API (no symbol, or error 801) the feature says so once and
stays off.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..protocol import Message, MsgType
from . import events as ev
from .checkpoint import CUDA_ERROR_NOT_SUPPORTED, CheckpointAPI, CheckpointError, may_checkpoint
from .checkpoint import load_cached as load_checkpoint_api
from .deep_idle import Action, ClientView, DeepIdle, EvictFirst, Phase, Sleep, Wake
from .transport import Connection

__all__ = ["DeepIdleShell"]


class DeepIdleShell:
    """Mixed into :class:`~.server.GPUShareScheduler`."""

    # Provided by the scheduler (server.py, shims.py, config.py).
    log: Any
    policy: Any
    deep_idle_seconds: float
    checkpoint_library: str
    checkpoint_lock_timeout: float
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

    def _init_deep_idle(self) -> None:
        self._deep_idle = DeepIdle(0.0)  # off until start() found the API
        self._held_grants = {}
        self._deep_idle_timer = None
        self._checkpoint_api = None

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
        """A grant to a client that is not awake waits for its wake (True: held here)."""
        if not isinstance(decision, ev.Grant):
            return False
        if not self._deep_idle.hold_grant(decision.client, time.monotonic()):
            return False
        self._held_grants[decision.client] = decision
        self.log.info("grant_held client=%s (waking it from deep idle first)", decision.client)
        return True

    def _deep_idle_pass(self) -> None:
        """After each event and timer: put the clients that are due to sleep; arm the timer."""
        if self._checkpoint_api is None or self.policy is None or self._stopping:
            return
        if not self._deep_idle.enabled:  # turned off by the driver: sleepers still wake
            return
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
                        # Never itself (an embedded scheduler shares the server's process).
                        may_checkpoint=may_checkpoint(conn.peer.uid)
                        and conn.peer.pid != os.getpid(),
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
        api = self._checkpoint_api
        assert api is not None
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        ok = True
        try:
            await loop.run_in_executor(None, api.sleep, action.pid)
        except CheckpointError as exc:
            ok = False
            if exc.code == CUDA_ERROR_NOT_SUPPORTED:
                self._deep_idle_off(f"{exc.call} answers CUDA_ERROR_NOT_SUPPORTED (801)")
            else:
                self.log.warning(
                    "sleep_failed client=%s pid=%d: %s; it stays awake",
                    action.client,
                    action.pid,
                    exc,
                )
        now = time.monotonic()
        conn = self._shims.get(action.client)
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
        api = self._checkpoint_api
        assert api is not None
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        try:
            await loop.run_in_executor(None, api.wake, action.pid)
        except CheckpointError as exc:
            # The process cannot be helped from here; its CUDA calls will fail and say so.
            self.log.error("wake_failed client=%s pid=%d: %s", action.client, action.pid, exc)
        now = time.monotonic()
        self.log.info("woke client=%s pid=%d ms=%.1f", action.client, action.pid, (now - t0) * 1000)
        self._deep_idle.woke(action.client, now)
        conn = self._shims.get(action.client)
        if conn is not None:
            conn.send(Message(MsgType.SLEEP, {"flag": 0}), self.log)
        self._send_held_grant(action.client)
        self._notify_status()
        self._deep_idle_pass()

    def _send_held_grant(self, client: str) -> None:
        grant = self._held_grants.pop(client, None)
        if grant is not None:
            self._execute([grant])
