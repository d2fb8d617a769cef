"""The server extension's REST API, websocket and events against a real jupyter-server with the
embedded scheduler (no GPU, no NVML) and fake shim clients."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import typing
from typing import Any

import pytest
from jupyter_server.auth.authorizer import Authorizer
from openapi_helpers import openapi_schema as _openapi_schema
from server_helpers import *  # noqa: F403
from server_helpers import (
    FakeShim,
    GiB,
    MiB,
    clients_of,
    extension,
    fetch_error,
    fetch_json,
    started,
    wait_until,
)

from jupyter_gpushare.protocol import MsgType
from jupyter_gpushare.serverextension.app import STATUS_EVENT_SCHEMA, GPUShareExtension
from jupyter_gpushare.serverextension.handlers import GPUShareApp
from jupyter_gpushare.serverextension.status import enrich


async def test_extension_is_enabled_by_config_file() -> None:
    """The data file that pip installs into etc/jupyter enables the extension."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "jupyter-config", "jupyter_server_config.d", "jupyter_gpushare.json")
    with open(path) as f:
        config = json.load(f)
    assert config["ServerApp"]["jpserver_extensions"]["jupyter_gpushare"] is True
    import jupyter_gpushare

    points = jupyter_gpushare._jupyter_server_extension_points()
    assert points[0]["app"] is GPUShareExtension


