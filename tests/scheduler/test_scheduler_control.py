"""Status and control messages: the document's shape, the actions, authorisation, the client."""

from __future__ import annotations

import asyncio
import os
import pwd
import time
from typing import Any

import pytest
from sched_helpers import DEVICE, GiB, MiB

from jupyter_gpushare.protocol import ErrorCode, MsgType
from jupyter_gpushare.scheduler.core import events as ev
from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler
from jupyter_gpushare.scheduler_client import SchedulerClient, SchedulerError, SchedulerUnavailable

DEVICE_KEYS = {
    "uuid", "name", "total_bytes", "pool_bytes", "resident_bytes", "mode", "quantum_ms",
    "holders", "queue", "clients", "utilization_percent", "index", "unmanaged_bytes",
}  # fmt: skip
CLIENT_KEYS = {
    "id", "pid", "uid", "user", "label", "state", "idle", "notebook", "used_bytes", "managed_bytes",
    "pinned_bytes", "evicted_bytes", "precopied_bytes", "quota_bytes", "weight", "gpu_seconds",
    "wait_seconds", "waiting_since", "queue_position", "last_restore", "host_bytes",
    "staging_bytes", "staging_allowed_bytes",
}  # fmt: skip


async def test_status_document_shape(scheduler: Any, connect: Any, sock_path: str) -> None:
    a, b = await connect(), await connect()
    await a.hello("a", weight_milli=2500)
    await b.hello("b")
    await a.request(800 * MiB)
    await a.expect(MsgType.GRANT)
    await b.request(800 * MiB)
    await asyncio.sleep(0.05)
    doc = await SchedulerClient(sock_path).status()
    assert set(doc) == {"version", "socket", "nvml", "devices", "identity", "host"}
    assert doc["socket"] == sock_path
    assert doc["version"] == __import__("jupyter_gpushare").__version__
    assert doc["nvml"] == "disabled (use_nvml = False)"
    (dev,) = doc["devices"]
    assert set(dev) == DEVICE_KEYS
    assert dev["uuid"] == DEVICE and dev["pool_bytes"] == GiB and dev["total_bytes"] == 80 * GiB
    assert dev["mode"] in ("shared", "turns") and dev["quantum_ms"] == 30_000
    assert dev["holders"] == ["a"] and dev["queue"] == ["b"]
    assert dev["resident_bytes"] == 800 * MiB
    clients = {c["id"]: c for c in dev["clients"]}
    assert set(clients) == {"a", "b"}
    holder_keys = {"held_seconds", "quantum_seconds", "revoking_seconds"}
    assert set(clients["a"]) == CLIENT_KEYS | holder_keys
    assert set(clients["b"]) == CLIENT_KEYS | {"wait"}
    assert clients["a"]["quantum_seconds"] == 30.0 and clients["a"]["revoking_seconds"] is None
    assert clients["b"]["wait"]["reason"] == "turn", clients["b"]["wait"]
    assert [h["id"] for h in clients["b"]["wait"]["holders"]] == ["a"]
    for c in clients.values():
        assert c["uid"] == os.getuid() and c["pid"] == os.getpid()
    assert clients["a"]["weight"] == 2.5 and clients["b"]["weight"] == 1.0
    assert clients["a"]["state"] == "running" and clients["a"]["queue_position"] is None
    assert clients["b"]["state"] == "waiting" and clients["b"]["queue_position"] == 1
    assert clients["b"]["waiting_since"] <= time.time()
    # Filtered by device.
    assert len((await SchedulerClient(sock_path).status(DEVICE.lower()))["devices"]) == 1
    assert (await SchedulerClient(sock_path).status("GPU-other"))["devices"] == []


async def test_status_of_an_empty_scheduler(scheduler: Any, sock_path: str) -> None:
    doc = await asyncio.to_thread(SchedulerClient(sock_path).status_sync)
    assert doc["devices"] == [] and doc["socket"] == sock_path


async def test_status_too_large_for_a_frame_is_trimmed(scheduler: Any, sock_path: str) -> None:
    policy = scheduler.policy
    policy.add_device(DEVICE, name="Fake", total_bytes=80 * GiB, pool_bytes=GiB)
    now = time.monotonic()
    for i in range(400):
        policy.handle(ev.Join(now, f"kernel-{i:04d}-" + "x" * 60, DEVICE, "user", label="y" * 80))
    doc = await SchedulerClient(sock_path).status()
    assert doc["truncated"] is True
    (dev,) = doc["devices"]
    # As many clients as fit (the biggest first), how many were left out, and per-user sums.
    assert dev["clients"] and dev["clients_truncated"] == 400 - len(dev["clients"])
    assert dev["users"] == [
        {"user": "user", "clients": 400, "running": 0, "waiting": 0, "used_bytes": 0}
    ]


