"""A hostile local user, as real separate uids (docs/reliability.md, "A hostile local user").

Each test creates real accounts (``useradd``; CI runs as root), runs the attacker's and the
victim's code in processes that have dropped to those uids, and checks what the victim's side
(the CLI, the scheduler) does. The scheduler under attack runs in this process as root, as the
node daemon would; what it knows of a peer comes from ``SO_PEERCRED``, which no faking reaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import socket
import stat
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from local_users import clients_of as _clients
from local_users import collect, kill, open_to_everyone, run_as, spawn_as, tmp_dir
from local_users import control as _control
from local_users import shim as _shim
from local_users import until as _until
from test_utilization import UUID as NVML_UUID
from test_utilization import FakeNVMLProcesses

# Imported here, before any fork: a child running as another user may not be able to read the
# source tree (a clone under /root), so it must find every module it uses already loaded.
from jupyter_gpushare import cli
from jupyter_gpushare.protocol import ErrorCode, MsgType, read_message_sync
from jupyter_gpushare.scheduler.shell import server as server_module
from jupyter_gpushare.scheduler.shell.devices import DeviceInfo, Discovery, nvml_pids_comparable
from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler, SchedulerStartError
from jupyter_gpushare.scheduler_client import SchedulerClient, SchedulerError

# -- what the processes of the other users run (module level: the forked child calls them) ----


def _listen_and_record(path: str, record: str) -> None:
    """The attacker: listen on ``path`` and append whatever a victim sends to ``record``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(8)
    while True:
        conn, _ = srv.accept()
        conn.settimeout(2.0)
        with contextlib.suppress(OSError), open(record, "ab") as out:
            out.write(b"<connection>")
            while data := conn.recv(65536):
                out.write(data)
        conn.close()