async def test_status_embedded_without_nvml(jp_fetch: Any, jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    assert ext.backend.mode == "embedded"
    assert ext.backend.scheduler is not None
    # The provisioner's contract: the embedded scheduler's socket is in the server's environment.
    assert os.environ["GPUSHARE_SOCKET"] == ext.backend.socket_path
    assert os.path.exists(ext.backend.socket_path)
    doc = await fetch_json(jp_fetch, "gpushare", "api", "status")
    assert doc["socket"] == ext.backend.socket_path
    assert doc["devices"] == []
    # NVML is off here (use_nvml = False): the document says why there is no device discovery.
    assert isinstance(doc["nvml"], str) and "disabled" in doc["nvml"]
    assert doc["scheduler"]["mode"] == "embedded"
    assert doc["scheduler"]["error"] is None
    assert doc["viewer"]["admin"] is True


class TestRealNVML:
    @pytest.fixture
    def gpushare_config(self) -> dict[str, Any]:
        # Real NVML discovery: there is no GPU/NVML in CI, which the status must say clearly.
        return {"GPUShareScheduler": {"pool_size": "1GiB"}}

    async def test_status_reports_missing_nvml(self, jp_fetch: Any, jp_serverapp: Any) -> None:
        await started(jp_serverapp)
        doc = await fetch_json(jp_fetch, "gpushare", "api", "status")
        if doc["nvml"] is True:
            pytest.skip("this machine has NVML")
        assert isinstance(doc["nvml"], str) and "NVML" in doc["nvml"], doc["nvml"]
        assert "disabled" not in doc["nvml"]


async def test_the_extension_is_what_the_handlers_expect(jp_serverapp: Any) -> None:
    """The handlers name what they use of the extension (GPUShareApp) instead of importing it
    (app.py imports the handlers): the started extension has each of those members, of its
    kind (an instance of the class it names, a method where a method is expected, an async one
    where it is awaited)."""
    ext = await started(jp_serverapp)
    attributes = typing.get_type_hints(GPUShareApp)
    methods = {
        name
        for name, value in vars(GPUShareApp).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }
    assert attributes and methods, (attributes, methods)
    for name, kind in attributes.items():
        assert isinstance(getattr(ext, name), kind), name
    for name in methods:
        mine = getattr(GPUShareApp, name)
        theirs = getattr(ext, name)
        assert inspect.ismethod(theirs), name
        assert inspect.iscoroutinefunction(theirs) == inspect.iscoroutinefunction(mine), name
        assert (
            list(inspect.signature(theirs).parameters)
            == list(inspect.signature(mine).parameters)[1:]
        ), name


async def test_status_lists_fake_client(jp_fetch: Any, jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    shim = await FakeShim.join(ext.backend.socket_path, "k-fake", used=100 * MiB)
    try:
        doc = await fetch_json(jp_fetch, "gpushare", "api", "status")
        client = clients_of(doc)["k-fake"]
        assert client["label"] == "k-fake.ipynb"
        assert client["redacted"] is False
        assert client["jupyter"]["local"] is False
    finally:
        await shim.close()


async def test_unauthenticated_requests_are_refused(jp_fetch: Any, jp_serverapp: Any) -> None:
    await started(jp_serverapp)
    bad = {"Authorization": "token not-the-token"}
    for parts, method, body in [
        (("gpushare", "api", "status"), "GET", None),
        (("gpushare", "api", "kernels", "k1", "release"), "POST", "{}"),
        (("gpushare", "api", "kernels", "k1", "evict"), "POST", "{}"),
        (("gpushare", "api", "kernels", "k1", "hint"), "POST", "{}"),
        (("gpushare", "api", "kernels", "k1", "quota"), "PUT", '{"quota": 1}'),
    ]:
        code, _ = await fetch_error(jp_fetch, *parts, method=method, body=body, headers=bad)
        assert code in (401, 403), parts


async def test_unauthenticated_websocket_is_refused(jp_ws_fetch: Any, jp_serverapp: Any) -> None:
    from tornado.httpclient import HTTPClientError

    await started(jp_serverapp)
    with pytest.raises(HTTPClientError) as info:
        await jp_ws_fetch(
            "gpushare", "api", "events", headers={"Authorization": "token not-the-token"}
        )
    assert info.value.code in (401, 403)


async def test_release_evict_quota(jp_fetch: Any, jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    shim = await FakeShim.join(ext.backend.socket_path, "k-act", used=100 * MiB)
    try:
        base = ("gpushare", "api", "kernels", "k-act")
        reply = await fetch_json(jp_fetch, *base, "release", method="POST", body="")
        assert reply == {
            "ok": True,
            "action": "release",
            "client": "k-act",
            "done": False,  # the kernel holds nothing: the reply says so
            "effect": "nothing to do: it does not hold the GPU",
        }
        reply = await fetch_json(jp_fetch, *base, "evict", method="POST", body="")
        assert reply["ok"] and reply["action"] == "evict"
        reply = await fetch_json(jp_fetch, *base, "quota", method="PUT", body='{"quota": "8GiB"}')
        assert reply["quota"] == 8 * GiB
        msg = await shim.expect(MsgType.SET_QUOTA)
        assert msg["quota"] == 8 * GiB
        doc = await fetch_json(jp_fetch, "gpushare", "api", "status")
        assert clients_of(doc)["k-act"]["quota_bytes"] == 8 * GiB
        reply = await fetch_json(jp_fetch, *base, "quota", method="PUT", body='{"quota": null}')
        assert reply["quota"] == 0
        reply = await fetch_json(jp_fetch, *base, "quota", method="PUT", body='{"quota": 1024}')
        assert reply["quota"] == 1024
    finally:
        await shim.close()


async def test_a_cell_hint_reaches_the_scheduler_as_a_cell_coming(
    jp_fetch: Any, jp_serverapp: Any
) -> None:
    ext = await started(jp_serverapp)
    shim = await FakeShim.join(ext.backend.socket_path, "k-hint", used=100 * MiB)
    try:
        base = ("gpushare", "api", "kernels", "k-hint")
        reply = await fetch_json(jp_fetch, *base, "hint", method="POST", body="")
        assert reply == {
            "ok": True,
            "action": "kernel_state",
            "client": "k-hint",
            "state": "coming",
        }
        code, body = await fetch_error(
            jp_fetch, "gpushare", "api", "kernels", "nope", "hint", method="POST", body=""
        )
        assert code == 404 and "nope" in body["message"], body
    finally:
        await shim.close()


async def test_action_errors(jp_fetch: Any, jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    shim = await FakeShim.join(ext.backend.socket_path, "k-err")
    try:
        for action in ("release", "evict"):
            code, body = await fetch_error(
                jp_fetch, "gpushare", "api", "kernels", "nope", action, method="POST", body=""
            )
            assert code == 404, body
            assert "nope" in body["message"]
        code, body = await fetch_error(
            jp_fetch,
            "gpushare",
            "api",
            "kernels",
            "nope",
            "quota",
            method="PUT",
            body='{"quota": "1GiB"}',
        )
        assert code == 404, body
        base = ("gpushare", "api", "kernels", "k-err", "quota")
        for bad in [
            '{"quota": "lots"}',
            '{"quota": -5}',
            '{"quota": 1.5}',
            '{"quota": true}',
            "{}",
            "[1]",
            "not json",
        ]:
            code, body = await fetch_error(jp_fetch, *base, method="PUT", body=bad)
            assert code == 400, (bad, body)
            assert body["message"], bad
    finally:
        await shim.close()


async def test_scheduler_unreachable_is_503(jp_fetch: Any, jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    assert ext.backend.scheduler is not None
    await ext.backend.scheduler.stop()
    ext.backend.scheduler = None
    code, body = await fetch_error(jp_fetch, "gpushare", "api", "status")
    assert code == 503
    assert "not running" in body["message"]
    code, body = await fetch_error(
        jp_fetch, "gpushare", "api", "kernels", "k", "release", method="POST", body=""
    )
    assert code == 503


class _NoGPUShareActions(Authorizer):
    """Lets everyone read gpushare's status, and nobody act."""

    def is_authorized(self, handler: Any, user: Any, action: str, resource: str) -> bool:
        return resource != "gpushare" or action == "read"


@pytest.fixture
def _read_only(gpushare_config: dict[str, Any]) -> None:
    gpushare_config["ServerApp"] = {"authorizer_class": _NoGPUShareActions}


async def test_authorizer_decides(_read_only: None, jp_fetch: Any, jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    shim = await FakeShim.join(ext.backend.socket_path, "k-auth")
    try:
        await fetch_json(jp_fetch, "gpushare", "api", "status")
        for action in ("release", "evict"):
            code, _ = await fetch_error(
                jp_fetch, "gpushare", "api", "kernels", "k-auth", action, method="POST", body=""
            )
            assert code == 403
        code, _ = await fetch_error(
            jp_fetch,
            "gpushare",
            "api",
            "kernels",
            "k-auth",
            "quota",
            method="PUT",
            body='{"quota": 1}',
        )
        assert code == 403
    finally:
        await shim.close()


@pytest.fixture
def _not_admin(gpushare_config: dict[str, Any]) -> None:
    gpushare_config["GPUShareExtension"]["admin_users"] = ["somebody-else"]


async def test_admin_actions_need_admin(_not_admin: None, jp_fetch: Any, jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    shim = await FakeShim.join(ext.backend.socket_path, "k-other")
    try:
        base = ("gpushare", "api", "kernels", "k-other")
        code, body = await fetch_error(jp_fetch, *base, "evict", method="POST", body="")
        assert code == 403 and "admin" in body["message"]
        code, body = await fetch_error(jp_fetch, *base, "quota", method="PUT", body='{"quota": 1}')
        assert code == 403
        # Not a kernel of this server, and the viewer is no admin: not theirs to release.
        code, body = await fetch_error(jp_fetch, *base, "release", method="POST", body="")
        assert code == 403
        code, body = await fetch_error(
            jp_fetch, "gpushare", "api", "kernels", "unknown", "release", method="POST", body=""
        )
        assert code == 404
    finally:
        await shim.close()


async def test_redaction_of_other_users() -> None:
    doc = {
        "devices": [
            {
                "uuid": "GPU-x",
                "clients": [
                    {"id": "mine", "uid": 4242, "user": "me", "label": "secret/mine.ipynb"},
                    {"id": "theirs", "uid": 4343, "user": "you", "label": "secret/theirs.ipynb"},
                    {"id": "local#77", "uid": 4343, "user": "x", "label": "local.ipynb"},
                ],
            }
        ]
    }

    class KM:
        def list_kernel_ids(self) -> list[str]:
            return ["local"]

        def get_kernel(self, kid: str) -> Any:
            return type("K", (), {"kernel_name": "python3", "execution_state": "idle"})()

    class SM:
        async def list_sessions(self) -> list[dict[str, Any]]:
            return [
                {
                    "id": "s",
                    "path": "nb/local.ipynb",
                    "name": "local.ipynb",
                    "type": "notebook",
                    "kernel": {"id": "local"},
                }
            ]

    viewer = await enrich(
        doc, kernel_manager=KM(), session_manager=SM(), viewer="me", admin=False, own_uid=4242
    )
    clients = clients_of(viewer)
    assert clients["mine"]["label"] == "secret/mine.ipynb" and not clients["mine"]["redacted"]
    assert clients["theirs"]["label"] == "" and clients["theirs"]["redacted"]
    local = clients["local#77"]
    assert local["label"] == "local.ipynb" and local["jupyter"]["local"]
    assert local["jupyter"]["kernel_id"] == "local"
    assert local["jupyter"]["paths"] == ["nb/local.ipynb"]
    admin = await enrich(
        doc, kernel_manager=KM(), session_manager=SM(), viewer="root", admin=True, own_uid=4242
    )
    assert clients_of(admin)["theirs"]["label"] == "secret/theirs.ipynb"
    # The input is left alone (the broadcaster shares it between viewers).
    assert doc["devices"][0]["clients"][1]["label"] == "secret/theirs.ipynb"


async def test_websocket_pushes_changes(jp_ws_fetch: Any, jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    ws = await jp_ws_fetch("gpushare", "api", "events")
    try:
        first = json.loads(await asyncio.wait_for(ws.read_message(), 10))
        assert first["type"] == "status"
        assert first["status"]["devices"] == []
        shim = await FakeShim.join(ext.backend.socket_path, "k-ws", used=10 * MiB)
        try:
            while True:
                msg = json.loads(await asyncio.wait_for(ws.read_message(), 10))
                assert msg["type"] == "status"
                if "k-ws" in clients_of(msg["status"]):
                    break
        finally:
            await shim.close()
        while True:
            msg = json.loads(await asyncio.wait_for(ws.read_message(), 10))
            if "k-ws" not in clients_of(msg["status"]):
                break
    finally:
        ws.close()
    await wait_until(lambda: not ext.broadcaster.subscribers, what="the subscriber to go")


async def test_status_events_are_emitted(jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    seen: list[dict[str, Any]] = []

    async def listener(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        seen.append(data)

    jp_serverapp.event_logger.add_listener(schema_id=STATUS_EVENT_SCHEMA, listener=listener)
    shim = await FakeShim.join(ext.backend.socket_path, "k-ev")
    try:
        await wait_until(
            lambda: any(
                c["id"] == "k-ev" for e in seen for d in e["devices"] for c in d["clients"]
            ),
            what="a status event naming k-ev",
        )
        event = seen[-1]
        assert event["available"] is True
        assert "label" not in json.dumps(event)
    finally:
        await shim.close()
        jp_serverapp.event_logger.remove_listener(schema_id=STATUS_EVENT_SCHEMA, listener=listener)


async def test_extension_stops_embedded_scheduler(jp_serverapp: Any) -> None:
    ext = await started(jp_serverapp)
    path = ext.backend.socket_path
    assert os.path.exists(path)
    await jp_serverapp._cleanup()
    assert ext.backend.scheduler is None
    assert not os.path.exists(path)
    assert os.environ.get("GPUSHARE_SOCKET") != path
    assert extension(jp_serverapp).watcher.watches == {}


# ---------------------------------------------------------------------------------------------
# docs/rest-api.yaml describes what the API answers


async def test_responses_match_the_openapi_description(
    jp_fetch: Any, jp_ws_fetch: Any, jp_serverapp: Any
) -> None:
    import jsonschema

    ext = await started(jp_serverapp)
    shim = await FakeShim.join(ext.backend.socket_path, "k-spec", used=10 * MiB)
    try:
        doc = await fetch_json(jp_fetch, "gpushare", "api", "status")
        jsonschema.validate(doc, _openapi_schema("Status"))
        reply = await fetch_json(
            jp_fetch, "gpushare", "api", "kernels", "k-spec", "release", method="POST", body=""
        )
        jsonschema.validate(reply, _openapi_schema("ControlReply"))
        _, err = await fetch_error(
            jp_fetch, "gpushare", "api", "kernels", "x", "quota", method="PUT", body="{}"
        )
        jsonschema.validate(err, _openapi_schema("Error"))
        ws = await jp_ws_fetch("gpushare", "api", "events")
        try:
            msg = json.loads(await asyncio.wait_for(ws.read_message(), 10))
            jsonschema.validate(msg, _openapi_schema("EventMessage"))
        finally:
            ws.close()
    finally:
        await shim.close()