async def test_release_evict_and_quota(scheduler: Any, connect: Any, sock_path: str) -> None:
    a = await connect()
    await a.hello("a")
    await a.request(100 * MiB)
    await a.expect(MsgType.GRANT)
    client = SchedulerClient(sock_path)
    reply = await client.release("a")
    assert reply == {
        "ok": True,
        "action": "release",
        "client": "a",
        "done": True,
        "effect": "revoke sent: it releases the GPU when its current GPU work ends",
    }
    revoke = await a.expect(MsgType.REVOKE)
    assert revoke.fields["flag"] == 0 and revoke.fields["reason"]
    # Asked again before it answered: the reply says nothing new went out, and why.
    again = await client.release("a")
    assert again["done"] is False and again["effect"].startswith("already asked to release")
    await a.send(MsgType.RELEASED, flag=0)
    await a.request(100 * MiB)
    await a.expect(MsgType.GRANT)
    assert (await client.evict("a"))["effect"].endswith("then evicts")
    assert (await a.expect(MsgType.REVOKE)).fields["flag"] == 1
    reply = await client.set_quota("a", 2 * GiB)
    assert reply["quota"] == 2 * GiB
    assert (await a.expect(MsgType.SET_QUOTA)).fields["quota"] == 2 * GiB
    reply = await client.control("set_quota", client="a", quota="512MiB")
    assert reply["quota"] == 512 * MiB
    assert (await a.expect(MsgType.SET_QUOTA)).fields["quota"] == 512 * MiB
    (c,) = (await client.status())["devices"][0]["clients"]
    assert c["quota_bytes"] == 512 * MiB


async def test_kernel_state(scheduler: Any, connect: Any, sock_path: str) -> None:
    a, b = await connect(), await connect()
    await a.hello("a")
    await b.hello("b")
    await a.request(800 * MiB)
    await a.expect(MsgType.GRANT)
    await b.request(800 * MiB)
    client = SchedulerClient(sock_path)
    assert (await client.kernel_state("a", "busy"))["state"] == "busy"
    await a.expect_nothing(0.1)
    assert (await client.kernel_state("a", "idle"))["state"] == "idle"
    revoke = await a.expect(MsgType.REVOKE)  # Jupyter says its cell ended: it gives way at once
    assert revoke.fields["reason"] == "idle"


async def test_a_jupyter_idle_alone_marks_a_notebook_kernel(
    scheduler: Any, connect: Any, sock_path: str
) -> None:
    """The kernel watcher may miss a kernel's first busy (it subscribes while the first cell
    runs) and report only the idle. On an H100 such a kernel was never put to deep idle: only
    notebook kernels sleep, and it was not counted as one. Jupyter's idle alone marks it."""
    a = await connect()
    await a.hello("a")
    await a.request(64 * MiB)
    await a.expect(MsgType.GRANT)
    client = SchedulerClient(sock_path)

    def entry(doc: dict) -> dict:
        (c,) = doc["devices"][0]["clients"]
        return c

    assert entry(await client.status())["notebook"] is False
    await a.send(MsgType.IDLE)  # the shim's own idle detector says nothing about Jupyter
    await asyncio.sleep(0.05)
    assert entry(await client.status())["notebook"] is False
    assert (await client.kernel_state("a", "idle"))["state"] == "idle"
    assert entry(await client.status())["notebook"] is True


