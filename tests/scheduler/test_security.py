"""Identities, what each user sees, who may act on a kernel, and quota ceilings.

Two users share this test's uid through the token scheme (``token_uids`` = our uid), exactly as
JupyterHub users share the hub's uid; other uids are faked with ``FakeCredScheduler.fake_creds``
(SO_PEERCRED of a second account would need root).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from sched_helpers import DEVICE, FakeShim, GiB, MiB

from jupyter_gpushare.identity import generate_key, load_key, user_token
from jupyter_gpushare.protocol import ErrorCode, MsgType
from jupyter_gpushare.scheduler_client import SchedulerClient, SchedulerError

UID = os.getuid()


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = str(tmp_path / "user.key")
    generate_key(path)
    return path


@pytest.fixture
def token(key_file: str) -> Any:
    key = load_key(key_file)
    return lambda user: user_token(key, user)


def write_users(tmp_path: Path, text: str) -> str:
    path = tmp_path / "users.toml"
    path.write_text(text)
    return str(path)


USERS = """
[defaults]
quota = "512MiB"
weight = 1.0
[admins]
users = ["ops"]
groups = ["gpuadmins"]
[groups.gpuadmins]
members = ["erin"]
[users.alice]
weight = 2.0
"""


@pytest.fixture
async def hub(make_scheduler: Any, key_file: str, tmp_path: Path) -> Any:
    """A scheduler where our uid is shared by many users (as a hub's or a pod's uid)."""
    return await make_scheduler(
        token_uids=[UID], user_key_file=key_file, users_config=write_users(tmp_path, USERS)
    )


async def as_user(connect: Any, token: Any, user: str, client: str, **kw: Any) -> FakeShim:
    shim = await connect()
    await shim.hello(client, user=user, token=token(user), **kw)
    return shim


def ctl(sock_path: str, token: Any, user: str) -> SchedulerClient:
    return SchedulerClient(sock_path, user=user, token=token(user))


async def test_status_shows_own_kernels_in_full_and_others_summed(
    hub: Any, connect: Any, token: Any, sock_path: str
) -> None:
    a1 = await as_user(connect, token, "alice", "a1")
    await as_user(connect, token, "alice", "a2")
    b1 = await as_user(connect, token, "bob", "b1")
    await a1.request(300 * MiB)
    await a1.expect(MsgType.GRANT)
    await b1.request(200 * MiB)
    await b1.expect(MsgType.GRANT)
    await asyncio.sleep(0.05)

    doc = await ctl(sock_path, token, "bob").status()
    assert doc["identity"] == {"user": "bob", "admin": False, "by": "token"}
    (dev,) = doc["devices"]
    assert [c["id"] for c in dev["clients"]] == ["b1"]  # bob's own kernel, in full
    assert dev["clients"][0]["label"] == "b1.ipynb" and dev["clients"][0]["user"] == "bob"
    assert dev["holders"] == ["b1"] and dev["queue"] == []
    assert sorted(dev["holder_users"]) == ["alice", "bob"]
    (alice,) = dev["others"]
    assert alice["user"] == "alice" and alice["clients"] == 2 and alice["running"] == 1
    assert alice["used_bytes"] == 300 * MiB and alice["resident_bytes"] == 300 * MiB
    assert alice["weight"] == 4.0  # two clients of weight 2 (alice's configured weight)
    # Nothing of alice's clients leaks: no id, pid, label or quota anywhere in bob's document.
    text = repr(doc)
    for secret in ("a1", "a2", "a1.ipynb", "a2.ipynb"):
        assert f"'{secret}'" not in text

    # `gpushare status` prints the view as it is: other users by name and in sums.
    from jupyter_gpushare.cli import format_status

    # (the socket's random directory name, which the text shows, may hold "a2" by chance)
    text = format_status(doc).replace(sock_path, "SOCKET")
    assert "user alice: 2 clients (1 running, 0 waiting), resident 300.00 MiB" in text
    assert "holder: " in text and "a1" not in text and "a2" not in text
    assert "b1" in text

    full = await ctl(sock_path, token, "ops").status()  # an admin sees everything
    assert full["identity"]["admin"] is True
    assert sorted(c["id"] for c in full["devices"][0]["clients"]) == ["a1", "a2", "b1"]
    assert "others" not in full["devices"][0]


async def test_only_owner_or_admin_may_act(
    hub: Any, connect: Any, token: Any, sock_path: str
) -> None:
    a = await as_user(connect, token, "alice", "a1")
    await a.request(100 * MiB)
    await a.expect(MsgType.GRANT)
    bob = ctl(sock_path, token, "bob")
    for action, kwargs in (
        ("release", {}),
        ("evict", {}),
        ("set_quota", {"quota": 100 * MiB}),
        ("kernel_state", {"state": "idle"}),
    ):
        with pytest.raises(SchedulerError) as exc:
            await bob.control(action, client="a1", **kwargs)
        assert exc.value.code == ErrorCode.NOT_FOUND
        assert exc.value.message == "no client 'a1'"  # as for an id that does not exist
    await a.expect_nothing()  # none of bob's requests reached alice's kernel
    # The owner may.
    await ctl(sock_path, token, "alice").control("kernel_state", client="a1", state="idle")
    # An admin (by user name in the users config) may: the release reaches the kernel.
    reply = await ctl(sock_path, token, "ops").release("a1")
    assert reply["ok"] is True
    await a.expect(MsgType.REVOKE)
    # And an admin by group (a [groups.NAME] members list named in [admins] groups).
    reply = await ctl(sock_path, token, "erin").control("kernel_state", client="a1", state="busy")
    assert reply["ok"] is True


async def test_forged_or_missing_token_is_refused(
    hub: Any, connect: Any, token: Any, sock_path: str
) -> None:
    forged = await connect()
    await forged.send(
        MsgType.HELLO, client_id="x", pid=1, device_uuid=DEVICE, device_total=GiB,
        user="alice", token=token("mallory"),
    )  # fmt: skip
    err = await forged.expect(MsgType.ERROR)
    assert err["error_code"] == ErrorCode.FORBIDDEN
    assert "token for user 'alice' is not valid" in err["message"]
    await forged.expect_closed()

    missing = await connect()
    await missing.send(MsgType.HELLO, client_id="y", pid=1, device_uuid=DEVICE, user="alice")
    err = await missing.expect(MsgType.ERROR)
    assert err["error_code"] == ErrorCode.FORBIDDEN
    assert "GPUSHARE_USER_TOKEN" in err["message"]
    await missing.expect_closed()
    assert "x" not in hub._shims and "y" not in hub._shims

    for client in (
        SchedulerClient(sock_path, user="alice", token=token("bob")),
        SchedulerClient(sock_path, user="", token=""),
        SchedulerClient(sock_path, user="alice", token="00" * 32),
    ):
        with pytest.raises(SchedulerError) as exc:
            await client.status()
        assert exc.value.code == ErrorCode.FORBIDDEN


async def test_token_uid_is_never_admin_by_uid(make_scheduler: Any, key_file: str) -> None:
    # Our uid is the scheduler's own uid, an admin by default; as a shared uid it is not.
    server = await make_scheduler(token_uids=[str(UID)], user_key_file=key_file)
    assert not server.is_admin(UID)
    key = load_key(key_file)
    from jupyter_gpushare.protocol import Message
    from jupyter_gpushare.scheduler.shell.server import PeerCred

    msg = Message(MsgType.STATUS_REQUEST, {"user": "carol", "token": user_token(key, "carol")})
    ident = await server.identify(PeerCred(1, UID, os.getgid()), msg)
    assert ident.user == "carol" and ident.token and not ident.admin


async def test_uid_peers_cannot_claim_another_identity(
    scheduler: Any, connect: Any, sock_path: str
) -> None:
    scheduler.fake_creds = [{"uid": 4242}, {"uid": 4243}, {"uid": 4243}]
    victim = await connect()
    await victim.hello("v1", user="alice")  # uid 4242 says it is alice: it is "4242"
    thief = await connect()
    await thief.send(MsgType.CONTROL, body={"action": "release", "client": "v1"}, user="4242")
    err = await thief.expect(MsgType.ERROR)
    assert err["error_code"] == ErrorCode.NOT_FOUND
    await thief.close()
    viewer = await connect()
    await viewer.send(MsgType.STATUS_REQUEST, user="4242")
    doc = (await viewer.expect(MsgType.STATUS))["body"]
    assert doc["identity"] == {"user": "4243", "admin": False, "by": "uid"}
    (dev,) = doc["devices"]
    assert dev["clients"] == []
    assert [o["user"] for o in dev["others"]] == ["4242"]  # not "alice": the claim was ignored
    # The scheduler's own uid (an admin) sees the user it recorded.
    full = await SchedulerClient(sock_path).status()
    assert full["devices"][0]["clients"][0]["user"] == "4242"


async def test_quota_ceiling(hub: Any, connect: Any, token: Any, sock_path: str) -> None:
    # No quota asked: the ceiling applies. Less than the ceiling: kept. More: clamped.
    a0 = await connect()
    assert (await a0.hello("a0", user="alice", token=token("alice")))["quota"] == 512 * MiB
    a1 = await connect()
    welcome = await a1.hello("a1", user="alice", token=token("alice"), quota=256 * MiB)
    assert welcome["quota"] == 256 * MiB
    a2 = await connect()
    welcome = await a2.hello("a2", user="alice", token=token("alice"), quota=4 * GiB)
    assert welcome["quota"] == 512 * MiB

    alice = ctl(sock_path, token, "alice")
    for asked in (GiB, 0):  # above the ceiling, or "none": refused, and said why
        with pytest.raises(SchedulerError) as exc:
            await alice.set_quota("a1", asked)
        assert exc.value.code == ErrorCode.FORBIDDEN
        assert "ceiling of 512.00 MiB" in exc.value.message and "ask an admin" in exc.value.message
    await a1.expect_nothing()
    await alice.set_quota("a1", 400 * MiB)  # within it: fine
    assert (await a1.expect(MsgType.SET_QUOTA))["quota"] == 400 * MiB
    await ctl(sock_path, token, "ops").set_quota("a1", 2 * GiB)  # an admin may exceed it
    assert (await a1.expect(MsgType.SET_QUOTA))["quota"] == 2 * GiB
    doc = await ctl(sock_path, token, "alice").status()
    quotas = {c["id"]: c["quota_bytes"] for c in doc["devices"][0]["clients"]}
    assert quotas == {"a0": 512 * MiB, "a1": 2 * GiB, "a2": 512 * MiB}


async def test_weights_from_the_users_config(hub: Any, connect: Any, token: Any) -> None:
    await as_user(connect, token, "alice", "a1")  # alice: weight 2
    await as_user(connect, token, "alice", "a2", weight_milli=500)  # a kernel may ask for less
    await as_user(connect, token, "bob", "b1", weight_milli=8000)  # but never more
    weights = {c["id"]: c["weight"] for c in hub.status_document()["devices"][0]["clients"]}
    assert weights == {"a1": 2.0, "a2": 1.0, "b1": 1.0}


async def test_reload_applies_new_ceilings_and_keeps_old_on_error(
    hub: Any, connect: Any, token: Any, sock_path: str, tmp_path: Path, caplog: Any
) -> None:
    a = await as_user(connect, token, "alice", "a1")
    b = await as_user(connect, token, "bob", "b1", quota=100 * MiB)
    write_users(tmp_path, USERS.replace('"512MiB"', '"64MiB"').replace("2.0", "3.0"))
    reply = await ctl(sock_path, token, "ops").control("reload")
    assert reply == {"ok": True, "action": "reload"}
    # Lowered ceilings reach the shims at once; so do weights.
    assert (await a.expect(MsgType.SET_QUOTA))["quota"] == 64 * MiB
    assert (await b.expect(MsgType.SET_QUOTA))["quota"] == 64 * MiB
    weights = {c["id"]: c["weight"] for c in hub.status_document()["devices"][0]["clients"]}
    assert weights == {"a1": 3.0, "b1": 1.0}

    # A raised ceiling gives back what the kernel asked for (bob: 100 MiB), not more.
    write_users(tmp_path, USERS.replace('"512MiB"', '"1GiB"'))
    assert await hub.reload() is True
    assert (await a.expect(MsgType.SET_QUOTA))["quota"] == GiB
    assert (await b.expect(MsgType.SET_QUOTA))["quota"] == 100 * MiB

    # A bad file: logged, rejected, the old configuration stays in force.
    write_users(tmp_path, '[defaults]\nquota = "lots"\n')
    with pytest.raises(SchedulerError) as exc:
        await ctl(sock_path, token, "ops").control("reload")
    assert exc.value.code == ErrorCode.BAD_REQUEST and "previous one" in exc.value.message
    logged = [r.getMessage() for r in caplog.records]
    assert any("reload failed" in m and "lots" in m for m in logged)
    assert hub.users.defaults.quota == GiB
    await a.expect_nothing()
    # Only admins may reload.
    with pytest.raises(SchedulerError) as exc:
        await ctl(sock_path, token, "alice").control("reload")
    assert exc.value.code == ErrorCode.FORBIDDEN


async def test_start_refuses_bad_access_config(
    make_scheduler: Any, tmp_path: Path, key_file: str
) -> None:
    from jupyter_gpushare.scheduler.shell.server import SchedulerStartError

    with pytest.raises(SchedulerStartError, match="user_key_file is not"):
        await make_scheduler(token_uids=[UID])
    with pytest.raises(SchedulerStartError, match="does not exist"):
        await make_scheduler(token_uids=[UID], user_key_file=str(tmp_path / "missing.key"))
    with pytest.raises(SchedulerStartError, match="no user 'no-such-user-x'"):
        await make_scheduler(token_uids=["no-such-user-x"], user_key_file=key_file)
    bad = write_users(tmp_path, "[users.alice]\nquota = -1\n")
    with pytest.raises(SchedulerStartError, match=r"users\.alice\.quota"):
        await make_scheduler(users_config=bad)


# -- One peer's frames have a bounded cost (issue 22, item 4; the real-uid flood is in
# tests/reliability/test_hostile_flood.py) ------------------------------------------------------


def _memory_frames(count: int, last: int) -> bytes:
    from jupyter_gpushare.protocol import Message, encode

    frames = [
        encode(Message(MsgType.MEMORY, {"used_bytes": (i + 1) * MiB, "pinned_bytes": MiB}))
        for i in range(count)
    ]
    return b"".join(frames) + encode(Message(MsgType.MEMORY, {"used_bytes": last}))


async def test_a_burst_of_memory_frames_is_one_event_with_the_latest_claim(
    make_scheduler: Any, connect: Any
) -> None:
    scheduler = await make_scheduler(frames_per_second=0)
    scheduler.fake_creds = [{"uid": 1001}]
    events: list[int] = []
    scheduler.add_status_listener(lambda: events.append(1))
    shim = await connect()
    await shim.hello("k")
    before = len(events)
    await shim.send_raw(_memory_frames(300, 77 * MiB))
    await asyncio.sleep(0.3)
    client = scheduler.status_document()["devices"][0]["clients"][0]
    # The latest claim, its absent field kept from the frame before (as one frame at a time).
    assert (client["used_bytes"], client["pinned_bytes"]) == (77 * MiB, MiB), client
    assert len(events) - before <= 5, len(events) - before  # one per read, not 301


async def test_a_peer_past_its_frame_budget_is_read_more_slowly(
    make_scheduler: Any, connect: Any
) -> None:
    scheduler = await make_scheduler(frames_per_second=200)
    scheduler.fake_creds = [{"uid": 1001}, {"uid": 1001}, {"uid": 1002}]
    flooder = await connect()
    await flooder.hello("flood")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    # 1000 frames: 400 pass at once (the burst), the other 600 take 3 s at 200 a second.
    await flooder.send_raw(_memory_frames(999, 5 * MiB))
    await flooder.request(6 * MiB)
    same_uid = await connect()  # another connection of the flooding uid shares its budget
    await same_uid.send(MsgType.HELLO, client_id="flood-2", pid=os.getpid(), device_uuid=DEVICE)
    other = await connect()  # another uid is served at once
    await other.hello("bystander")
    assert loop.time() - t0 < 1.0
    await flooder.expect(MsgType.GRANT, timeout=10)
    assert loop.time() - t0 >= 2.0  # read only as fast as its budget allows
    await same_uid.expect(MsgType.WELCOME, timeout=10)


def test_the_frame_budget_is_a_token_bucket_per_peer() -> None:
    from jupyter_gpushare.scheduler.shell.transport import EventBudget

    budget = EventBudget(rate=100, burst=200)
    assert budget.debt("a", 200, now=0.0) == 0.0  # the burst
    assert budget.debt("a", 50, now=0.0) == pytest.approx(0.5)  # 50 over, at 100 a second
    assert budget.debt("b", 100, now=0.0) == 0.0  # another peer has its own
    assert budget.debt("a", 0, now=1.0) == 0.0  # refilled: 100 a second
    assert EventBudget(rate=0, burst=0).debt("a", 10**6, now=0.0) == 0.0  # no limit
