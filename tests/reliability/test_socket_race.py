"""Issue 22, items 1 and 2, and issue 24, as real separate uids: what a client connects to is what
it checked, the peer is checked before any byte is sent, and only the service account the operator
names is trusted besides the user and root (docs/protocol.md, "Trusting the socket").

The race (item 1): with XDG_RUNTIME_DIR unset, alice's socket is
``$TMP/gpushare-$UID/scheduler.sock``; mallory owns a symlink of that name in the sticky shared
directory and flips it between a directory alice trusts and her own, while alice's shim (and the
Python client) connect again and again. A check of a path that connect() looks up again loses
that race; not one HELLO may reach mallory.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from local_users import LocalUser, collect, kill, spawn_as, tmp_dir

from jupyter_gpushare.scheduler_client import SchedulerClient, SchedulerUnavailable
from tests.conftest import NATIVE_TESTS, _load_build_module

TRIES_SHIM = 60
TRIES_CLIENT = 100
# How long each connect waits after the checks (a descheduled victim): long against the time
# between two flips, so that a check of a path loses the race in about a quarter of the tries.
CONNECT_DELAY_US = 5000

# -- what mallory runs (module level: the forked child calls them) -----------------------------


def _record_hellos(path: str, record: str) -> None:
    """Listen on ``path``; for each connection, append a mark and whatever arrives at once."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(64)
    while True:
        conn, _ = srv.accept()
        conn.settimeout(0.2)
        data = b""
        with contextlib.suppress(OSError):
            data = conn.recv(65536)
        conn.close()
        with open(record, "ab") as out:
            out.write(b"<connection>" + data)


def _flip(link: str, targets: list[str], stop: str) -> int:
    """Point ``link`` at each target in turn, as fast as the kernel swaps two names
    (renameat2's RENAME_EXCHANGE of two symlinks), until ``stop`` exists."""
    spare = link + ".flip"
    os.symlink(targets[0], link)
    os.symlink(targets[1], spare)
    libc = ctypes.CDLL(None, use_errno=True)
    exchange, at_fdcwd = 2, -100
    a, b = os.fsencode(link), os.fsencode(spare)
    flips = 0
    while not os.path.exists(stop):
        for _ in range(200):
            if libc.renameat2(at_fdcwd, a, at_fdcwd, b, exchange) != 0:
                raise OSError(ctypes.get_errno(), "renameat2")
        flips += 200
        if flips == 1000:
            open(stop + ".flipping", "w").close()  # under way: the victim may start
    return flips


class _SlowSocket(socket.socket):
    """A socket whose connect waits CONNECT_DELAY_US first (slow_connect.c's, for Python)."""

    def connect(self, address: Any) -> None:
        time.sleep(CONNECT_DELAY_US / 1e6)
        super().connect(address)


def _client_tries(path: str, tries: int, env: dict[str, str], slow: bool = False) -> list[str]:
    """Alice's `gpushare status` (the Python client), ``tries`` times: why each failed."""
    os.environ.update(env)
    if slow:
        socket.socket = _SlowSocket  # type: ignore[misc]  (this child only)
    whys = []
    for _ in range(tries):
        time.sleep(0.002)  # tries spread over the flips, as a user's commands would be
        try:
            SchedulerClient(path, timeout=1.0, token="alice-secret").status_sync()
            whys.append("answered")
        except SchedulerUnavailable as exc:
            whys.append(exc.reason)
        except Exception as exc:  # a closed connection after the HELLO went out, and the like
            whys.append(f"{type(exc).__name__}: {exc}")
    return whys


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def shared_tmp() -> Iterator[str]:
    with tmp_dir(0o1777) as path:  # like /tmp
        yield path


