"""What a scheduler keeps for the next one on its socket, in the asyncio shell (.resume says
what and why): the resume key and the kept state read at start, the state written as the clients
change (in an executor, one write at a time) and when the scheduler stops."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from ..core.policy import Policy
from .kernel_ids import KernelIds
from .resume import KeptClient, KeptState, ResumeKey
from .transport import Connection, SocketFile

__all__ = ["KeptStateShell"]


class KeptStateShell:
    """Mixed into :class:`~.server.GPUShareScheduler`, whose state it reads (below)."""

    log: Any
    policy: Policy | None
    socket_file: SocketFile
    _server: asyncio.AbstractServer | None
    _stopping: bool
    _shims: dict[str, Connection]
    _resume_key: ResumeKey
    _kept: KeptState | None
    _keeping: asyncio.Future[None] | None
    _keep_again: bool
    _remember_owner: Callable[[str, str], None]  # .shims.ShimSessions
    _kernel_ids: KernelIds

    @property
    def _private_dir(self) -> str:
        return os.path.join(self.socket_file.directory, ".gpushare-private")

    async def _load_resume_key(self) -> None:
        """The key resume secrets come from and the clients the last scheduler kept, in a
        private directory beside the socket, so that this scheduler can check the secrets the
        last one gave (.resume)."""
        directory = self._private_dir
        loop = asyncio.get_running_loop()
        try:
            self._resume_key = await loop.run_in_executor(None, ResumeKey.load_or_create, directory)
        except OSError as exc:
            self.log.warning(
                "gpushare: no resume key in %s (%s): after a restart, holders will wait",
                directory,
                exc,
            )
            return
        kept = await loop.run_in_executor(None, KeptState.take, directory)
        if isinstance(kept, str):
            self.log.warning(
                "gpushare: the kept state is refused whole: %s; after this restart, holders "
                "wait and kernel ids are first come, first served until their provisioners "
                "bind them again",
                kept,
            )
            kept = None
        self._kept = kept
        if self._kept is not None:
            self._kernel_ids.restore(self._kept.bound)  # bound ids stay bound (.kernel_ids)
        for kept in self._kept.clients if self._kept is not None else []:
            # Each id stays its user's: nobody who connects first after the restart takes it.
            self._remember_owner(kept.requested_id, kept.user)
            self._remember_owner(kept.client_id, kept.user)

    def _forget_kept_after(self, seconds: float) -> None:
        """The kept state proves claims during the recovery window only."""
        if seconds <= 0:
            self._kept = None
            return
        kept = self._kept

        def forget() -> None:
            if self._kept is kept:
                self._kept = None

        asyncio.get_running_loop().call_later(seconds, forget)

    def _kept_state(self) -> KeptState:
        """The clients as they are now, for the next scheduler (.resume.KeptState)."""
        mono, wall = time.monotonic(), time.time()
        waiting = {
            c["id"]: c.get("waiting_since")
            for d in (self.policy.snapshot(mono) if self.policy is not None else [])
            for c in d.get("clients", [])
        }
        clients = []
        for conn in self._shims.values():
            if conn.left or conn.client_id is None or conn.identity is None:
                continue
            since = waiting.get(conn.client_id)
            if conn.granted_at is not None:
                since = conn.granted_at
            held = conn.grant if conn.granted_at is not None else ""
            clients.append(
                KeptClient(
                    conn.requested_id,
                    conn.client_id,
                    conn.peer.uid,
                    conn.identity.user,
                    held,
                    None if since is None else round(wall - (mono - since), 3),
                )
            )
        return KeptState(wall, clients, self._kernel_ids.kept())

    def _keep_state(self) -> None:
        """Write the kept state (in an executor; one write at a time, the latest wins)."""
        if self._server is None or self._stopping:
            return
        if self._keeping is not None:
            self._keep_again = True
            return
        loop = asyncio.get_running_loop()
        self._keeping = loop.run_in_executor(None, self._kept_state().save, self._private_dir)
        self._keeping.add_done_callback(self._kept_written)

    def _kept_written(self, done: asyncio.Future[None]) -> None:
        self._keeping = None
        if not done.cancelled() and done.exception() is not None:
            self.log.debug("gpushare: cannot keep the state: %s", done.exception())
        if self._keep_again:
            self._keep_again = False
            self._keep_state()

    async def _keep_state_now(self) -> None:
        """At stop, before the connections close: the state as it is, for the next one."""
        if self._keeping is not None:
            with contextlib.suppress(Exception):
                await self._keeping
        state = self._kept_state()
        with contextlib.suppress(OSError):
            await asyncio.get_running_loop().run_in_executor(None, state.save, self._private_dir)