def _gpushare_cli(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """The victim's ``gpushare ...``: its exit status and what it printed."""
    os.environ.update(env)
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli.main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue()


def _start_scheduler(path: str | None, env: dict[str, str]) -> str:
    """The victim's own scheduler: why it refuses to start ('' if it started)."""
    os.environ.update(env)

    async def attempt() -> str:
        kw: dict[str, Any] = {"use_nvml": False, "recovery_seconds": 0}
        if path:
            kw["socket_path"] = path
        sched = GPUShareScheduler(**kw)
        try:
            await sched.start()
        except SchedulerStartError as exc:
            return str(exc)
        await sched.stop()
        return ""

    return asyncio.run(attempt())


@pytest.fixture
def shared_tmp() -> Iterator[str]:
    """A directory like /tmp (1777: everyone may create in it), short enough for sockets."""
    with tmp_dir(0o1777) as path:
        yield path


def _wait_for(path: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


# -- 1. Posing as the victim's scheduler ------------------------------------------------------


async def test_1_a_socket_directory_made_by_another_user_is_refused(
    local_users: Any, shared_tmp: str
) -> None:
    victim, attacker = local_users("victim"), local_users("attack")
    # XDG_RUNTIME_DIR unset: the victim's socket is $TMP/gpushare-$UID/scheduler.sock, and the
    # attacker makes that directory first and listens there.
    trap = os.path.join(shared_tmp, f"gpushare-{victim.uid}", "scheduler.sock")
    record = os.path.join(shared_tmp, "record")
    pid, rfd = spawn_as(attacker, _listen_and_record, trap, record)
    try:
        _wait_for(trap)
        assert os.stat(os.path.dirname(trap)).st_uid == attacker.uid
        env = {"XDG_RUNTIME_DIR": shared_tmp, "GPUSHARE_USER_TOKEN": "a-secret"}
        code, out = await run_as(victim, _gpushare_cli, ["status"], env)
        assert code == 1, out
        assert "refusing the socket" in out and f"belongs to uid {attacker.uid}" in out, out
        # Nothing reached the attacker: not a connection, let alone the token.
        assert not os.path.exists(record) or os.path.getsize(record) == 0
        # The victim's own scheduler refuses that directory too, and says whose it is.
        why = await run_as(victim, _start_scheduler, None, {"XDG_RUNTIME_DIR": shared_tmp})
        assert f"belongs to uid {attacker.uid}" in why, why
    finally:
        kill(pid)
        os.close(rfd)


# -- 2. A socket in a directory others may write ----------------------------------------------


async def test_2_a_world_writable_socket_directory_is_refused(
    local_users: Any, shared_tmp: str
) -> None:
    victim, attacker = local_users("victim"), local_users("attack")
    open_dir = os.path.join(shared_tmp, "x")
    os.mkdir(open_dir)
    os.chmod(open_dir, 0o777)  # as `mkdir -m 777 /tmp/x` would
    path = os.path.join(open_dir, "sched.sock")
    record = os.path.join(shared_tmp, "record")
    pid, rfd = spawn_as(attacker, _listen_and_record, path, record)
    try:
        _wait_for(path)
        code, out = await run_as(victim, _gpushare_cli, ["status", "--socket", path], {})
        assert code == 1 and "is writable by everyone" in out, out
        assert not os.path.exists(record) or os.path.getsize(record) == 0
        why = await run_as(victim, _start_scheduler, os.path.join(open_dir, "mine.sock"), {})
        assert "writable by everyone" in why, why
    finally:
        kill(pid)
        os.close(rfd)
    # The victim's own directory (0700, theirs) is fine: the check does not refuse everything.
    own = os.path.join(shared_tmp, "own")
    os.mkdir(own, 0o700)
    os.chown(own, victim.uid, victim.gid)
    assert await run_as(victim, _start_scheduler, os.path.join(own, "s.sock"), {}) == ""
    assert stat.S_IMODE(os.stat(own).st_mode) == 0o700


# -- shims and control peers of other users, speaking the protocol from their own uid ---------


DEVICE = {"device_uuid": "GPU-hostile-0", "device_total": 8 << 30}


@pytest.fixture
async def node(make_scheduler: Any) -> Any:
    """The node scheduler, run by root (this process), peers identified by SO_PEERCRED."""
    sched = await make_scheduler(pool_size="4GiB")
    open_to_everyone(sched)
    return sched


# -- 8. One huge label hides every client ------------------------------------------------------


async def test_8_labels_and_ids_are_bounded(local_users: Any, node: Any) -> None:
    victim, attacker = local_users("victim"), local_users("attack")
    path = node.socket_path
    big = {**DEVICE, "client_id": "a-big", "label": "A" * 60000}
    pid_a, rfd_a = spawn_as(attacker, _shim, path, big, 0, 60.0)
    pid_v, rfd_v = spawn_as(victim, _shim, path, {**DEVICE, "client_id": "v1"}, 0, 60.0)
    try:
        await _until(lambda: {"a-big", "v1"} <= set(_clients(node)))
        clients = _clients(node)
        assert len(clients["a-big"]["label"]) <= 512
        # The admin's status, through the socket, lists every client with its label.
        doc = await asyncio.to_thread(_control, path, MsgType.STATUS_REQUEST, None)
        listed = {c["id"]: c for d in doc[1]["body"]["devices"] for c in d["clients"]}
        assert {"a-big", "v1"} <= set(listed) and "labels_truncated" not in doc[1]["body"]
        # An id past 256 characters is refused outright.
        long_id = {**DEVICE, "client_id": "x" * 300}
        got = await run_as(attacker, _shim, path, long_id, 0, 0.0)
        assert got[0][0] == MsgType.ERROR and got[0][1]["error_code"] == ErrorCode.BAD_REQUEST
    finally:
        for pid, rfd in ((pid_a, rfd_a), (pid_v, rfd_v)):
            kill(pid)
            os.close(rfd)


# -- 9. Other users' ids: not shown, not squatted, not acted on -------------------------------


async def test_9_client_ids_are_bound_to_their_user(local_users: Any, node: Any) -> None:
    victim, attacker = local_users("victim"), local_users("attack")
    path = node.socket_path
    kernel = "3f1c0b9e-victim-kernel"
    pid_v, rfd_v = spawn_as(victim, _shim, path, {**DEVICE, "client_id": kernel}, 3 << 30, 60.0)
    try:
        await _until(lambda: _clients(node).get(kernel, {}).get("state") == "running")
        # The attacker waits behind the victim's kernel and reads its own status.
        pid_a, rfd_a = spawn_as(attacker, _shim, path, {**DEVICE, "client_id": "a1"}, 2 << 30, 60.0)
        await _until(lambda: _clients(node).get("a1", {}).get("state") == "waiting")
        _, reply = await run_as(attacker, _control, path, MsgType.STATUS_REQUEST, None)
        text = repr(reply)
        assert "a1" in text and kernel not in text, text  # not in wait.holders, nowhere
        # Acting on it: not found, as for an id that does not exist.
        kind, reply = await run_as(
            attacker, _control, path, MsgType.CONTROL, {"action": "release", "client": kernel}
        )
        assert kind == MsgType.ERROR and reply["error_code"] == ErrorCode.NOT_FOUND
        kill(pid_a)
        os.close(rfd_a)
    finally:
        kill(pid_v)
        os.close(rfd_v)
    # The victim's kernel restarts; the attacker, who learnt the id, connects first under it.
    await _until(lambda: kernel not in _clients(node))
    pid_a, rfd_a = spawn_as(attacker, _shim, path, {**DEVICE, "client_id": kernel}, 0, 60.0)
    pid_v = rfd_v = -1
    try:
        await _until(lambda: any(c.startswith(kernel + "#") for c in _clients(node)))
        assert kernel not in _clients(node)  # the id stays the victim's
        pid_v, rfd_v = spawn_as(victim, _shim, path, {**DEVICE, "client_id": kernel}, 0, 60.0)
        await _until(lambda: kernel in _clients(node))
        assert _clients(node)[kernel]["user"] == victim.name
        kind, reply = await run_as(
            victim, _control, path, MsgType.CONTROL, {"action": "release", "client": kernel}
        )
        assert kind == MsgType.CONTROL_REPLY and reply["body"]["ok"] is True
    finally:
        for pid, rfd in ((pid_a, rfd_a), (pid_v, rfd_v)):
            if pid > 0:
                kill(pid)
                os.close(rfd)


# -- 10. Terminal and log injection ------------------------------------------------------------


async def test_10_ids_and_labels_cannot_reach_a_terminal_or_forge_log_lines(
    local_users: Any, node: Any, caplog: pytest.LogCaptureFixture
) -> None:
    attacker = local_users("attack")
    path = node.socket_path
    evil = "\x1b]0;owned\x07\x1b[2J\nERROR gpushare: forged line\u202e"
    bad_id = {**DEVICE, "client_id": "k\x1b[31m\nforged"}
    got = await run_as(attacker, _shim, path, bad_id, 0, 0.0)
    assert got[0][0] == MsgType.ERROR and got[0][1]["error_code"] == ErrorCode.BAD_REQUEST
    pid, rfd = spawn_as(
        attacker, _shim, path, {**DEVICE, "client_id": "k2", "label": evil}, 0, 60.0
    )
    try:
        await _until(lambda: "k2" in _clients(node))
        shown = cli.format_status(node.status_document())
        assert "k2" in shown and "\\x1b]0;owned" in shown
        assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
        assert not any(line.startswith("ERROR gpushare: forged") for line in shown.splitlines())
        for record in caplog.records:
            message = record.getMessage()
            assert "\x1b" not in message and "\nERROR" not in message, message
    finally:
        kill(pid)
        os.close(rfd)


# -- 11. Configuration edge cases --------------------------------------------------------------


async def test_11_users_config_edge_cases_are_refused_and_answered(
    local_users: Any, make_scheduler: Any, tmp_path: Any
) -> None:
    attacker = local_users("attack")
    users = tmp_path / "users.toml"
    users.write_text('[defaults]\nquota = "1GiB"\n')
    node = await make_scheduler(users_config=str(users), pool_size="4GiB")
    open_to_everyone(node)
    admin = SchedulerClient(node.socket_path, timeout=5)
    assert node.users.limits("anyone", frozenset()).quota == 1 << 30

    async def reload_refused(match: str) -> None:
        with pytest.raises(SchedulerError) as info:
            await admin.control("reload")
        assert info.value.message.startswith("reload failed")
        assert node.users.limits("anyone", frozenset()).quota == 1 << 30  # the old one stays
        assert match in node._access_error

    # Not UTF-8: refused with the file's error (no traceback), the admin's reload is answered.
    users.write_bytes(b'[defaults]\nquota = "\xff\xfe"\n')
    await reload_refused("not UTF-8")
    # Empty (an editor's half-written file): refused, the ceilings stay.
    users.write_text("")
    await reload_refused("is empty")
    # A FIFO: refused at once, not a worker blocked until someone writes to it.
    users.unlink()
    os.mkfifo(users)
    started = time.monotonic()
    await reload_refused("not a regular file")
    assert time.monotonic() - started < 2.0
    # A reload with no change in between still works (the scheduler is not wedged).
    users.unlink()
    users.write_text('[defaults]\nquota = "2GiB"\n')
    assert (await admin.control("reload"))["ok"] is True
    assert node.users.limits("anyone", frozenset()).quota == 2 << 30
    # A deeply nested JSON body from another user: bad_frame, not an internal error.
    deep = "[" * 30000 + "]" * 30000

    def send_deep(path: str) -> tuple[int, dict[str, Any]]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10.0)
        sock.connect(path)
        payload = deep.encode()
        field = (22).to_bytes(2, "little") + len(payload).to_bytes(2, "little") + payload
        header = b"GPSH" + bytes([1, MsgType.CONTROL]) + b"\0\0" + len(field).to_bytes(4, "little")
        sock.sendall(header + field)
        reply = read_message_sync(sock)
        sock.close()
        assert reply is not None
        return int(reply.type), dict(reply.fields)

    kind, fields = await run_as(attacker, send_deep, node.socket_path)
    assert kind == MsgType.ERROR and fields["error_code"] == ErrorCode.BAD_FRAME, fields
    assert (await admin.status())["devices"] == []  # and the scheduler still answers


# -- 3. Stealing a grant at a restart ---------------------------------------------------------


async def test_3_a_resume_claim_must_prove_itself(local_users: Any, make_scheduler: Any) -> None:
    victim, attacker = local_users("victim"), local_users("attack")
    first = await make_scheduler(pool_size="4GiB")
    path = first.socket_path
    os.chmod(os.path.dirname(path), 0o755)
    os.chmod(path, 0o666)
    kernel = "k-victim"
    pid_v, rfd_v = spawn_as(victim, _shim, path, {**DEVICE, "client_id": kernel}, 1 << 20, 4.0)
    await _until(lambda: _clients(first).get(kernel, {}).get("state") == "running")
    await first.stop()  # with the victim connected: the next scheduler expects it back
    got = await asyncio.get_running_loop().run_in_executor(None, collect, pid_v, rfd_v, 30)
    grant = got[1][1]
    assert got[1][0] == MsgType.GRANT and len(grant["resume_secret"]) == 32
    second = await make_scheduler(pool_size="4GiB", socket_path=path)
    os.chmod(path, 0o666)
    claim = {**DEVICE, "resume": 1, "since_ms": 1000, "used_bytes": 1 << 20}
    # The attacker reconnects first and claims to hold the device: without the secret, or with
    # a made-up one, or with the victim's id, the claim is not believed.
    for fields in (
        {"client_id": "a1"},
        {"client_id": "a1", "resume_secret": "0" * 32},
        {"client_id": kernel, "resume_secret": "f" * 32},
    ):
        answer = await run_as(attacker, _shim, path, {**claim, **fields}, 0, 0.0)
        assert answer[0][0] == MsgType.WELCOME and answer[0][1]["resume"] == 0, (fields, answer)
    # The victim's shim, with the secret its GRANT carried, resumes its hold.
    proof = {**claim, "client_id": kernel, "resume_secret": grant["resume_secret"]}
    pid_v, rfd_v = spawn_as(victim, _shim, path, proof, 0, 2.0)
    # It gets its own id back, although the attacker used it since this scheduler started.
    await _until(lambda: _clients(second).get(kernel, {}).get("user") == victim.name)
    answer = await asyncio.get_running_loop().run_in_executor(None, collect, pid_v, rfd_v, 30)
    assert answer[0][0] == MsgType.WELCOME and answer[0][1]["resume"] == 1, answer
    assert answer[0][1]["resume_secret"] == grant["resume_secret"]
    await second.stop()


# -- 5. Connection exhaustion ------------------------------------------------------------------


def _half_frames(path: str, n: int, hold: float) -> tuple[int, int]:
    """Open ``n`` connections that each send half a frame; (refused at once, closed later)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(b"GPSH\x01")
        socks.append(s)

    def answered(s: socket.socket) -> bool:  # without waiting: an ERROR or a close is there
        s.setblocking(False)
        try:
            return s.recv(65536) is not None
        except BlockingIOError:
            return False
        except OSError:
            return True

    time.sleep(0.5)
    refused = [s for s in socks if answered(s)]
    time.sleep(hold)
    waiting = [s for s in socks if s not in refused]
    closed = sum(1 for s in waiting if answered(s))
    for s in socks:
        s.close()
    return len(refused), closed


async def test_5_connection_exhaustion_is_bounded_per_uid(
    local_users: Any, make_scheduler: Any, caplog: pytest.LogCaptureFixture
) -> None:
    victim, attacker = local_users("victim"), local_users("attack")
    node = await make_scheduler(max_connections_per_uid=20, handshake_seconds=1.0)
    open_to_everyone(node)
    path = node.socket_path
    pid, rfd = spawn_as(attacker, _half_frames, path, 60, 2.0)
    await _until(lambda: len(node._connections) >= 20)
    # While the attacker holds all it may, the victim's status answers at once.
    started = time.monotonic()
    kind, _ = await run_as(victim, _control, path, MsgType.STATUS_REQUEST, None)
    assert kind == MsgType.STATUS and time.monotonic() - started < 3.0
    refused, closed = await asyncio.get_running_loop().run_in_executor(None, collect, pid, rfd, 30)
    assert refused == 40  # past its 20 connections, each further one is refused
    assert closed == 20  # and the 20 half-sent frames are closed after handshake_seconds
    assert len(node._connections) == 0
    # The log is bounded per uid: the refusals and closings an operator reads, 20, then one line
    # saying the rest is counted (each connection's own line is DEBUG, shown only when a test
    # before this one left the logger at DEBUG; past the budget lines are DEBUG too).
    about_attacker = [
        r
        for r in caplog.records
        if r.levelno >= logging.INFO and f"uid {attacker.uid}" in r.getMessage()
    ]
    assert 21 <= len(about_attacker) <= 22, len(about_attacker)


# -- 6. Unbounded device registrations ---------------------------------------------------------


def _many_devices(path: str, n: int) -> list[int]:
    """HELLO from ``n`` made-up devices, one connection each; the answers' types."""
    out = []
    for i in range(n):
        fields = {"client_id": f"d{i}", "device_uuid": f"GPU-fake-{i:04d}", "device_total": 1 << 40}
        out.append(_shim(path, fields, 0, 0.0)[0][0])
    return out


async def test_6_devices_learnt_from_hellos_are_bounded(
    local_users: Any, make_scheduler: Any
) -> None:
    victim, attacker = local_users("victim"), local_users("attack")
    node = await make_scheduler()  # no NVML: devices are learnt from the shims
    open_to_everyone(node)
    answers = await run_as(attacker, _many_devices, node.socket_path, 30)
    limit = node.MAX_LEARNT_DEVICES_PER_UID
    assert answers[:limit] == [MsgType.WELCOME] * limit
    assert set(answers[limit:]) == {MsgType.ERROR}
    # The victim's own GPU is still learnt and shown.
    mine = {**DEVICE, "client_id": "v1"}
    assert (await run_as(victim, _shim, node.socket_path, mine, 0, 0.0))[0][0] == MsgType.WELCOME
    uuids = {d["uuid"] for d in node.status_document()["devices"]}
    assert DEVICE["device_uuid"] in uuids and len(uuids) == limit + 1


async def test_6_with_nvml_a_hello_cannot_add_or_size_a_device(
    local_users: Any, make_scheduler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = DeviceInfo(0, "GPU-real-0", "Real GPU", 16 << 30)

    async def discover() -> Discovery:
        return Discovery([real])

    monkeypatch.setattr(server_module, "discover_devices_async", discover)
    attacker = local_users("attack")
    node = await make_scheduler(use_nvml=True, utilization_interval=0, pool_size="")
    open_to_everyone(node)
    fake = {"client_id": "a1", "device_uuid": "GPU-fake-0", "device_total": 1 << 50}
    got = await run_as(attacker, _shim, node.socket_path, fake, 0, 0.0)
    assert got[0][0] == MsgType.ERROR and got[0][1]["error_code"] == ErrorCode.NOT_FOUND
    lie = {"client_id": "a2", "device_uuid": real.uuid, "device_total": 1 << 50, "device_name": "x"}
    got = await run_as(attacker, _shim, node.socket_path, lie, 0, 0.0)
    assert got[0][0] == MsgType.WELCOME
    (dev,) = node.status_document()["devices"]
    assert dev["uuid"] == real.uuid and dev["total_bytes"] == real.total_bytes
    assert dev["name"] == "Real GPU"


# -- 4. A holder that never answers REVOKE -----------------------------------------------------


async def test_4_a_holder_that_ignores_revoke_is_dealt_with_after_its_deadline(
    local_users: Any, make_scheduler: Any
) -> None:
    victim, attacker = local_users("victim"), local_users("attack")
    node = await make_scheduler(
        pool_size="4GiB",
        base_quantum=0.3,
        max_quantum=0.3,
        revoke_deadline_seconds=1.0,
        revoke_signal="SIGKILL",
        revoke_signal_grace=0.5,
    )
    open_to_everyone(node)
    path = node.socket_path
    # The attacker holds 1 GiB and never reads its socket again: no RELEASED ever comes.
    pid_a, rfd_a = spawn_as(attacker, _shim, path, {**DEVICE, "client_id": "hog"}, 1 << 30, 60.0)
    await _until(lambda: _clients(node).get("hog", {}).get("state") == "running")
    # Root's release says what it did; the victim needs more than fits beside the hog.
    admin = SchedulerClient(path, timeout=5)
    reply = await admin.release("hog")
    assert reply["done"] is True and reply["effect"].startswith("revoke sent")
    reply = await admin.release("hog")
    assert reply["done"] is False and "not answered" in reply["effect"]
    pid_v, rfd_v = spawn_as(victim, _shim, path, {**DEVICE, "client_id": "v"}, 7 << 29, 10.0)
    try:
        started = time.monotonic()
        # Past the deadline (1 s) and the grace (0.5 s) the hog is killed and the victim runs.
        await _until(lambda: _clients(node).get("v", {}).get("state") == "running", 10.0)
        assert 1.4 <= time.monotonic() - started < 8.0
        _, status = await asyncio.get_running_loop().run_in_executor(None, os.waitpid, pid_a, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
    finally:
        os.close(rfd_a)
        kill(pid_v)
        os.close(rfd_v)


# -- 7. Lying about memory ---------------------------------------------------------------------


async def test_7_a_memory_claim_is_bounded_by_the_quota_and_the_device(
    local_users: Any, make_scheduler: Any, tmp_path: Any
) -> None:
    victim, attacker = local_users("victim"), local_users("attack")
    users = tmp_path / "users.toml"
    users.write_text(f'[users.{attacker.name}]\nquota = "1GiB"\n')
    node = await make_scheduler(pool_size="4GiB", users_config=str(users))
    open_to_everyone(node)
    path = node.socket_path
    # pinned = 2**60: "nothing of mine can move, nobody fits beside me".
    lie = {**DEVICE, "client_id": "liar", "request_fields": {"pinned_bytes": 1 << 60}}
    pid_a, rfd_a = spawn_as(attacker, _shim, path, lie, (1 << 64) - 1, 30.0)
    pid_v, rfd_v = -1, -1
    try:
        await _until(lambda: _clients(node).get("liar", {}).get("state") == "running")
        liar = _clients(node)["liar"]
        assert liar["used_bytes"] == 1 << 30  # its user's ceiling, not 16 EiB
        # The victim's 2 GiB kernel fits beside the bounded claim and runs at once.
        pid_v, rfd_v = spawn_as(victim, _shim, path, {**DEVICE, "client_id": "v"}, 2 << 30, 30.0)
        await _until(lambda: _clients(node).get("v", {}).get("state") == "running")
        assert _clients(node)["liar"]["state"] == "running"
    finally:
        for pid, rfd in ((pid_a, rfd_a), (pid_v, rfd_v)):
            if pid > 0:
                kill(pid)
                os.close(rfd)


async def test_7_an_under_claim_is_cross_checked_with_nvml(
    local_users: Any,
    make_scheduler: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if not nvml_pids_comparable():
        pytest.skip("the tests run in a pid namespace of their own: NVML's pids are not theirs")
    nvml = FakeNVMLProcesses()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # the bindings the scheduler imports
    victim, attacker = local_users("victim"), local_users("attack")
    node = await make_scheduler(use_nvml=True, utilization_interval=0.05, pool_size="4GiB")
    open_to_everyone(node)
    path, gpu = node.socket_path, {"device_uuid": NVML_UUID}
    # used = 0: "run anyone beside me"; NVML sees its process hold 3 GiB on the GPU.
    lie = {**gpu, "client_id": "liar", "request_fields": {"used_bytes": 0}}
    pid_a, rfd_a = spawn_as(attacker, _shim, path, lie, 1, 30.0)
    nvml.processes[pid_a] = 3 << 30
    pid_v, rfd_v = -1, -1
    try:
        await _until(lambda: _clients(node).get("liar", {}).get("used_bytes") == 3 << 30)
        assert _clients(node)["liar"]["state"] == "running"
        # The victim's 2 GiB does not fit beside 3 GiB in the 4 GiB pool: it waits its turn.
        pid_v, rfd_v = spawn_as(victim, _shim, path, {**gpu, "client_id": "v"}, 2 << 30, 30.0)
        await _until(lambda: _clients(node).get("v", {}).get("state") == "waiting")
        for _ in range(20):  # a second of samples: never co-run beyond the pool
            running = [c for c in _clients(node).values() if c["state"] == "running"]
            assert sum(c["used_bytes"] for c in running) <= 4 << 30, running
            await asyncio.sleep(0.05)
        corrected = [r for r in caplog.records if "claim corrected" in r.getMessage()]
        assert len(corrected) == 1 and corrected[0].levelname == "WARNING", corrected
        corrected = [r.getMessage() for r in corrected]
        assert "client=liar" in corrected[0], corrected
        assert f"uid={attacker.uid}" in corrected[0] and f"nvml={3 << 30}" in corrected[0]
    finally:
        for pid, rfd in ((pid_a, rfd_a), (pid_v, rfd_v)):
            if pid > 0:
                kill(pid)
                os.close(rfd)