@pytest.fixture
def public_shim(native_build: Any) -> Iterator[dict[str, str]]:
    """The shim, the stand-in driver and the test program where other users can run them."""
    shim = native_build.require_shim()
    with tmp_dir(0o755) as where:
        shutil.copy(shim, os.path.join(where, "libgpushare.so"))
        shutil.copytree(native_build.fake_dir, os.path.join(where, "driver"))
        shutil.copy(native_build.cudart_like, os.path.join(where, "cudart_like"))
        _load_build_module().build_shared(
            [NATIVE_TESTS / "slow_connect.c"], Path(where) / "slow_connect.so", ["-ldl"]
        )
        for root, dirs, files in os.walk(where):
            for name in dirs + files:
                os.chmod(os.path.join(root, name), 0o755)
        yield {
            "program": os.path.join(where, "cudart_like"),
            "LD_PRELOAD": os.path.join(where, "libgpushare.so"),
            "LD_LIBRARY_PATH": os.path.join(where, "driver"),
            "slow_connect": os.path.join(where, "slow_connect.so"),
        }


class _Closer(threading.Thread):
    """A listener (as root, trusted by everyone) that closes every connection at once."""

    def __init__(self, path: str, owner: LocalUser) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chown(path, owner.uid, owner.gid)
        os.chmod(path, 0o666)
        self.sock.listen(64)
        self.accepted = 0

    def run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.accepted += 1
                conn.close()


def _alice_dir(shared_tmp: str, alice: LocalUser) -> tuple[str, _Closer]:
    """A directory alice trusts (hers, 0700) with a socket that answers."""
    good = os.path.join(shared_tmp, "alice-real")
    os.mkdir(good, 0o700)
    os.chown(good, alice.uid, alice.gid)
    closer = _Closer(os.path.join(good, "scheduler.sock"), alice)
    closer.start()
    return good, closer


def _records(record: str) -> bytes:
    with contextlib.suppress(FileNotFoundError), open(record, "rb") as f:
        return f.read()
    return b""


def _shim_run(
    shim: dict[str, str], alice: LocalUser, env: dict[str, str], slow: bool = False
) -> subprocess.CompletedProcess[str]:
    """The test program under the shim, as ``alice``, with ``env`` besides the shim's own;
    ``slow``: each connect waits CONNECT_DELAY_US after the checks (slow_connect.c)."""
    preload = f"{shim['slow_connect']}:{shim['LD_PRELOAD']}" if slow else shim["LD_PRELOAD"]
    env = {
        "PATH": "/usr/bin:/bin",
        "LD_PRELOAD": preload,
        "GPUSHARE_TEST_CONNECT_DELAY_US": str(CONNECT_DELAY_US),
        "LD_LIBRARY_PATH": shim["LD_LIBRARY_PATH"],
        "GPUSHARE_LOG": "info",
        "GPUSHARE_USER_TOKEN": "alice-secret",
        **env,
    }
    return subprocess.run(
        [shim["program"], "status"],
        env=env,
        user=alice.uid,
        group=alice.gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )


# -- the race ---------------------------------------------------------------------------------


@pytest.mark.parametrize("who", ["shim", "client"])
def test_a_symlink_flipped_during_the_connect_reaches_no_hello(
    local_users: Any, shared_tmp: str, public_shim: dict[str, str], who: str
) -> None:
    alice, mallory = local_users("alice"), local_users("mallory")
    good, closer = _alice_dir(shared_tmp, alice)
    trap_dir = os.path.join(shared_tmp, "mallory")
    record = os.path.join(shared_tmp, "record")
    stop = os.path.join(shared_tmp, "stop")
    link = os.path.join(shared_tmp, f"gpushare-{alice.uid}")
    listener = spawn_as(mallory, _record_hellos, os.path.join(trap_dir, "scheduler.sock"), record)
    flipper = None
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(trap_dir, "scheduler.sock")):
            assert time.monotonic() < deadline, "mallory's listener did not start"
            time.sleep(0.02)
        flipper = spawn_as(mallory, _flip, link, [good, trap_dir], stop)
        while not os.path.exists(stop + ".flipping"):
            assert time.monotonic() < deadline, "mallory's symlink does not flip"
            time.sleep(0.01)
        path = os.path.join(link, "scheduler.sock")
        if who == "shim":
            outs = [
                _shim_run(public_shim, alice, {"XDG_RUNTIME_DIR": shared_tmp}, slow=True)
                for _ in range(TRIES_SHIM)
            ]
            lines = [line for out in outs for line in out.stderr.splitlines()]
            assert all(out.returncode == 0 for out in outs), outs[0].stderr
        else:
            pid, rfd = spawn_as(
                alice, _client_tries, path, TRIES_CLIENT, {"XDG_RUNTIME_DIR": shared_tmp}, True
            )
            lines = collect(pid, rfd, 120)
        open(stop, "w").close()
        flips = collect(*flipper, 30)
        flipper = None
    finally:
        if flipper:
            open(stop, "w").close()
            kill(flipper[0])
            os.close(flipper[1])
        kill(listener[0])
        os.close(listener[1])
        closer.sock.close()
    got = _records(record)
    assert flips > 100, flips  # mallory flipped the link all along
    assert got.count(b"<connection>") == 0, (got.count(b"<connection>"), got[:300])
    assert b"alice-secret" not in got
    # Refused loudly, as a link (the directory is opened without following one).
    assert any("is a link or not a directory" in line for line in lines), lines[:5]


