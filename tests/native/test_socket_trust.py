"""Issue 15, the shim side: the HELLO (command line, user, user token) goes only to a socket that
this user or root controls. A socket in a directory others may write to, or a socket that belongs
to another user, is refused loudly (a gpushare: line whatever GPUSHARE_LOG says) and the process
runs unshared (docs/protocol.md, "Trusting the socket")."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest


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


@pytest.fixture
def other_user():
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("creating a user needs root and useradd")
    name = f"gs{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--system", name], check=True)
    try:
        import pwd

        yield pwd.getpwnam(name).pw_uid
    finally:
        subprocess.run(["userdel", name], check=False)


def test_a_socket_of_another_user_is_refused(harness, other_user):
    harness.scheduler()
    os.chown(harness.socket_path, other_user, -1)
    run = harness.run("status").ok()
    assert any("belongs to another user" in line for line in run.shim_lines), run.describe()
    assert run.event("status")["status"]["connected"] == 0


def test_a_socket_of_this_user_in_a_private_directory_is_used(harness):
    harness.scheduler()
    run = harness.run("status").ok()
    assert run.event("status")["status"]["connected"] == 1, run.describe()
    assert not [line for line in run.shim_lines if "refusing" in line]
