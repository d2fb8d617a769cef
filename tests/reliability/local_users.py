"""Real local users for the hostile-user tests (docs/reliability.md, "A hostile local user"),
and what their processes run: shims and control peers speaking the protocol from their own uid.

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
import socket
import subprocess
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync


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
        add_user(name)
        made.append(name)
        entry = pwd.getpwnam(name)
        return LocalUser(name, entry.pw_uid, entry.pw_gid)

    try:
        yield make
    finally:
        for name in made:
            remove_user(name)


def _kill_processes_of(uid: int) -> None:
    """SIGKILL every process whose real uid is ``uid`` (a child a test left waiting for a stop
    that never came kept its user from being removed: userdel refuses a user with processes)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                uids = next(line for line in status if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if int(uids[0]) == uid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)


def add_user(name: str, *options: str) -> None:
    """``useradd`` a test user (no home and no login shell unless ``options`` say otherwise),
    waiting for /etc/passwd's lock when another process (a parallel test run) holds it."""
    options = options or ("--no-create-home", "--shell", "/usr/sbin/nologin")
    for attempt in range(60):
        made_it = subprocess.run(["useradd", *options, name], capture_output=True, text=True)
        if made_it.returncode == 0 or "cannot lock" not in made_it.stderr or attempt == 59:
            break
        time.sleep(1.0)
    made_it.check_returncode()


def remove_user(name: str, *options: str) -> None:
    """Remove a user a test made (``options``: e.g. ``--remove`` for its home), after stopping
    whatever of its processes is left; a user that cannot be removed is reported."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for _ in range(40):  # another process may hold /etc/passwd's lock; the kills take a moment
        _kill_processes_of(uid)
        done = subprocess.run(["userdel", *options, name], capture_output=True, text=True)
        if done.returncode == 0:
            return
        time.sleep(0.25)
    warnings.warn(f"could not remove the test user {name}: {done.stderr.strip()}", stacklevel=1)


@contextlib.contextmanager
def tmp_dir(mode: int) -> Iterator[str]:
    """A fresh directory under /tmp with ``mode`` (short enough for sockets), removed after."""
    path = tempfile.mkdtemp(prefix="gsh-", dir="/tmp")
    os.chmod(path, mode)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


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


# -- what the other users' processes run (module level, loaded before the fork) ----------------

Answer = tuple[int, dict[str, Any]]  # a message's type and fields, as a child returns them


def _answer(msg: Message | None) -> Answer | None:
    return None if msg is None else (int(msg.type), dict(msg.fields))


def _connect(path: str, timeout: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(path)
    return sock


def shim(path: str, fields: dict[str, Any], request: int, hold: float) -> list[Any]:
    """A shim: HELLO (and a REQUEST of ``request`` bytes when not 0), then keep the connection
    ``hold`` seconds; the answers."""
    sock = _connect(path)
    fields = dict(fields)
    claims = fields.pop("request_fields", {})  # more of the REQUEST's memory claim
    sock.sendall(encode(Message(MsgType.HELLO, {"pid": os.getpid(), **fields})))
    got = [read_message_sync(sock)]
    if request and got[0] is not None and got[0].type == MsgType.WELCOME:
        sock.sendall(encode(Message(MsgType.REQUEST, {"used_bytes": request, **claims})))
        sock.settimeout(max(hold, 0.1))
        with contextlib.suppress(TimeoutError, OSError):
            got.append(read_message_sync(sock))
    time.sleep(hold)
    sock.close()
    return [_answer(m) for m in got]


def recording_shim(path: str, fields: dict[str, Any], request: int, stop: str) -> list[Any]:
    """A shim that asks for ``request`` bytes and records every message it gets until the file
    ``stop`` exists (the victim: whatever another user does must not reach it)."""
    sock = _connect(path)
    sock.sendall(encode(Message(MsgType.HELLO, {"pid": os.getpid(), **fields})))
    got = [read_message_sync(sock)]
    sock.sendall(encode(Message(MsgType.REQUEST, {"used_bytes": request})))
    sock.settimeout(0.05)
    while not os.path.exists(stop):
        with contextlib.suppress(TimeoutError):
            got.append(read_message_sync(sock))
            if got[-1] is None:
                break
    sock.close()
    return [_answer(m) for m in got]


def control(
    path: str,
    mtype: int,
    body: dict[str, Any] | None,
    extra: dict[str, Any] | None = None,
    timeout: float = 10.0,
) -> Answer:
    """A control peer's one request (``extra``: more fields, e.g. user and token); the answer,
    waited for ``timeout`` seconds (an evict that checkpoints its holder answers after it)."""
    sock = _connect(path, timeout)
    fields = {**({} if body is None else {"body": body}), **(extra or {})}
    sock.sendall(encode(Message(MsgType(mtype), fields)))
    reply = read_message_sync(sock)
    sock.close()
    assert reply is not None
    return int(reply.type), dict(reply.fields)


def exchange(path: str, frames: list[bytes]) -> tuple[list[Answer | None], bool]:
    """Send each frame (raw bytes, well formed or not) and read what comes back within 1 s
    after each; the answers and whether the scheduler closed the connection (within 0.3 s
    of the last)."""
    sock = _connect(path)
    answers: list[Answer | None] = []
    closed = False
    for frame in frames:
        sock.sendall(frame)
        sock.settimeout(1.0)
        try:
            msg = read_message_sync(sock)
        except TimeoutError:
            continue
        except OSError:
            closed = True
            break
        if msg is None:
            closed = True
            break
        answers.append(_answer(msg))
    if not closed:
        sock.settimeout(0.3)
        with contextlib.suppress(TimeoutError):
            closed = sock.recv(1) == b""
    sock.close()
    return answers, closed


async def until(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def open_to_everyone(sched: Any) -> None:
    """Let every local user reach ``sched``'s socket, as a node scheduler's group or mode would:
    the attacks need to come in."""
    os.chmod(os.path.dirname(sched.socket_path), 0o755)
    os.chmod(sched.socket_path, 0o666)


def clients_of(sched: Any) -> dict[str, dict[str, Any]]:
    """The clients of a scheduler's full status, by id."""
    return {c["id"]: c for d in sched.status_document()["devices"] for c in d["clients"]}
