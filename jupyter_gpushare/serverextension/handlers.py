"""REST and websocket handlers under ``<base_url>gpushare/api/`` (described in docs/rest-api.yaml).

Every handler is authenticated (jupyter_server's identity provider: token, cookie, JupyterHub) and
authorised with ``@authorized`` on the resource ``gpushare``: reading the status needs ``read``,
releasing or evicting a kernel, or hinting that its cell is coming, ``execute``, changing a quota
``write``. On top of Jupyter's authorizer, gpushare's own rule: a user may release (or hint) the
kernels of this server (and, with a node scheduler, their own kernels of their other servers);
evicting, setting quotas and acting on other users' kernels need a gpushare admin
(``c.GPUShareExtension.admin_users``). The scheduler enforces the same underneath, by the
server's identity (its uid, or the hub user its token proves).

Errors are JSON (``{"message": ..., "reason": ...}``): 503 when the scheduler cannot be reached,
404 for a kernel the scheduler does not know, 400 for a bad request, 403 when not allowed.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, cast

from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import authorized, ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web, websocket

from ..protocol import ErrorCode
from ..scheduler_client import SchedulerError, SchedulerUnavailable
from ..units import parse_size
from .backend import SchedulerBackend
from .status import StatusBroadcaster, kernel_id_of

__all__ = [
    "AUTH_RESOURCE",
    "EventsWebSocket",
    "GPUShareApp",
    "KernelActionHandler",
    "KernelHintHandler",
    "QuotaHandler",
    "StatusHandler",
    "default_handlers",
]

AUTH_RESOURCE = "gpushare"
_KERNEL = r"(?P<kernel_id>[^/]+)"


class GPUShareApp(Protocol):
    """What the handlers use of the extension that serves them (``self.extensionapp``): the
    extension (:class:`.app.GPUShareExtension`) registers the handlers, so they name what they
    need here instead of importing it back."""

    backend: SchedulerBackend
    broadcaster: StatusBroadcaster

    def is_admin(self, user: Any) -> bool: ...

    def is_local_kernel(self, kernel_id: str) -> bool: ...

    async def enrich(self, raw: dict[str, Any], user: Any) -> dict[str, Any]: ...


def scheduler_http_error(exc: Exception) -> web.HTTPError:
    """The HTTP error that says what the scheduler said."""
    if isinstance(exc, SchedulerUnavailable):
        return web.HTTPError(503, str(exc), reason="Scheduler Unavailable")
    assert isinstance(exc, SchedulerError)
    status = {
        int(ErrorCode.NOT_FOUND): 404,
        int(ErrorCode.FORBIDDEN): 403,
        int(ErrorCode.BAD_REQUEST): 400,
    }.get(exc.code, 502)
    return web.HTTPError(status, exc.message or str(exc))


class _Base(ExtensionHandlerMixin, APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def gpushare(self) -> GPUShareApp:
        return cast(GPUShareApp, self.extensionapp)

    @property
    def username(self) -> str | None:
        user = self.current_user
        return getattr(user, "username", None) if user else None

    async def status_document(self) -> dict[str, Any]:
        try:
            raw = await self.gpushare.backend.status()
        except (SchedulerUnavailable, SchedulerError) as exc:
            raise scheduler_http_error(exc) from exc
        return await self.gpushare.enrich(raw, self.current_user)


class StatusHandler(_Base):
    """``GET gpushare/api/status``: the status document, with Jupyter's view of each client."""

    @web.authenticated
    @authorized("read", resource=AUTH_RESOURCE)
    async def get(self) -> None:
        doc = await self.status_document()
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(doc))


class HistoryHandler(_Base):
    """``GET gpushare/api/history``: the last hour per kernel, user and GPU (the sparklines)."""

    @web.authenticated
    @authorized("read", resource=AUTH_RESOURCE)
    async def get(self) -> None:
        try:
            doc = await self.gpushare.backend.history()
        except (SchedulerUnavailable, SchedulerError) as exc:
            raise scheduler_http_error(exc) from exc
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(doc))


class KernelActionHandler(_Base):
    """``POST gpushare/api/kernels/{kernel_id}/release`` and ``.../evict``."""

    @web.authenticated
    @authorized("execute", resource=AUTH_RESOURCE)
    async def post(self, kernel_id: str, action: str) -> None:
        app = self.gpushare
        user = self.current_user
        if action == "evict":
            if not app.is_admin(user):
                raise web.HTTPError(403, "evicting a kernel's memory needs a gpushare admin")
        elif not (app.is_local_kernel(kernel_id) or app.is_admin(user)):
            await self._not_found_or_forbidden(kernel_id)
        reply = await self._control(action, client=kernel_id)
        self.finish(json.dumps(reply))

    async def _not_found_or_forbidden(self, kernel_id: str) -> None:
        """Refuse an action on a kernel of another server, unless the node scheduler says the
        kernel is this server's user's (another server of the same hub user: named servers).

        404 when the kernel is not in the status this server may see: a node scheduler shows a
        user nothing of other users' kernels but per-user sums, so their ids stay unknown."""
        try:
            raw = await self.gpushare.backend.status()
        except (SchedulerUnavailable, SchedulerError) as exc:
            raise scheduler_http_error(exc) from exc
        found = [
            c
            for dev in raw.get("devices", [])
            for c in dev.get("clients", [])
            if kernel_id_of(str(c.get("id", ""))) == kernel_id
        ]
        if not found:
            raise web.HTTPError(404, f"no kernel {kernel_id!r} is known to the gpushare scheduler")
        identity = raw.get("identity")
        own_user = identity.get("user") if isinstance(identity, dict) else None
        if own_user is not None and all(c.get("user") == own_user for c in found):
            return  # the same user's kernel in another server: the scheduler agrees
        raise web.HTTPError(403, f"kernel {kernel_id!r} is not a kernel of this server")

    async def _control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        try:
            return await self.gpushare.backend.control(action, **kwargs)
        except SchedulerError as exc:
            if exc.code == int(ErrorCode.NOT_FOUND):
                raise web.HTTPError(
                    404,
                    f"no kernel {kwargs.get('client')!r} is known to the gpushare scheduler "
                    "(a kernel appears there at its first CUDA call)",
                ) from exc
            raise scheduler_http_error(exc) from exc
        except SchedulerUnavailable as exc:
            raise scheduler_http_error(exc) from exc