# -- the service account is named, never inferred --------------------------------------------


def _service_dir(shared_tmp: str, owner: LocalUser, mode: int = 0o755) -> tuple[str, _Closer]:
    d = os.path.join(shared_tmp, "node")
    os.mkdir(d)
    os.chmod(d, mode)
    os.chown(d, owner.uid, owner.gid)
    closer = _Closer(os.path.join(d, "scheduler.sock"), owner)
    closer.start()
    return os.path.join(d, "scheduler.sock"), closer


def test_a_directory_and_socket_of_another_user_are_refused_unless_named(
    local_users: Any, shared_tmp: str, public_shim: dict[str, str]
) -> None:
    """Item 2: mallory makes a node-like directory and socket, both hers; alice's shim and client
    refuse them. Named as GPUSHARE_SERVICE_USER (by name or uid), the same pair is used."""
    alice, mallory = local_users("alice"), local_users("mallory")
    path, closer = _service_dir(shared_tmp, mallory)
    try:
        for service, trusted in (("", False), (mallory.name, True), (str(mallory.uid), True)):
            env = {"GPUSHARE_SERVICE_USER": service} if service else {}
            before = closer.accepted
            out = _shim_run(public_shim, alice, {"GPUSHARE_SOCKET": path, **env})
            refused = f"belongs to uid {mallory.uid}" in out.stderr
            assert refused is not trusted, (service, out.stderr)
            whys = collect(*spawn_as(alice, _client_tries, path, 1, env), 30)
            assert (f"belongs to uid {mallory.uid}" in whys[0]) is not trusted, (service, whys)
            # Refused: not even a connection; trusted: the shim and the client both connected.
            assert closer.accepted - before == (2 if trusted else 0), (service, out.stderr, whys)
    finally:
        closer.sock.close()


def test_a_group_writable_directory_is_refused(
    local_users: Any, shared_tmp: str, public_shim: dict[str, str]
) -> None:
    """Issue 24: a directory its group may write (0770, alice's own) is refused like a
    world-writable one, by the shim and the client: a member of the group could swap the
    socket. The same directory at 0750 is used (the refusal is the group's write bit)."""
    alice = local_users("alice")
    path, closer = _service_dir(shared_tmp, alice, mode=0o770)
    try:
        out = _shim_run(public_shim, alice, {"GPUSHARE_SOCKET": path})
        assert "is writable by its group" in out.stderr, out.stderr
        whys = collect(*spawn_as(alice, _client_tries, path, 1, {}), 30)
        assert "is writable by its group" in whys[0], whys
        assert closer.accepted == 0
        os.chmod(os.path.dirname(path), 0o750)
        out = _shim_run(public_shim, alice, {"GPUSHARE_SOCKET": path})
        assert "refusing" not in out.stderr and closer.accepted == 1, out.stderr
    finally:
        closer.sock.close()


