"""The status document as the REST API serves it, and its push to websocket subscribers.

:func:`enrich` adds Jupyter's view to the scheduler's document (docs/protocol.md): for each client
that is a kernel of this server its notebook path(s) from the session manager, kernel name and
execution state; for clients of other users, the notebook path (``label``) is redacted unless the
viewer is a gpushare admin. It also lists this server's GPU-shared kernels that the scheduler does
not (yet) list, under ``unregistered``: the shim registers a kernel at its first GPU call, so a
kernel that made none, or runs where there is no GPU, is in no device's ``clients`` (the magic says
the same of it: ``%gpushare status`` "not registered yet", ``%gpushare release`` "no GPU call yet").

:class:`StatusBroadcaster` pushes the document to subscribers when it changes. With the embedded
scheduler it is woken by the scheduler itself (no polling at all while nothing happens); with a
node scheduler it polls every ``interval`` seconds, and only while someone is subscribed. Either
way pushes are at most every ``interval`` seconds, and counters that tick by themselves
(``gpu_seconds``, ``wait_seconds``) alone cause a push at most every ``refresh`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..protocol import kernel_client_id
from ..scheduler_client import SchedulerError, SchedulerUnavailable
from ..scheduler_view import NO_GPU
from .backend import SchedulerBackend

__all__ = ["StatusBroadcaster", "enrich", "kernel_id_of", "signature", "unregistered_kernels"]

#: Client fields that change continuously while a client runs or waits.
VOLATILE_CLIENT_FIELDS = ("gpu_seconds", "wait_seconds")

Push = Callable[[dict[str, Any] | None, str | None], Awaitable[None]]


def kernel_id_of(client_id: str) -> str:
    """The kernel id of a scheduler client id (a kernel's subprocess is ``<kernel>#<pid>``)."""
    return kernel_client_id(client_id)


def signature(doc: dict[str, Any] | None, error: str | None = None) -> str:
    """A string that changes when the document changes in a way worth an immediate push."""
    if doc is None:
        return f"error:{error}"
    devices = []
    for dev in doc.get("devices", []):
        d = dict(dev)
        d["clients"] = [
            {k: v for k, v in c.items() if k not in VOLATILE_CLIENT_FIELDS}
            for c in dev.get("clients", [])
        ]
        devices.append(d)
    return json.dumps({**doc, "devices": devices}, sort_keys=True, default=str)


async def _sessions_by_kernel(session_manager: Any) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    if session_manager is None:
        return out
    try:
        sessions = await session_manager.list_sessions()
    except Exception:
        return out
    for s in sessions:
        kernel = s.get("kernel") or {}
        kid = kernel.get("id")
        if kid:
            out.setdefault(kid, []).append(
                {
                    "id": s.get("id"),
                    "path": s.get("path"),
                    "name": s.get("name"),
                    "type": s.get("type"),
                }
            )
    return out


def is_shared_kernel(km: Any) -> bool:
    """Does this kernel manager's kernel run under gpushare (launched by its provisioner)?"""
    from ..provisioner import GPUShareProvisioner

    return isinstance(getattr(km, "provisioner", None), GPUShareProvisioner)


def unregistered_kernels(
    doc: dict[str, Any],
    kernel_manager: Any,
    sessions: dict[str, list[dict[str, Any]]],
    is_shared: Callable[[Any], bool] = is_shared_kernel,
) -> list[dict[str, Any]]:
    """This server's GPU-shared kernels that no device of ``doc`` lists, each with why."""
    if kernel_manager is None:
        return []
    listed = {
        kernel_id_of(str(c.get("id", "")))
        for dev in doc.get("devices", []) or []
        for c in dev.get("clients", []) or []
    }
    no_gpu = not doc.get("devices") and doc.get("nvml") is not True  # as the magic decides
    out = []
    for kid in sorted(kernel_manager.list_kernel_ids()):
        km = kernel_manager.get_kernel(kid)
        if kid in listed or not is_shared(km):
            continue
        paths = [s["path"] for s in sessions.get(kid, []) if s.get("path")]
        out.append(
            {
                "kernel_id": kid,
                "kernel_name": getattr(km, "kernel_name", None),
                "execution_state": getattr(km, "execution_state", None),
                "paths": paths,
                "reason": "no-gpu" if no_gpu else "no-gpu-call",
                "text": NO_GPU
                if no_gpu
                else "not registered yet (at its first GPU call); holds no GPU",
            }
        )
    return out


async def enrich(
    doc: dict[str, Any],
    *,
    kernel_manager: Any,
    session_manager: Any,
    viewer: str | None,
    admin: bool,
    backend: SchedulerBackend | None = None,
    own_uid: int | None = None,
    is_shared: Callable[[Any], bool] = is_shared_kernel,
) -> dict[str, Any]:
    """A copy of the scheduler's ``doc`` with Jupyter's view added (see the module docstring)."""
    out = copy.deepcopy(doc)
    own_uid = os.getuid() if own_uid is None else own_uid
    local = set(kernel_manager.list_kernel_ids()) if kernel_manager is not None else set()
    sessions = await _sessions_by_kernel(session_manager)
    hub_user = os.environ.get("JUPYTERHUB_USER")
    # A node scheduler says whom it took this server for (its "identity": a uid's user, or the
    # hub user a token proves) and has already left out other users' clients unless that
    # identity is an admin. Ownership then goes by that user: many hub users may share one uid.
    identity = out.get("identity")
    own_user = identity.get("user") if isinstance(identity, dict) else None
    for dev in out.get("devices", []):
        for client in dev.get("clients", []):
            kid = kernel_id_of(str(client.get("id", "")))
            is_local = kid in local
            info: dict[str, Any] = {"local": is_local, "kernel_id": kid if is_local else None}
            if is_local:
                km = kernel_manager.get_kernel(kid)
                info["kernel_name"] = getattr(km, "kernel_name", None)
                info["execution_state"] = getattr(km, "execution_state", None)
                info["sessions"] = sessions.get(kid, [])
                info["paths"] = [s["path"] for s in info["sessions"] if s.get("path")]
                info["user"] = hub_user or client.get("user")
            if own_user is not None:
                mine = is_local or client.get("user") == own_user
            else:
                mine = is_local or client.get("uid") == own_uid
            if not mine and not admin:
                client["label"] = ""
                client["redacted"] = True
            else:
                client["redacted"] = False
            client["jupyter"] = info
    out["unregistered"] = unregistered_kernels(out, kernel_manager, sessions, is_shared)
    out["viewer"] = {"name": viewer, "admin": admin}
    if backend is not None:
        out["scheduler"] = backend.describe()
    return out


class StatusBroadcaster:
    """Pushes the raw status document to subscribers when it changes (see the module docstring).

    ``on_change(doc, error)`` is called once per significant change, whoever listens (the
    extension emits a jupyter_events event from it)."""

    def __init__(
        self,
        backend: SchedulerBackend,
        *,
        interval: float = 0.5,
        refresh: float = 5.0,
        on_change: Callable[[dict[str, Any] | None, str | None], None] | None = None,
        log: Any = None,
        local_kernels: Callable[[], list[str]] | None = None,
    ) -> None:
        self.backend = backend
        self.interval = interval
        self.refresh = refresh
        self.on_change = on_change
        self.log = log
        # This server's kernels: enrich() lists the GPU-shared ones the scheduler does not, so
        # subscribers get a push when they come and go (wake() on each), not only when the
        # scheduler's document changes.
        self.local_kernels = local_kernels
        self.subscribers: dict[object, Push] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._running = False
        self.polls = 0  # status reads made (tests check that nobody polls in vain)

    def start(self) -> None:
        self._running = True
        self.backend.add_listener(self._wake.set)
        self._ensure_task()

    async def stop(self) -> None:
        self._running = False
        self.backend.remove_listener(self._wake.set)
        self.subscribers.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def wake(self) -> None:
        """Read (and push, if anything changed) now: e.g. a kernel of this server started."""
        self._wake.set()

    def _local_signature(self) -> str:
        if self.local_kernels is None:
            return ""
        try:
            return ",".join(sorted(self.local_kernels()))
        except Exception:
            return ""

    def subscribe(self, key: object, push: Push) -> None:
        self.subscribers[key] = push
        self._wake.set()
        self._ensure_task()

    def unsubscribe(self, key: object) -> None:
        self.subscribers.pop(key, None)

    def _ensure_task(self) -> None:
        if self._running and (self._task is None or self._task.done()):
            self._task = asyncio.ensure_future(self._run())

    def _should_run(self) -> bool:
        # Notified (embedded): keep watching for the on_change listener, at no cost while idle.
        # Polled (node): only while someone listens.
        return self._running and (bool(self.subscribers) or self.backend.notifies)

    async def _run(self) -> None:
        await self.backend.ensure_started()
        last_sig: str | None = None
        last_local: str | None = None
        last_full: str | None = None
        last_push = 0.0
        while self._should_run():
            self._wake.clear()
            doc: dict[str, Any] | None
            error: str | None = None
            try:
                self.polls += 1
                doc = await self.backend.status()
            except (SchedulerUnavailable, SchedulerError) as exc:
                doc, error = None, str(exc)
            except Exception as exc:
                doc, error = None, f"{exc.__class__.__name__}: {exc}"
                if self.log is not None:
                    self.log.exception("gpushare: status read failed")
            sig = signature(doc, error)
            full = json.dumps(doc, sort_keys=True, default=str) if doc is not None else sig
            now = time.monotonic()
            changed = sig != last_sig
            local = self._local_signature()
            stale = full != last_full and now - last_push >= self.refresh
            if changed and self.on_change is not None:
                try:
                    self.on_change(doc, error)
                except Exception:
                    if self.log is not None:
                        self.log.exception("gpushare: status change listener failed")
            if (changed or stale or local != last_local) and self.subscribers:
                await self._push(doc, error)
                last_push = now
            last_sig, last_full, last_local = sig, full, local
            # At most one read per interval, whatever wakes us.
            await asyncio.sleep(self.interval)
            if not self._should_run():
                break
            if self.backend.notifies:
                timeout = self.refresh if self.subscribers else None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)

    async def _push(self, doc: dict[str, Any] | None, error: str | None) -> None:
        pushes = list(self.subscribers.values())
        results = await asyncio.gather(*(p(doc, error) for p in pushes), return_exceptions=True)
        for r in results:
            if isinstance(r, Exception) and self.log is not None:
                self.log.debug("gpushare: status push failed: %s", r)
