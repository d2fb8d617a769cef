"""README.md's first command, verbatim, on a clean copy of the tree, as root and as a new user:
it sets everything up (a venv, the package with its shim and sidebar built from source) and starts
JupyterLab with the embedded scheduler, which must answer over HTTP at the URL with its token that
it prints (no display here, so no browser). Slow (two full installs): one test does both.

Needs root (to create the user, as CI runs) and the package indexes (PyPI, npm)."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.packaging.test_readme_commands import _readme_commands
from tests.reliability.local_users import add_user, remove_user

ROOT = Path(__file__).resolve().parents[2]
#: One install and start: measured 9 min as root, 11 min as the new user (empty pip and npm
#: caches) on a loaded 2-core machine, the whole test 22 min; about 2.3x that for each.
BOUND_S = 1500
URL = re.compile(r"(http://127\.0\.0\.1:\d+)/lab\?token=([0-9a-f]+)")


def _index_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
    except OSError:
        return False
    return True


def _clean_copy(dest: Path) -> None:
    """The tree as a clone has it: tracked and new files, no build outputs, no venv."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.fixture
def new_user() -> Iterator[pwd.struct_passwd]:
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("needs root, useradd and runuser to run it as a new user (CI runs as root)")
    name = f"gsreadme{secrets.token_hex(3)}"
    add_user(name, "--create-home", "--shell", "/bin/bash")
    try:
        yield pwd.getpwnam(name)
    finally:
        remove_user(name, "--remove")


def _reach_the_lab(command: str, cwd: Path, user: pwd.struct_passwd | None, log: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "VIRTUAL_ENV"))}
    for var in ("DISPLAY", "WAYLAND_DISPLAY", "PYTHONPATH", "GPUSHARE_SOCKET"):
        env.pop(var, None)
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    argv = ["bash", "-c", command]
    if user is not None:
        env |= {"HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name}
        argv = [shutil.which("runuser") or "runuser", "-u", user.pw_name, "--", *argv]
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # A test started from a background job inherits SIGINT ignored: restore it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + BOUND_S
        found = None
        while found is None:
            assert proc.poll() is None, (
                f"it ended (rc {proc.returncode}):\n{log.read_text()[-4000:]}"
            )
            assert time.monotonic() < deadline, (
                f"no lab URL in {BOUND_S} s:\n{log.read_text()[-4000:]}"
            )
            time.sleep(2)
            found = URL.search(log.read_text())
        base, token = found.groups()
        text = log.read_text()
        if os.geteuid() == 0 and user is None:
            assert "Running as root is not recommended" not in text
        assert "open the URL with its token" in text
        headers = {"Authorization": f"token {token}"}
        for path in ("/api/status", "/gpushare/api/status"):
            req = urllib.request.Request(base + path, headers=headers)
            with urllib.request.urlopen(req, timeout=30) as reply:
                assert reply.status == 200, path
                json.loads(reply.read())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(2 * BOUND_S + 120)
def test_the_readmes_first_command_as_root_and_as_a_user(
    tmp_path: Path, new_user: pwd.struct_passwd
) -> None:
    if not _index_reachable():
        pytest.skip("the package index (pypi.org) is out of reach: the install needs it")
    lab, _tests = _readme_commands()
    as_root = tmp_path / "root-clone"
    _clean_copy(as_root)
    _reach_the_lab(lab, as_root, None, tmp_path / "root.log")

    home = Path(new_user.pw_dir)
    clone = home / "jupyter-gpushare"
    _clean_copy(clone)
    subprocess.run(["chown", "-R", f"{new_user.pw_uid}:{new_user.pw_gid}", str(clone)], check=True)
    _reach_the_lab(lab, clone, new_user, tmp_path / "user.log")