def _listen(path: str, stop: str) -> None:
    """Mallory: listen on ``path`` until ``stop`` exists (what arrives is never read)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(64)
    while not os.path.exists(stop):
        time.sleep(0.02)


def test_the_peer_is_checked_before_the_hello(
    local_users: Any, shared_tmp: str, public_shim: dict[str, str]
) -> None:
    """Whatever the files say, the listener's own uid (SO_PEERCRED) decides: mallory's
    listening socket, linked into alice's private directory and made alice's, passes every
    file check, and is refused before a byte is sent."""
    alice, mallory = local_users("alice"), local_users("mallory")
    theirs = os.path.join(shared_tmp, "m")
    os.mkdir(theirs, 0o755)
    os.chown(theirs, mallory.uid, mallory.gid)
    stop = os.path.join(shared_tmp, "stop")
    listener = spawn_as(mallory, _listen, os.path.join(theirs, "s.sock"), stop)
    good = os.path.join(shared_tmp, "alice-real")
    os.mkdir(good, 0o700)
    os.chown(good, alice.uid, alice.gid)
    path = os.path.join(good, "scheduler.sock")
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(theirs, "s.sock")):
            assert time.monotonic() < deadline, "mallory's listener did not start"
            time.sleep(0.02)
        os.link(os.path.join(theirs, "s.sock"), path)
        os.chown(path, alice.uid, alice.gid)
        out = _shim_run(public_shim, alice, {"GPUSHARE_SOCKET": path})
        assert f"runs as uid {mallory.uid}" in out.stderr, out.stderr
        whys = collect(*spawn_as(alice, _client_tries, path, 1, {}), 30)
        assert f"runs as uid {mallory.uid}" in whys[0], whys
    finally:
        open(stop, "w").close()
        collect(*listener, 30)


def _configure(service_user: str) -> str:
    """A scheduler's configuration with ``service_user``: '' if accepted, else why not."""
    from traitlets import TraitError

    from jupyter_gpushare.scheduler.shell.config import SchedulerConfig

    try:
        SchedulerConfig(service_user=service_user)
    except TraitError as exc:
        return str(exc)
    return ""


def test_a_scheduler_that_is_not_the_named_service_account_refuses_the_name(
    local_users: Any,
) -> None:
    """The scheduler's service_user is the name clients are told: a scheduler running as
    another (non-root) account would be refused by all of them, so it refuses the setting."""
    service, other = local_users("svc"), local_users("other")
    assert collect(*spawn_as(service, _configure, service.name), 30) == ""
    assert collect(*spawn_as(service, _configure, str(service.uid)), 30) == ""
    why = collect(*spawn_as(other, _configure, service.name), 30)
    assert f"runs as uid {other.uid}" in why, why
    assert "no user" in collect(*spawn_as(service, _configure, "gs-no-such-user-x"), 30)


def _own_directory(directory: str) -> str:
    """The scheduler's side: why ``directory`` may not hold this user's socket ('' if it may)."""
    from jupyter_gpushare.paths import SocketDistrusted, open_own_directory

    try:
        os.close(open_own_directory(directory))
    except SocketDistrusted as exc:
        return str(exc)
    return ""


def test_a_scheduler_checks_its_own_directory_without_following_a_link(
    local_users: Any, shared_tmp: str
) -> None:
    """paths.open_own_directory, for the scheduler's socket (transport binds through it): alice's
    own private directory is fine; mallory's symlink to it, mallory's directory and a directory
    its group may write are refused."""
    alice, mallory = local_users("alice"), local_users("mallory")
    good = os.path.join(shared_tmp, "alice-real")
    os.mkdir(good, 0o700)
    os.chown(good, alice.uid, alice.gid)
    theirs = os.path.join(shared_tmp, "m")
    os.mkdir(theirs, 0o755)
    os.chown(theirs, mallory.uid, mallory.gid)
    link = os.path.join(shared_tmp, f"gpushare-{alice.uid}")
    os.symlink(good, link)
    os.lchown(link, mallory.uid, mallory.gid)
    assert collect(*spawn_as(alice, _own_directory, good), 30) == ""
    assert "is a link" in collect(*spawn_as(alice, _own_directory, link), 30)
    assert f"belongs to uid {mallory.uid}" in collect(*spawn_as(alice, _own_directory, theirs), 30)
    os.chmod(good, 0o770)
    assert "writable by its group" in collect(*spawn_as(alice, _own_directory, good), 30)