async def test_kernel_state_reaches_the_kernels_other_gpus(
    scheduler: Any, connect: Any, sock_path: str
) -> None:
    """A kernel on two GPUs is ``k`` on the first and ``k/1`` on the second (docs/protocol.md,
    "Several devices"); Jupyter's "idle" for ``k`` makes ``k/1`` give way on its GPU as well."""
    second = "GPU-00000000-0000-0000-0000-00000000000b"
    k, k1, other = await connect(), await connect(), await connect()
    await k.hello("k")
    await k1.hello("k/1", device=second)
    await other.hello("other", device=second)
    await k.request(100 * MiB)
    await k.expect(MsgType.GRANT)
    await k1.request(800 * MiB)
    await k1.expect(MsgType.GRANT)
    await other.request(800 * MiB)
    client = SchedulerClient(sock_path)
    assert (await client.kernel_state("k", "busy"))["state"] == "busy"
    await k1.expect_nothing(0.1)
    assert (await client.kernel_state("k", "idle"))["state"] == "idle"
    revoke = await k1.expect(MsgType.REVOKE)
    assert revoke.fields["reason"] == "idle"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (None, ErrorCode.BAD_REQUEST),
        ([1, 2], ErrorCode.BAD_REQUEST),
        ({"action": "explode", "client": "a"}, ErrorCode.BAD_REQUEST),
        ({"action": "release"}, ErrorCode.BAD_REQUEST),
        ({"action": "release", "client": 7}, ErrorCode.BAD_REQUEST),
        ({"action": "kernel_state", "client": "a", "state": "asleep"}, ErrorCode.BAD_REQUEST),
        ({"action": "set_quota", "client": "a"}, ErrorCode.BAD_REQUEST),
        ({"action": "set_quota", "client": "a", "quota": "lots"}, ErrorCode.BAD_REQUEST),
        ({"action": "set_quota", "client": "a", "quota": -1}, ErrorCode.BAD_REQUEST),
        ({"action": "release", "client": "nobody"}, ErrorCode.NOT_FOUND),
        ({"action": "kernel_state", "client": "nobody", "state": "idle"}, ErrorCode.NOT_FOUND),
    ],
)
async def test_bad_control_requests(scheduler: Any, connect: Any, body: Any, code: Any) -> None:
    a = await connect()
    await a.hello("a")
    ctl = await connect()
    await ctl.send(MsgType.CONTROL, body=body)
    err = await ctl.expect(MsgType.ERROR)
    assert err.fields["error_code"] == code
    assert err.fields["message"]
    # Refused, not disconnected.
    await ctl.send(MsgType.STATUS_REQUEST)
    await ctl.expect(MsgType.STATUS)


async def test_status_request_with_a_bad_body(scheduler: Any, connect: Any) -> None:
    ctl = await connect()
    await ctl.send(MsgType.STATUS_REQUEST, body=[1])
    assert (await ctl.expect(MsgType.ERROR)).fields["error_code"] == ErrorCode.BAD_REQUEST
    await ctl.send(MsgType.STATUS_REQUEST, body={"device": 5})
    assert (await ctl.expect(MsgType.ERROR)).fields["error_code"] == ErrorCode.BAD_REQUEST


async def test_control_of_another_users_client_is_forbidden(
    make_scheduler: Any, connect: Any, sock_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = await make_scheduler()
    scheduler.own_uid = 5000  # the scheduler runs as a service account
    # Connection 0: alice's kernel; 1: bob's command line; 2: alice's; 3: an admin.
    scheduler.fake_creds = [{"uid": 1001}, {"uid": 1002}, {"uid": 1001}, {"uid": 1003}]
    a = await connect()
    await a.hello("alice-kernel")
    client = SchedulerClient(sock_path)
    with pytest.raises(SchedulerError) as info:
        await client.release("alice-kernel")
    # Bob is told what he would be told of an id that does not exist...
    assert info.value.code == ErrorCode.NOT_FOUND
    assert info.value.message == "no client 'alice-kernel'"
    # ...and the operator's log names him as the scheduler knows him: his user name where uid
    # 1002 has one on this host, else the uid.
    try:
        bob = pwd.getpwuid(1002).pw_name
    except KeyError:
        bob = "1002"
    assert any(
        "forbidden" in r.getMessage() and f"{bob} " in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    # Her own uid may.
    assert (await client.kernel_state("alice-kernel", "idle"))["ok"] is True
    # An admin uid may, once configured.
    scheduler.admin_uids = [1003]
    assert (await client.release("alice-kernel"))["ok"] is True


def test_authorize_rules() -> None:
    s = GPUShareScheduler(admin_uids=[42])
    s.own_uid = 500
    assert s.authorize(1000, 1000)  # the owner
    assert not s.authorize(1001, 1000)  # someone else
    assert s.authorize(0, 1000)  # root
    assert s.authorize(500, 1000)  # the scheduler's own uid
    assert s.authorize(42, 1000)  # a configured admin
    assert not s.authorize(-1, -1)  # unknown credentials never match


async def test_client_when_no_scheduler(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "absent.sock")
    client = SchedulerClient(path, timeout=2)
    with pytest.raises(SchedulerUnavailable, match="does not exist"):
        await client.status()
    with pytest.raises(SchedulerUnavailable, match="does not exist"):
        client.status_sync()
    # A stale socket: the file exists, nobody listens.
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()
    with pytest.raises(SchedulerUnavailable, match="refused"):
        client.control_sync("release", client="x")
    with pytest.raises(SchedulerUnavailable) as info:
        await client.control("release", client="x")
    assert info.value.socket_path == path


async def test_sync_control_errors(scheduler: Any, sock_path: str) -> None:
    client = SchedulerClient(sock_path)
    with pytest.raises(SchedulerError) as info:
        await asyncio.to_thread(client.control_sync, "release", client="ghost")
    assert info.value.code == ErrorCode.NOT_FOUND and info.value.name == "not_found"
