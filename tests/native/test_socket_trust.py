"""Issue 15, the shim side: the HELLO (command line, user, user token) goes only to a socket that
this user or root controls. A socket in a directory others may write to, or a socket that belongs
to another user, is refused loudly (a gpushare: line whatever GPUSHARE_LOG says) and the process
runs unshared (docs/protocol.md, "Trusting the socket")."""

from __future__ import annotations

import os
import pwd
import shutil
import uuid

import pytest

from tests.reliability.local_users import add_user, remove_user


def test_a_directory_others_can_write_is_refused(harness):
    harness.scheduler()
    os.chmod(harness.sock_dir, 0o777)
    try:
        run = harness.run("status", log="quiet").ok()
    finally:
        os.chmod(harness.sock_dir, 0o700)
    assert any("writable by everyone" in line for line in run.shim_lines), run.describe()
    assert any("running unshared" in line for line in run.shim_lines)
    assert run.event("status")["status"]["connected"] == 0


@pytest.mark.parametrize("log", ["quiet", None])
def test_one_refusal_is_said_once(harness, log):
    """One line for one refusal (issue 23: the shim said "refusing the socket: ..." twice, once
    as the refusal and again inside "scheduler not reachable at ... (...)")."""
    harness.scheduler()
    os.chmod(harness.sock_dir, 0o777)
    try:
        run = harness.run("status", log=log).ok() if log else harness.run("status").ok()
    finally:
        os.chmod(harness.sock_dir, 0o700)
    said = [line for line in run.shim_lines if "refusing the socket" in line]
    assert len(said) == 1, run.describe()
    assert "running unshared" in said[0], said


@pytest.fixture
def other_user():
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("creating a user needs root and useradd")
    name = f"gs{uuid.uuid4().hex[:8]}"
    add_user(name, "--no-create-home", "--system")
    try:
        yield pwd.getpwnam(name).pw_uid
    finally:
        remove_user(name)


def test_a_socket_of_another_user_is_refused(harness, other_user):
    harness.scheduler()
    os.chown(harness.socket_path, other_user, -1)
    run = harness.run("status").ok()
    assert any(f"belongs to uid {other_user}" in line for line in run.shim_lines), run.describe()
    assert run.event("status")["status"]["connected"] == 0


def test_a_service_accounts_directory_and_socket_are_used_only_when_named(harness, other_user):
    """A node scheduler runs as its own account (deploy/systemd: User=gpushare, so systemd makes
    /run/gpushare that account's). A directory and a socket that both belong to another account
    are trusted only when the operator names that account (GPUSHARE_SERVICE_USER, a name or a
    uid; issue 22, item 2): never inferred from ownership, which any user can arrange."""
    import pwd

    harness.scheduler()
    os.chown(harness.sock_dir, other_user, -1)
    os.chmod(harness.sock_dir, 0o755)
    os.chown(harness.socket_path, other_user, -1)
    run = harness.run("status").ok()
    assert any(f"belongs to uid {other_user}" in line for line in run.shim_lines), run.describe()
    assert run.event("status")["status"]["connected"] == 0
    for named in (pwd.getpwuid(other_user).pw_name, str(other_user)):
        run = harness.run("status", service_user=named).ok()
        assert run.event("status")["status"]["connected"] == 1, run.describe()
    # Named, the account's directory still holds no socket of yet another user.
    os.chown(harness.socket_path, os.getuid() + 1 if os.getuid() else 1, -1)
    run = harness.run("status", service_user=str(other_user)).ok()
    assert any("refusing" in line for line in run.shim_lines), run.describe()
    assert run.event("status")["status"]["connected"] == 0


def test_a_directory_its_group_can_write_is_refused(harness):
    """Issue 24: 0770 is refused like 0777 (a member of the group could swap the socket)."""
    harness.scheduler()
    os.chmod(harness.sock_dir, 0o770)
    try:
        run = harness.run("status", log="quiet").ok()
    finally:
        os.chmod(harness.sock_dir, 0o700)
    assert any("writable by its group" in line for line in run.shim_lines), run.describe()
    assert run.event("status")["status"]["connected"] == 0


def test_this_users_own_directory_made_by_another_user_is_refused(harness, other_user, tmp_path):
    """Attack 1 of issue 15: with XDG_RUNTIME_DIR unset the socket is /tmp/gpushare-$UID; another
    user who makes that directory first (and a socket in it) is refused, though the pair would
    pass as a service account's anywhere else."""
    import socket as socketlib

    own = tmp_path / f"gpushare-{os.getuid()}"
    own.mkdir(mode=0o755)
    path = own / "scheduler.sock"
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    try:
        os.chown(own, other_user, -1)
        os.chown(path, other_user, -1)
        os.chmod(tmp_path, 0o755)
        run = harness.run("status", extra={"GPUSHARE_SOCKET": str(path)}).ok()
        assert any(
            f"another user (uid {other_user}) made this user's socket directory" in line
            for line in run.shim_lines
        ), run.describe()
        assert run.event("status")["status"]["connected"] == 0
    finally:
        listener.close()


def test_a_socket_of_this_user_in_a_private_directory_is_used(harness):
    harness.scheduler()
    run = harness.run("status").ok()
    assert run.event("status")["status"]["connected"] == 1, run.describe()
    assert not [line for line in run.shim_lines if "refusing" in line]


def test_the_shim_and_the_client_read_the_same_service_account_variable():
    """One name for the operator to set (docs/protocol.md): the shim's getenv and paths.py's."""
    from pathlib import Path

    from jupyter_gpushare.paths import ENV_SERVICE_USER

    native = Path(__file__).parents[2] / "native"
    source = (native / "src" / "client" / "socket_trust.c").read_text()
    assert f'getenv("{ENV_SERVICE_USER}")' in source
