"""Real local users for the hostile-user tests (docs/reliability.md, "A hostile local user").

``local_users(role)`` creates a real account with ``useradd`` (CI runs as root) and removes it
after the test module; :func:`run_as` runs a function in a forked child that has dropped to that
account's uid and gid (``setgroups``/``setgid``/``setuid``), so the scheduler sees it through
``SO_PEERCRED`` and the file system through its real permissions. Forking, not exec-ing: the test
interpreter may live where other users cannot read it (a pyenv under /root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import pwd
import secrets
import select
import shutil
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class LocalUser:
    name: str
    uid: int
    gid: int


@pytest.fixture(scope="module")
def local_users() -> Iterator[Callable[[str], LocalUser]]:
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create real users (CI runs as root)")
    made: list[str] = []

    def make(role: str) -> LocalUser:
        name = f"gs{role[:6]}{secrets.token_hex(3)}"
        subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )
        made.append(name)
        entry = pwd.getpwnam(name)
        return LocalUser(name, entry.pw_uid, entry.pw_gid)

    try:
        yield make
    finally:
        for name in made:
            subprocess.run(["userdel", name], check=False, capture_output=True)


def _become(user: LocalUser) -> None:
    os.setgroups([])
    os.setgid(user.gid)
    os.setuid(user.uid)
    os.environ.pop("XDG_RUNTIME_DIR", None)
    os.environ.pop("GPUSHARE_SOCKET", None)
    os.environ["HOME"] = "/nonexistent"
    os.environ["USER"] = user.name


def spawn_as(user: LocalUser, fn: Callable[..., Any], *args: Any) -> tuple[int, int]:
    """Fork a child that becomes ``user`` and runs ``fn(*args)``; returns (pid, result fd).

    The child writes the pickled ``(ok, value)`` to the pipe and exits; it never returns here.
    """
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(rfd)
        code = 0
        try:
            _become(user)
            out: tuple[bool, Any] = (True, fn(*args))
        except BaseException as exc:
            out = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            code = 1
        try:
            data = pickle.dumps(out)
        except Exception as exc:
            data = pickle.dumps((False, f"unpicklable result: {exc}"))
        with contextlib.suppress(OSError):
            os.write(wfd, data)
        os._exit(code)
    os.close(wfd)
    return pid, rfd


def collect(pid: int, rfd: int, timeout: float) -> Any:
    """The result of a child from :func:`spawn_as`; kills it after ``timeout`` seconds."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the child {pid} did not finish in {timeout} s")
            ready, _, _ = select.select([rfd], [], [], left)
            if not ready:
                continue
            chunk = os.read(rfd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(rfd)
        with contextlib.suppress(ProcessLookupError):
            if not chunks:
                os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if not chunks:
        raise RuntimeError(f"the child {pid} died without an answer")
    ok, value = pickle.loads(b"".join(chunks))
    if not ok:
        raise AssertionError(f"in the child running as another user: {value}")
    return value


async def run_as(user: LocalUser, fn: Callable[..., Any], *args: Any, timeout: float = 30) -> Any:
    """``fn(*args)`` in a child process running as ``user``; its return value (picklable).

    Waits off the event loop, so a scheduler running in this process keeps serving the child.
    """
    pid, rfd = spawn_as(user, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(None, collect, pid, rfd, timeout)


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
