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
import os
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from local_users import kill, run_as, spawn_as

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
    from jupyter_gpushare.cli import main

    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue()


def _start_scheduler(path: str | None, env: dict[str, str]) -> str:
    """The victim's own scheduler: why it refuses to start ('' if it started)."""
    os.environ.update(env)
    from jupyter_gpushare.scheduler.server import GPUShareScheduler, SchedulerStartError

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
    path = tempfile.mkdtemp(prefix="gsh-", dir="/tmp")
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


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