class KernelHintHandler(KernelActionHandler):
    """``POST gpushare/api/kernels/{kernel_id}/hint``: a cell of the kernel is about to run (the
    lab extension: a code cell focused or edited while the kernel's memory is away). The scheduler
    hears ``kernel_state coming`` and may bring the memory back first (docs/architecture.md,
    "Cell hints"); allowed where releasing the kernel is."""

    @web.authenticated
    @authorized("execute", resource=AUTH_RESOURCE)
    async def post(self, kernel_id: str) -> None:  # type: ignore[override]
        app = self.gpushare
        if not (app.is_local_kernel(kernel_id) or app.is_admin(self.current_user)):
            await self._not_found_or_forbidden(kernel_id)
        reply = await self._control("kernel_state", client=kernel_id, state="coming")
        self.finish(json.dumps(reply))


class QuotaHandler(KernelActionHandler):
    """``PUT gpushare/api/kernels/{kernel_id}/quota`` with ``{"quota": bytes | "8GiB" | null}``."""

    @web.authenticated
    @authorized("write", resource=AUTH_RESOURCE)
    async def put(self, kernel_id: str) -> None:
        if not self.gpushare.is_admin(self.current_user):
            raise web.HTTPError(403, "setting a kernel's memory quota needs a gpushare admin")
        try:
            body = json.loads(self.request.body or b"null")
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep (a 500)
            raise web.HTTPError(400, f"the body is not JSON: {exc}") from exc
        if not isinstance(body, dict) or "quota" not in body:
            raise web.HTTPError(
                400, 'the body must be an object {"quota": bytes, a size such as "8GiB", or null}'
            )
        raw = body["quota"]
        try:
            if raw is None:
                quota = 0
            elif isinstance(raw, (float, bool)):
                raise ValueError(f"invalid size {raw!r}: bytes must be a whole number")
            else:
                quota = parse_size(raw)
        except ValueError as exc:
            raise web.HTTPError(400, f"quota: {exc}") from exc
        reply = await self._control("set_quota", client=kernel_id, quota=quota)
        self.finish(json.dumps(reply))


class EventsWebSocket(  # type: ignore[misc]
    ExtensionHandlerMixin, WebSocketMixin, JupyterHandler, websocket.WebSocketHandler
):
    """``GET gpushare/api/events`` (websocket): the status document now and whenever it changes.

    Each message is ``{"type": "status", "status": <document>}``, or ``{"type": "error",
    "status_code": 503, "message": ...}`` while the scheduler cannot be reached."""

    auth_resource = AUTH_RESOURCE

    @property
    def gpushare(self) -> GPUShareApp:
        return cast(GPUShareApp, self.extensionapp)

    async def pre_get(self) -> None:
        user = self.current_user
        allowed = await ensure_async(
            self.authorizer.is_authorized(self, user, "read", AUTH_RESOURCE)
        )
        if not allowed:
            raise web.HTTPError(403)

    @ws_authenticated
    async def get(self, *args: Any, **kwargs: Any) -> None:
        await self.pre_get()
        res = super().get(*args, **kwargs)
        if res is not None:
            await res

    async def open(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        super().open(*args, **kwargs)
        self._user = self.current_user
        broadcaster = self.gpushare.broadcaster
        raw: dict[str, Any] | None = None
        error: str | None = None
        try:
            raw = await self.gpushare.backend.status()
        except (SchedulerUnavailable, SchedulerError) as exc:
            error = str(exc)
        await self._send(raw, error)
        broadcaster.subscribe(self, self._send)

    async def _send(self, raw: dict[str, Any] | None, error: str | None) -> None:
        if self.ws_connection is None or self.ws_connection.is_closing():
            self.gpushare.broadcaster.unsubscribe(self)
            return
        if raw is None:
            msg: dict[str, Any] = {"type": "error", "status_code": 503, "message": error}
        else:
            msg = {"type": "status", "status": await self.gpushare.enrich(raw, self._user)}
        try:
            await self.write_message(json.dumps(msg))
        except websocket.WebSocketClosedError:
            self.gpushare.broadcaster.unsubscribe(self)

    def on_message(self, message: str | bytes) -> None:
        """Clients only listen; anything they send is ignored."""

    def on_close(self) -> None:
        self.gpushare.broadcaster.unsubscribe(self)


def default_handlers() -> list[tuple[str, Any]]:
    return [
        (r"/gpushare/api/status/?", StatusHandler),
        (r"/gpushare/api/history/?", HistoryHandler),
        (rf"/gpushare/api/kernels/{_KERNEL}/(?P<action>release|evict)/?", KernelActionHandler),
        (rf"/gpushare/api/kernels/{_KERNEL}/quota/?", QuotaHandler),
        (rf"/gpushare/api/kernels/{_KERNEL}/hint/?", KernelHintHandler),
        (r"/gpushare/api/events/?", EventsWebSocket),
    ]
