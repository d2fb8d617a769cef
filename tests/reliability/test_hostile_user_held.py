"""The 21 attempts of a hostile local user that held (issue #15), as real separate uids.

docs/reliability.md, "A hostile local user", lists them with their outcomes. Each test runs the
attacker's side in a process that has dropped to another real account (``useradd``; CI runs as
root) against a node scheduler run by root in this process, and checks the exact refusal and
that the victim's kernel (another real account, holding the GPU) is unchanged and heard nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from local_users import (
    LocalUser,
    clients_of,
    collect,
    control,
    exchange,
    kill,
    open_to_everyone,
    recording_shim,
    run_as,
    shim,
    spawn_as,
    tmp_dir,
    until,
)

from jupyter_gpushare.identity import generate_key, load_key, user_token
from jupyter_gpushare.protocol import HEADER, MAGIC, VERSION, ErrorCode, Message, MsgType, encode

DEVICE = {"device_uuid": "GPU-held-0", "device_total": 8 << 30}
VICTIM_ID = "v-kernel"
VICTIM_LABEL = "secret-plans.ipynb"
#: What of the victim's client must not change (its status entry, as an admin sees it).
WATCHED = ("state", "used_bytes", "quota_bytes", "user", "label", "weight", "pid")


@dataclass(frozen=True)
class People:
    victim: LocalUser
    attacker: LocalUser
    hub: LocalUser  # a uid many users share (token_uids), as a hub's: they prove who they are


@pytest.fixture(scope="module")
def people(local_users: Callable[[str], LocalUser]) -> People:
    return People(local_users("victim"), local_users("attack"), local_users("hub"))


@pytest.fixture
def open_tmp() -> Iterator[str]:
    """A directory every user may read (the victim's stop file lies there)."""
    with tmp_dir(0o755) as path:
        yield path


@dataclass
class Scene:
    node: Any
    path: str
    people: People
    key: bytes
    stop: str
    victim_pid: int
    victim_fd: int
    before: dict[str, Any]

    def token(self, user: str) -> str:
        return user_token(self.key, user)

    async def victim_unchanged(self) -> None:
        """The victim's kernel still holds the GPU as it did, and heard nothing but its WELCOME
        and GRANT."""
        now = clients_of(self.node).get(VICTIM_ID)
        assert now is not None, "the victim's client is gone"
        assert {k: now.get(k) for k in WATCHED} == self.before
        open(self.stop, "w").close()
        heard = await until_collected(self.victim_pid, self.victim_fd)
        self.victim_pid = -1
        assert [m[0] for m in heard] == [MsgType.WELCOME, MsgType.GRANT], heard


async def until_collected(pid: int, rfd: int) -> Any:
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(None, collect, pid, rfd, 30)


def node_socket(node: Any) -> str:
    """Open the node's socket to every user, as the node-wide service does (0755 dir, 0666)."""
    open_to_everyone(node)
    return str(node.socket_path)


@pytest.fixture
async def scene(
    make_scheduler: Any, people: People, open_tmp: str, tmp_path: Any
) -> AsyncIterator[Scene]:
    """A node scheduler (root) with the victim's kernel holding 512 MiB of a 4 GiB pool."""
    key_file = str(tmp_path / "user.key")
    generate_key(key_file)
    users = tmp_path / "users.toml"
    users.write_text('[defaults]\nquota = "1GiB"\n')
    node = await make_scheduler(
        pool_size="4GiB",
        token_uids=[str(people.hub.uid)],
        user_key_file=key_file,
        users_config=str(users),
    )
    path = node_socket(node)
    stop = os.path.join(open_tmp, "stop")
    fields = {**DEVICE, "client_id": VICTIM_ID, "label": VICTIM_LABEL, "quota": 1 << 29}
    pid, rfd = spawn_as(people.victim, recording_shim, path, fields, 1 << 29, stop)
    await until(lambda: clients_of(node).get(VICTIM_ID, {}).get("state") == "running")
    victim = clients_of(node)[VICTIM_ID]
    s = Scene(node, path, people, load_key(key_file), stop, pid, rfd, {})
    s.before = {k: victim.get(k) for k in WATCHED}
    try:
        yield s
    finally:
        if s.victim_pid > 0:
            kill(s.victim_pid)
            os.close(s.victim_fd)


def hello(**fields: Any) -> bytes:
    return encode(Message(MsgType.HELLO, {"pid": 1, **DEVICE, **fields}))


def frame(mtype: int, payload: bytes, *, magic: bytes = MAGIC, version: int = VERSION) -> bytes:
    """A frame built by hand: any type, any payload, any header (encode() refuses bad ones)."""
    return HEADER.pack(magic, version, mtype, 0, len(payload)) + payload


def refused(answer: Any, code: ErrorCode, text: str = "") -> None:
    assert answer is not None and answer[0] == MsgType.ERROR, answer
    assert answer[1]["error_code"] == code, answer
    assert text in answer[1]["message"], answer


# -- 1-3. Tokens: a uid many users share proves the user with a token ---------------------------


async def test_held_1_a_forged_token_in_hello(scene: Scene) -> None:
    forged = hello(client_id="x1", user=scene.people.victim.name, token="00" * 32)
    answers, closed = await run_as(scene.people.hub, exchange, scene.path, [forged])
    refused(answers[0], ErrorCode.FORBIDDEN, "is not valid")
    assert closed and "x1" not in clients_of(scene.node)
    await scene.victim_unchanged()


async def test_held_2_another_users_token_in_hello(scene: Scene) -> None:
    # The attacker's own valid token (user "mallory" on the hub's uid) with the victim's name.
    theirs = scene.token("mallory")
    stolen_name = hello(client_id="x2", user=scene.people.victim.name, token=theirs)
    answers, closed = await run_as(scene.people.hub, exchange, scene.path, [stolen_name])
    refused(answers[0], ErrorCode.FORBIDDEN, f"token for user '{scene.people.victim.name}'")
    assert closed and "x2" not in clients_of(scene.node)
    await scene.victim_unchanged()


async def test_held_3_a_forged_token_on_a_control_request(scene: Scene) -> None:
    fields = {"user": scene.people.victim.name, "token": "ab" * 32}
    body = {"action": "release", "client": VICTIM_ID}
    got = await run_as(scene.people.hub, control, scene.path, MsgType.CONTROL, body, fields)
    refused(got, ErrorCode.FORBIDDEN, "is not valid")
    await scene.victim_unchanged()


# -- 4-5. Identity and ids from a uid of one's own ----------------------------------------------


async def test_held_4_a_hello_claiming_another_user_is_its_own_uids(scene: Scene) -> None:
    claim = {**DEVICE, "client_id": "x4", "user": scene.people.victim.name}
    pid, rfd = spawn_as(scene.people.attacker, shim, scene.path, claim, 0, 30.0)
    try:
        await until(lambda: "x4" in clients_of(scene.node))
        # Known by its uid's name, not the one it claimed: its kernels are not the victim's.
        assert clients_of(scene.node)["x4"]["user"] == scene.people.attacker.name
    finally:
        kill(pid)
        os.close(rfd)
    await scene.victim_unchanged()


async def test_held_5_a_hello_with_the_victims_live_id(scene: Scene) -> None:
    pid, rfd = spawn_as(
        scene.people.attacker, shim, scene.path, {**DEVICE, "client_id": VICTIM_ID}, 0, 30.0
    )
    try:
        squat = f"{VICTIM_ID}#{pid}"  # a second live client of one id gets <id>#<pid>
        await until(lambda: squat in clients_of(scene.node))
        assert clients_of(scene.node)[squat]["user"] == scene.people.attacker.name
        assert clients_of(scene.node)[VICTIM_ID]["user"] == scene.people.victim.name
    finally:
        kill(pid)
        os.close(rfd)
    await scene.victim_unchanged()


# -- 6-9. Acting on another user's kernel: not found, as an id that does not exist -------------


@pytest.mark.parametrize(
    "action",
    [
        pytest.param({"action": "release"}, id="6-release"),
        pytest.param({"action": "evict"}, id="7-evict"),
        pytest.param({"action": "set_quota", "quota": 4 << 30}, id="8-set_quota"),
        pytest.param({"action": "kernel_state", "state": "idle"}, id="9-kernel_state"),
    ],
)
async def test_held_6_to_9_acting_on_another_users_kernel(
    scene: Scene, action: dict[str, Any]
) -> None:
    body = {**action, "client": VICTIM_ID}
    got = await run_as(scene.people.attacker, control, scene.path, MsgType.CONTROL, body)
    refused(got, ErrorCode.NOT_FOUND, f"no client '{VICTIM_ID}'")
    await scene.victim_unchanged()


# -- 10-12. What only admins may do --------------------------------------------------------------


async def test_held_10_raising_ones_own_quota_over_the_ceiling(scene: Scene) -> None:
    pid, rfd = spawn_as(
        scene.people.attacker, shim, scene.path, {**DEVICE, "client_id": "x10"}, 0, 30.0
    )
    try:
        await until(lambda: "x10" in clients_of(scene.node))
        body = {"action": "set_quota", "client": "x10", "quota": 4 << 30}
        got = await run_as(scene.people.attacker, control, scene.path, MsgType.CONTROL, body)
        refused(got, ErrorCode.FORBIDDEN, "ceiling")
        assert clients_of(scene.node)["x10"]["quota_bytes"] == 1 << 30  # the users config's ceiling
    finally:
        kill(pid)
        os.close(rfd)
    await scene.victim_unchanged()


async def test_held_11_a_reload_by_a_non_admin(scene: Scene) -> None:
    got = await run_as(
        scene.people.attacker, control, scene.path, MsgType.CONTROL, {"action": "reload"}
    )
    refused(got, ErrorCode.FORBIDDEN, "admins only")
    await scene.victim_unchanged()


async def test_held_12_device_plugin_actions_by_a_non_admin(scene: Scene) -> None:
    for body in (
        {"action": "allocate", "id": "x", "devices": [DEVICE["device_uuid"]]},
        {"action": "prune_allocations", "keep": []},
    ):
        got = await run_as(scene.people.attacker, control, scene.path, MsgType.CONTROL, body)
        refused(got, ErrorCode.FORBIDDEN, "admins on the node's own socket only")
    await scene.victim_unchanged()


# -- 13-14. Reading another user's details -------------------------------------------------------


async def test_held_13_the_status_shows_no_detail_of_another_users_kernel(scene: Scene) -> None:
    kind, fields = await run_as(
        scene.people.attacker, control, scene.path, MsgType.STATUS_REQUEST, None
    )
    assert kind == MsgType.STATUS
    doc = fields["body"]
    assert doc["identity"]["user"] == scene.people.attacker.name
    (dev,) = doc["devices"]
    assert dev["clients"] == [] and [o["user"] for o in dev["others"]] == [scene.people.victim.name]
    text = json.dumps(doc)
    assert VICTIM_ID not in text and VICTIM_LABEL not in text
    assert f'"pid": {scene.before["pid"]}' not in text
    await scene.victim_unchanged()


async def test_held_14_the_history_shows_no_kernel_of_another_user(scene: Scene) -> None:
    assert VICTIM_ID in scene.node.history_view(None)["kernels"]  # it is recorded
    kind, fields = await run_as(
        scene.people.attacker, control, scene.path, MsgType.CONTROL, {"action": "history"}
    )
    assert kind == MsgType.CONTROL_REPLY
    history = fields["body"]["history"]
    assert history["kernels"] == {}
    assert VICTIM_ID not in json.dumps(history) and VICTIM_LABEL not in json.dumps(history)
    await scene.victim_unchanged()


# -- 15. The socket's mode ----------------------------------------------------------------------


def _connect_errno(path: str) -> int:
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        return exc.errno or -1
    finally:
        sock.close()
    return 0


async def test_held_15_connecting_when_the_sockets_mode_forbids_it(
    make_scheduler: Any, people: People, open_tmp: str
) -> None:
    import errno

    # A node scheduler for one group (socket_mode 0660, socket_group: the victim's group).
    path = os.path.join(open_tmp, "node.sock")
    node = await make_scheduler(
        socket_path=path, socket_mode=0o660, socket_group=str(people.victim.gid)
    )
    assert node.socket_path == path
    assert await run_as(people.attacker, _connect_errno, path) == errno.EACCES
    assert await run_as(people.victim, _connect_errno, path) == 0  # the group may


# -- 16-20. Frames that break the protocol --------------------------------------------------------


async def test_held_16_a_frame_over_the_size_limit(scene: Scene) -> None:
    # The header says 1 MiB: refused from the header, before the scheduler reads (or buffers) it.
    big = HEADER.pack(MAGIC, VERSION, MsgType.HELLO, 0, 1 << 20) + b"\0" * 4096
    answers, closed = await run_as(scene.people.attacker, exchange, scene.path, [big])
    refused(answers[0], ErrorCode.BAD_FRAME, "over the 65536 limit")
    assert closed
    await scene.victim_unchanged()


async def test_held_17_a_malformed_header(scene: Scene) -> None:
    bad_magic = frame(MsgType.HELLO, b"", magic=b"XXXX")
    bad_version = frame(MsgType.HELLO, b"", version=VERSION + 1)
    for raw, code in ((bad_magic, ErrorCode.BAD_FRAME), (bad_version, ErrorCode.BAD_VERSION)):
        answers, closed = await run_as(scene.people.attacker, exchange, scene.path, [raw])
        refused(answers[0], code)
        assert closed
    await scene.victim_unchanged()


async def test_held_18_a_truncated_frame(scene: Scene) -> None:
    # A field that says 200 bytes where 3 follow; then a frame cut short by a closing peer.
    lying_field = (1).to_bytes(2, "little") + (200).to_bytes(2, "little") + b"abc"
    answers, closed = await run_as(
        scene.people.attacker, exchange, scene.path, [frame(MsgType.HELLO, lying_field)]
    )
    refused(answers[0], ErrorCode.BAD_FRAME, "runs past the payload's end")
    assert closed
    cut = hello(client_id="x18")[:-3]
    answers, _ = await run_as(scene.people.attacker, exchange, scene.path, [cut])
    assert answers == []  # nothing to answer: the scheduler waits for the rest, then the close
    assert "x18" not in clients_of(scene.node)
    await scene.victim_unchanged()


async def test_held_19_an_unknown_message_type(scene: Scene) -> None:
    answers, _ = await run_as(scene.people.attacker, exchange, scene.path, [frame(0x7E, b"")])
    refused(answers[0], ErrorCode.UNEXPECTED, "is not accepted")
    await scene.victim_unchanged()


async def test_held_20_shim_messages_out_of_order(scene: Scene) -> None:
    # A REQUEST before any HELLO; then a second HELLO on a shim's connection.
    request = encode(Message(MsgType.REQUEST, {"used_bytes": 1 << 30}))
    answers, _ = await run_as(scene.people.attacker, exchange, scene.path, [request])
    refused(answers[0], ErrorCode.UNEXPECTED, "REQUEST before HELLO")
    twice = [hello(client_id="x20"), hello(client_id=VICTIM_ID)]
    answers, _ = await run_as(scene.people.attacker, exchange, scene.path, twice)
    assert answers[0][0] == MsgType.WELCOME
    refused(answers[1], ErrorCode.UNEXPECTED, "HELLO on a shim connection")
    await scene.victim_unchanged()


# -- 21. A resume claim with another user's secret ------------------------------------------------


async def test_held_21_a_resume_with_another_users_secret(
    make_scheduler: Any, people: People
) -> None:
    first = await make_scheduler(pool_size="4GiB")
    path = node_socket(first)
    # Both hold a grant; each GRANT carries a resume secret bound to its id and uid.
    mine = {**DEVICE, "client_id": "a21"}
    theirs = {**DEVICE, "client_id": VICTIM_ID}
    pid_a, rfd_a = spawn_as(people.attacker, shim, path, mine, 1 << 20, 1.0)
    pid_v, rfd_v = spawn_as(people.victim, shim, path, theirs, 1 << 20, 1.0)
    await until(lambda: {"a21", VICTIM_ID} <= set(clients_of(first)))
    await until(lambda: all(c["state"] == "running" for c in clients_of(first).values()))
    await first.stop()  # with both connected: the next scheduler expects them back
    own_secret = (await until_collected(pid_a, rfd_a))[1][1]["resume_secret"]
    victim_secret = (await until_collected(pid_v, rfd_v))[1][1]["resume_secret"]
    second = await make_scheduler(pool_size="4GiB", socket_path=path)
    node_socket(second)
    claim = {**theirs, "resume": 1, "since_ms": 1000, "used_bytes": 1 << 20}
    # The attacker's own genuine secret, and the victim's (leaked) one: neither proves the claim.
    for secret in (own_secret, victim_secret):
        got = await run_as(people.attacker, shim, path, {**claim, "resume_secret": secret}, 0, 0)
        assert got[0][0] == MsgType.WELCOME and got[0][1]["resume"] == 0, got
        assert "resume_secret" not in got[0][1]
    # The victim's own shim, with its secret, resumes its hold under its id.
    got = await run_as(people.victim, shim, path, {**claim, "resume_secret": victim_secret}, 0, 0)
    assert got[0][0] == MsgType.WELCOME and got[0][1]["resume"] == 1, got
    with contextlib.suppress(Exception):
        await second.stop()
