"""The scheduler shell against fake shims speaking the real protocol, with the real policy."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import stat
import struct
import sys
import time
from typing import Any

import pytest
from sched_helpers import DEVICE, FakeShim, GiB, MiB

from jupyter_gpushare.protocol import ErrorCode, MsgType
from jupyter_gpushare.scheduler.core import events as ev
from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler, SchedulerStartError

BIG = 800 * MiB  # two of these do not fit the 1 GiB pool the fixtures configure
SMALL = 100 * MiB


async def test_hello_welcome_and_grant(scheduler: Any, connect: Any) -> None:
    a = await connect()
    welcome = await a.hello("k1", quota=512 * MiB)
    assert welcome.fields["pool_bytes"] == GiB
    assert welcome.fields["quota"] == 512 * MiB
    assert welcome.fields["quantum_ms"] == 30_000
    assert welcome.fields["version"]
    await a.request(SMALL)
    grant = await a.expect(MsgType.GRANT)
    assert grant.fields["flag"] == 0
    doc = scheduler.status_document()
    (dev,) = doc["devices"]
    assert dev["uuid"] == DEVICE and dev["holders"] == ["k1"]
    (client,) = dev["clients"]
    assert client["id"] == "k1"
    assert client["uid"] == os.getuid() and client["pid"] == os.getpid()
    assert client["state"] == "running" and client["used_bytes"] == SMALL
    assert client["label"] == "k1.ipynb"


async def test_clients_that_fit_run_side_by_side(scheduler: Any, connect: Any) -> None:
    a, b = await connect(), await connect()
    await a.hello("a")
    await b.hello("b")
    await a.request(SMALL)
    granted = await a.expect(MsgType.GRANT)
    await b.request(SMALL)
    await b.expect(MsgType.GRANT)
    # a's room shrinks by what b brought (ROOM, room_updates): nothing else is said to a.
    room = await a.expect(MsgType.ROOM)
    assert room.fields["room_bytes"] == granted.fields["room_bytes"] - SMALL
    await a.expect_nothing()
    (dev,) = scheduler.status_document()["devices"]
    assert dev["mode"] == "shared" and sorted(dev["holders"]) == ["a", "b"]


async def test_turns_revoke_released_grant(
    make_scheduler: Any, connect: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    scheduler = await make_scheduler(base_quantum=0.3)
    a, b = await connect(), await connect()
    await a.hello("a")
    await b.hello("b")
    await a.request(BIG)
    await a.expect(MsgType.GRANT)
    await b.request(BIG)
    await b.expect_nothing(0.1)
    (dev,) = scheduler.status_document()["devices"]
    assert dev["mode"] == "turns" and dev["queue"] == ["b"]
    (waiting,) = [c for c in dev["clients"] if c["id"] == "b"]
    assert waiting["state"] == "waiting" and waiting["queue_position"] == 1
    assert isinstance(waiting["waiting_since"], float)
    assert abs(waiting["waiting_since"] - time.time()) < 5  # a Unix time
    # The quantum (0.3 s) expires: only the timer can produce this revoke.
    revoke = await a.expect(MsgType.REVOKE, timeout=3)
    assert revoke.fields["flag"] == 1 and revoke.fields["reason"]
    await a.send(MsgType.RELEASED, flag=1, evicted_bytes=BIG, bytes_moved=BIG, micros=80_000)
    grant = await b.expect(MsgType.GRANT)
    assert grant.fields["flag"] == 0
    # a wants the device back: its memory is on the host, so its grant will restore it.
    await a.request(BIG, evicted=BIG)
    await b.expect(MsgType.REVOKE, timeout=3)
    await b.send(MsgType.RELEASED, flag=1, evicted_bytes=BIG, bytes_moved=BIG, micros=40_000)
    grant = await a.expect(MsgType.GRANT)
    assert grant.fields["flag"] == 1
    await a.send(MsgType.RESTORED, bytes_moved=BIG, micros=16_000)
    await asyncio.sleep(0.05)
    text = caplog.text
    assert f"evicted client=a bytes={BIG}" in text
    assert f"restored client=a bytes={BIG}" in text
    assert "ms=16.0" in text
    assert "grant client=a restore=1" in text
    assert "revoke client=a evict=1" in text
    assert "release client=b evicted=1" in text


async def test_disconnect_moves_the_grant_at_once(scheduler: Any, connect: Any) -> None:
    a, b = await connect(), await connect()
    await a.hello("a")
    await b.hello("b")
    await a.request(BIG)
    await a.expect(MsgType.GRANT)
    await b.request(BIG)
    await b.expect_nothing(0.2)  # quantum 30 s: nothing will happen on its own
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await a.close()  # like kill -9: no GOODBYE, no RELEASED
    await b.expect(MsgType.GRANT, timeout=2)
    assert loop.time() - t0 < 1.0
    (dev,) = scheduler.status_document()["devices"]
    assert [c["id"] for c in dev["clients"]] == ["b"]
    assert dev["resident_bytes"] == BIG


async def test_goodbye_leaves_at_once(scheduler: Any, connect: Any) -> None:
    a, b = await connect(), await connect()
    await a.hello("a")
    await b.hello("b")
    await a.request(BIG)
    await a.expect(MsgType.GRANT)
    await b.request(BIG)
    await b.expect_nothing(0.1)
    await a.send(MsgType.GOODBYE)
    await b.expect(MsgType.GRANT, timeout=2)
    # After GOODBYE, shim messages are unexpected (the connection should close next).
    await a.request(SMALL)
    err = await a.expect(MsgType.ERROR)
    assert err.fields["error_code"] == ErrorCode.UNEXPECTED
    assert not scheduler.policy.has_client("a")


async def test_idle_holder_gives_way(scheduler: Any, connect: Any) -> None:
    a, b = await connect(), await connect()
    await a.hello("a")
    await b.hello("b")
    await a.request(BIG)
    await a.expect(MsgType.GRANT)
    await b.request(BIG)
    await b.expect_nothing(0.1)
    await a.send(MsgType.IDLE, idle_ms=2000)
    revoke = await a.expect(MsgType.REVOKE)
    assert revoke.fields["reason"] == "idle" and revoke.fields["flag"] == 1
    await a.send(MsgType.RELEASED, flag=1, evicted_bytes=BIG, bytes_moved=BIG, micros=1000)
    await b.expect(MsgType.GRANT)


async def test_idle_memory_is_evicted_for_a_waiter(
    scheduler: Any, connect: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    a, b = await connect(), await connect()
    await a.hello("a")
    await b.hello("b")
    await a.request(600 * MiB)
    await a.expect(MsgType.GRANT)
    await a.send(MsgType.RELEASED, flag=0)  # unsolicited: done, memory stays resident
    await b.request(600 * MiB)
    evict = await a.expect(MsgType.EVICT)
    assert "b" in evict.fields["reason"]
    await b.expect_nothing(0.1)
    await a.send(MsgType.EVICTED, bytes_moved=600 * MiB, micros=60_000, evicted_bytes=600 * MiB)
    await b.expect(MsgType.GRANT)
    assert f"evicted client=a bytes={600 * MiB}" in caplog.text
    assert "ms=60.0" in caplog.text


async def test_memory_updates_reach_the_status(scheduler: Any, connect: Any) -> None:
    a = await connect()
    await a.hello("a")
    await a.request(SMALL)
    await a.expect(MsgType.GRANT)
    await a.send(
        MsgType.MEMORY,
        used_bytes=300 * MiB,
        managed_bytes=200 * MiB,
        pinned_bytes=100 * MiB,
        evicted_bytes=0,
    )
    await asyncio.sleep(0.05)
    (client,) = scheduler.status_document()["devices"][0]["clients"]
    assert client["used_bytes"] == 300 * MiB
    assert client["managed_bytes"] == 200 * MiB
    assert client["pinned_bytes"] == 100 * MiB


async def test_unknown_device_is_added_with_the_configured_pool(
    make_scheduler: Any, connect: Any
) -> None:
    scheduler = await make_scheduler(pool_size="", pool_reserve="2GiB")
    a = await connect()
    welcome = await a.hello("a", device="GPU-aaaa", total=16 * GiB)
    assert welcome.fields["pool_bytes"] == 14 * GiB
    b = await connect()
    welcome = await b.hello("b", device="gpu-AAAA", total=16 * GiB)  # the same device
    assert welcome.fields["pool_bytes"] == 14 * GiB
    (dev,) = scheduler.status_document()["devices"]
    assert dev["uuid"] == "GPU-aaaa" and dev["total_bytes"] == 16 * GiB
    assert dev["name"] == "Fake GPU"
    assert len(dev["clients"]) == 2


async def test_pool_sizing() -> None:
    s = GPUShareScheduler(pool_size="24GiB")
    assert s.pool_for(80 * GiB) == 24 * GiB
    assert s.pool_for(16 * GiB) == 16 * GiB  # clamped to the device
    s = GPUShareScheduler(pool_size=GiB)
    assert s.pool_for(80 * GiB) == GiB
    s = GPUShareScheduler()
    assert s.pool_size == "" and s.pool_reserve == "1GiB"
    assert s.pool_for(80 * GiB) == 79 * GiB
    assert s.pool_for(GiB // 2) == 0
    with pytest.raises(Exception, match=r"pool_size.*invalid size"):
        GPUShareScheduler(pool_size="lots")


async def test_every_decision_becomes_its_frame(scheduler: Any, connect: Any) -> None:
    a = await connect()
    await a.hello("a")
    scheduler._execute(
        [
            ev.Grant("a", restore=True),
            ev.Revoke("a", evict=True, reason="r1"),
            ev.Evict("a", reason="r2"),
            ev.Grant("nobody"),  # a client that is gone: skipped
        ]
    )
    grant = (await a.expect(MsgType.GRANT)).fields
    assert grant["flag"] == 1 and re.fullmatch(r"[0-9a-f]{32}", grant["resume_secret"])
    assert (await a.expect(MsgType.REVOKE)).fields == {"flag": 1, "reason": "r1"}
    assert (await a.expect(MsgType.EVICT)).fields == {"reason": "r2"}
    await a.expect_nothing(0.1)


# ---------------------------------------------------------------------------------------------
# Bad frames and unexpected messages


def _header(version: int = 1, mtype: int = 2, length: int = 0, magic: bytes = b"GPSH") -> bytes:
    return struct.pack("<4sBBHI", magic, version, mtype, 0, length)


MALFORMED = {
    "bad magic": (_header(magic=b"XXXX"), ErrorCode.BAD_FRAME),
    "bad version": (_header(version=7), ErrorCode.BAD_VERSION),
    "oversized": (_header(length=65537), ErrorCode.BAD_FRAME),
    "field overrun": (
        _header(length=12) + struct.pack("<HH", 10, 200) + b"\0" * 8,
        ErrorCode.BAD_FRAME,
    ),
    "bad u64 len": (
        _header(length=8) + struct.pack("<HH", 10, 4) + b"\0" * 4,
        ErrorCode.BAD_FRAME,
    ),
    "bad json body": (
        _header(mtype=0x21, length=7) + struct.pack("<HH", 22, 3) + b"{x]",
        ErrorCode.BAD_FRAME,
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_bad_frame_closes_only_that_connection(
    scheduler: Any, connect: Any, case: str
) -> None:
    data, code = MALFORMED[case]
    good, bad = await connect(), await connect()
    await good.hello("good")
    await bad.hello("bad")
    await bad.request(SMALL)
    await bad.expect(MsgType.GRANT)
    await bad.send_raw(data)
    err = await bad.expect(MsgType.ERROR)
    assert err.fields["error_code"] == code
    assert err.fields["message"]
    await bad.expect_closed()
    # The bad client left (its grant with it); the good one is served as before.
    await asyncio.sleep(0.05)
    assert not scheduler.policy.has_client("bad")
    await good.request(SMALL)
    await good.expect(MsgType.GRANT)
    status = await connect()
    await status.send(MsgType.STATUS_REQUEST)
    doc = (await status.expect(MsgType.STATUS)).fields["body"]
    assert [c["id"] for c in doc["devices"][0]["clients"]] == ["good"]


async def test_truncated_frame_then_close(scheduler: Any, connect: Any) -> None:
    bad, good = await connect(), await connect()
    await bad.hello("bad")
    await good.hello("good")
    await bad.request(BIG)
    await bad.expect(MsgType.GRANT)
    await good.request(BIG)
    await bad.send_raw(_header(length=20) + b"\0\0")  # a header promising more than comes
    await bad.expect_nothing(0.1)
    await bad.close()
    await good.expect(MsgType.GRANT)  # the half-sent frame did not keep the grant alive


async def test_garbage_fails_before_a_whole_header(scheduler: Any, connect: Any) -> None:
    bad = await connect()
    await bad.send_raw(b"GET /")  # 5 bytes: not a frame's start
    err = await bad.expect(MsgType.ERROR)
    assert err.fields["error_code"] == ErrorCode.BAD_FRAME
    await bad.expect_closed()


@pytest.mark.parametrize(
    ("first", "fields"),
    [
        (MsgType.REQUEST, {"used_bytes": 1}),
        (MsgType.RELEASED, {"flag": 0}),
        (MsgType.GOODBYE, {}),
        (MsgType.GRANT, {"flag": 0}),  # a scheduler-to-shim message
        (0x42, {}),  # an unknown type
    ],
)
async def test_unexpected_messages(scheduler: Any, connect: Any, first: Any, fields: Any) -> None:
    c = await connect()
    await c.send(first, **fields)
    err = await c.expect(MsgType.ERROR)
    assert err.fields["error_code"] == ErrorCode.UNEXPECTED
    # Not a protocol error: the connection stays usable.
    welcome = await c.hello("late")
    assert welcome.fields["pool_bytes"] == GiB


async def test_second_hello_is_unexpected(scheduler: Any, connect: Any) -> None:
    c = await connect()
    await c.hello("x")
    await c.send(MsgType.HELLO, client_id="y")
    err = await c.expect(MsgType.ERROR)
    assert err.fields["error_code"] == ErrorCode.UNEXPECTED
    ctl = await connect()
    await ctl.send(MsgType.STATUS_REQUEST)
    await ctl.expect(MsgType.STATUS)
    await ctl.send(MsgType.HELLO, client_id="z")  # a control connection cannot become a shim
    assert (await ctl.expect(MsgType.ERROR)).fields["error_code"] == ErrorCode.UNEXPECTED


# ---------------------------------------------------------------------------------------------
# Duplicate ids


async def test_duplicate_id_from_another_process_is_disambiguated(
    scheduler: Any, connect: Any
) -> None:
    scheduler.fake_creds = [None, {"pid": 99999}]
    a, b = await connect(), await connect()
    await a.hello("kernel-1")
    await b.hello("kernel-1")
    ids = [c["id"] for c in scheduler.status_document()["devices"][0]["clients"]]
    assert ids == ["kernel-1", "kernel-1#99999"]
    await b.request(SMALL)
    await b.expect(MsgType.GRANT)
    await a.expect_nothing(0.1)
    await b.close()
    await asyncio.sleep(0.05)
    assert scheduler.policy.has_client("kernel-1")
    assert not scheduler.policy.has_client("kernel-1#99999")


async def test_duplicate_id_from_the_same_process_is_a_reconnection(
    scheduler: Any, connect: Any
) -> None:
    old, new = await connect(), await connect()
    await old.hello("k")
    await old.request(BIG)
    await old.expect(MsgType.GRANT)
    await new.hello("k")
    await old.expect_closed()
    (dev,) = scheduler.status_document()["devices"]
    assert [c["id"] for c in dev["clients"]] == ["k"]
    assert dev["holders"] == []
    await new.request(BIG)
    await new.expect(MsgType.GRANT)


# ---------------------------------------------------------------------------------------------
# Lifecycle


async def test_socket_file_permissions_and_cleanup(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "sub", "s.sock")
    s = GPUShareScheduler(socket_path=path, use_nvml=False, socket_mode=0o660)
    await s.start()
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o755
        # The temporary name is gone; the private directory holds the resume key (0700, 0600).
        assert sorted(os.listdir(os.path.dirname(path))) == [".gpushare-private", "s.sock"]
        private = os.path.join(os.path.dirname(path), ".gpushare-private")
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
        key = os.path.join(private, "resume.key")
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    finally:
        await s.stop()
    assert not os.path.exists(path)


async def test_per_user_directory_is_private(sock_dir: str) -> None:
    path = os.path.join(sock_dir, f"gpushare-{os.getuid()}", "scheduler.sock")
    s = GPUShareScheduler(socket_path=path, use_nvml=False)
    if os.getuid() == 0:
        s.socket_dir_mode = 0o700  # root's default directory is the node-wide one
    await s.start()
    try:
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
    finally:
        await s.stop()


async def test_a_second_scheduler_refuses_and_a_stale_socket_is_replaced(
    scheduler: Any, sock_path: str, connect: Any
) -> None:
    other = GPUShareScheduler(socket_path=sock_path, use_nvml=False)
    with pytest.raises(SchedulerStartError, match="already listening"):
        await other.start()
    # The refused one did not remove the live socket.
    c = await connect()
    await c.send(MsgType.STATUS_REQUEST)
    await c.expect(MsgType.STATUS)
    await scheduler.stop()
    # A stale socket file (nobody listening) is replaced.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(sock_path)
    stale.close()
    fresh = GPUShareScheduler(socket_path=sock_path, use_nvml=False)
    await fresh.start()
    try:
        c2 = await FakeShim.connect(sock_path)
        await c2.send(MsgType.STATUS_REQUEST)
        await c2.expect(MsgType.STATUS)
        await c2.close()
    finally:
        await fresh.stop()


async def test_refuses_to_replace_a_regular_file(sock_path: str) -> None:
    with open(sock_path, "w") as f:
        f.write("precious")
    s = GPUShareScheduler(socket_path=sock_path, use_nvml=False)
    with pytest.raises(SchedulerStartError, match="not a socket"):
        await s.start()
    with open(sock_path) as f:
        assert f.read() == "precious"


async def test_stop_closes_clients(make_scheduler: Any, connect: Any, sock_path: str) -> None:
    scheduler = await make_scheduler()
    a = await connect()
    await a.hello("a")
    await scheduler.stop()
    await a.expect_closed()
    assert not os.path.exists(sock_path)


async def test_run_forever_and_request_stop(sock_path: str) -> None:
    s = GPUShareScheduler(socket_path=sock_path, use_nvml=False)
    task = asyncio.create_task(s.run_forever())
    for _ in range(100):
        if os.path.exists(sock_path):
            break
        await asyncio.sleep(0.02)
    assert os.path.exists(sock_path)
    s.request_stop()
    await asyncio.wait_for(task, 5)
    assert not os.path.exists(sock_path)


async def test_nvml_absent_is_reported_not_raised(sock_path: str, monkeypatch: Any) -> None:
    from jupyter_gpushare.scheduler.shell import devices

    def broken() -> devices.Discovery:
        return devices.Discovery([], "NVML unavailable (libnvidia-ml.so.1 not found)")

    monkeypatch.setattr(devices, "discover_devices", broken)
    s = GPUShareScheduler(socket_path=sock_path, use_nvml=True)
    await s.start()
    try:
        doc = s.status_document()
        assert doc["nvml"] == "NVML unavailable (libnvidia-ml.so.1 not found)"
        assert doc["devices"] == []
    finally:
        await s.stop()


async def test_nvml_devices_are_registered(sock_path: str, monkeypatch: Any) -> None:
    from jupyter_gpushare.scheduler.shell import devices

    def fake() -> devices.Discovery:
        return devices.Discovery([devices.DeviceInfo(0, DEVICE, "NVIDIA H100", 80 * GiB)])

    monkeypatch.setattr(devices, "discover_devices", fake)
    s = GPUShareScheduler(socket_path=sock_path, pool_size="24GiB")
    await s.start()
    try:
        doc = s.status_document()
        assert doc["nvml"] is True
        (dev,) = doc["devices"]
        assert dev["pool_bytes"] == 24 * GiB and dev["total_bytes"] == 80 * GiB
        # A shim on that device (its driver may report another total) joins the NVML device.
        shim = await FakeShim.connect(sock_path)
        welcome = await shim.hello("k", device=DEVICE.lower(), total=79 * GiB)
        assert welcome.fields["pool_bytes"] == 24 * GiB
        await shim.close()
    finally:
        await s.stop()


def test_discover_devices_says_why_nvml_gave_no_gpus(monkeypatch: Any) -> None:
    """Never raises: bindings missing, NVML failing to start, or a query failing half-way each
    give no devices (never half a list) and the reason; NVML is shut down after a query."""
    import types

    from jupyter_gpushare.scheduler.shell.devices import DeviceInfo, discover_devices

    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` fails
    missing = discover_devices()
    assert missing.devices == [], missing
    assert (missing.error or "").startswith("NVML bindings unavailable (ModuleNotFoundError"), (
        missing
    )

    calls: list[str] = []

    def fails(what: str) -> Any:
        def call(*args: Any) -> Any:
            calls.append(what)
            raise RuntimeError(f"{what} failed")

        return call

    handles = {0: "h0"}  # a second GPU's handle cannot be had
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: handles[i] if i in handles else fails("handle")(),
        nvmlDeviceGetUUID=lambda h: b"GPU-0000",
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=140 * GiB),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    half = discover_devices()
    assert half.devices == [] and half.error == "NVML query failed (handle failed)", half
    assert calls == ["init", "handle", "shutdown"], calls

    handles[1] = "h1"
    calls.clear()
    both = discover_devices()
    assert both.error is None and calls == ["init", "shutdown"], both
    assert both.devices[1] == DeviceInfo(1, "GPU-0000", "NVIDIA H200", 140 * GiB), both

    fake.nvmlInit = fails("init")
    down = discover_devices()
    assert down.devices == [] and down.error == "NVML unavailable (init failed)", down


async def idle_holder_asked_to_precopy(connect: Any) -> Any:
    """Client a holds BIG bytes, goes idle, and is asked for a pre-copy."""
    a = await connect()
    await a.hello("a")
    await a.request(BIG)
    await a.expect(MsgType.GRANT)
    await a.send(MsgType.IDLE, idle_ms=500)
    await a.expect(MsgType.PRECOPY)
    return a


async def test_an_idle_precopied_holder_is_evicted_for_room_over_the_wire(
    make_scheduler: Any, connect: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """c.GPUShareScheduler.keep_free (default "auto": room for the last arrival, at most a
    quarter of the pool; keep_free_wait 0: kept even where an unmap on demand is cheap): an idle
    holder whose memory is fully copied to the host is revoked with eviction before anyone asks,
    and the next arrival is granted without waiting."""
    caplog.set_level(logging.INFO)
    await make_scheduler(precopy_idle=True, keep_free_wait=0)
    a = await idle_holder_asked_to_precopy(connect)
    await a.expect_nothing(0.2)  # the copy is not complete yet: a stays
    await a.send(MsgType.PRECOPIED, bytes_moved=0, micros=0, precopied_bytes=BIG)
    revoke = await a.expect(MsgType.REVOKE)
    assert revoke.fields["flag"] == 1 and revoke.fields["reason"] == "room for the next arrival"
    await a.send(MsgType.RELEASED, flag=1, evicted_bytes=BIG, bytes_moved=BIG, micros=1_000)
    b = await connect()
    await b.hello("b")
    await b.request(BIG)
    await b.expect(MsgType.GRANT, timeout=1.0)
    assert "reason='room for the next arrival'" in caplog.text


async def test_an_idle_resident_client_is_asked_to_precopy(
    make_scheduler: Any, connect: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """c.GPUShareScheduler.precopy_idle: PRECOPY to an idle holder, PRECOPIED logged and kept as
    a claim bounded by the client's own evictable bytes."""
    caplog.set_level(logging.INFO)
    # keep_free off: with it, a's complete copy in this small pool would make room at once
    # (test_an_idle_precopied_holder_is_evicted_for_room_over_the_wire).
    server = await make_scheduler(precopy_idle=True, keep_free=0)
    a = await idle_holder_asked_to_precopy(connect)
    # Claims more than it could evict: bounded.
    await a.send(MsgType.PRECOPIED, bytes_moved=BIG, micros=20_000, precopied_bytes=100 * BIG)
    await a.expect_nothing(0.2)
    assert f"precopied client=a bytes={BIG}" in caplog.text
    (dev,) = server.status_document()["devices"]
    (client,) = dev["clients"]
    assert 0 < client["precopied_bytes"] <= client["managed_bytes"]
    # Idle again with the copy still valid: no second request.
    await a.send(MsgType.IDLE, idle_ms=900, precopied_bytes=client["precopied_bytes"])
    await a.expect_nothing(0.2)
