"""Deep idle and an operator's evict under a node scheduler run by a service account, as real
separate uids on the stand-in driver (issue "Operators" item 1, issue "Hostile user" item 5).

The driver lets a process checkpoint another one only as ptrace would (root, or the same uid);
the stand-in refuses a caller of another uid as the driver does (native/tests/fake_checkpoint.c).
The scheduler runs as a service account (deploy/systemd's ``User=gpushare``); alice's kernel runs
under her "Jupyter server", a process of hers that started it and serves as its checkpoint agent
(features/checkpoint_agent.py). Every process of another user is a fork of this one that dropped
to that uid (the test's interpreter may live where other users cannot read it), started from a
directory every user can read; the native artefacts are copied there.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from local_users import LocalUser, collect, control, kill, spawn_as, tmp_dir

from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync
from jupyter_gpushare.scheduler.features.checkpoint_agent import CheckpointAgent, serve_while
from jupyter_gpushare.scheduler.features.sleeping import EVICT_REPLY_SECONDS
from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler
from jupyter_gpushare.scheduler_client import REQUEST_SECONDS

MiB = 1 << 20
CONTEXT = 64 * MiB
DATA = 32 * MiB
DEVICE = {"device_uuid": "GPU-deep-idle-0", "device_total": 8 << 30}


@dataclass(frozen=True)
class Node:
    """What every user's processes share: the copied artefacts and the node's directories."""

    root: Path
    driver: Path  # the stand-in libcuda.so.1
    shim: Path
    program: Path  # cudart_like
    ckpt: Path  # the stand-in's checkpoint rendezvous (1777)
    socket: str
    log: Path
    svc: LocalUser
    alice: LocalUser

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_log(self, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log_text()
            if text in log:
                return log
            time.sleep(0.05)
        raise AssertionError(
            f"{text!r} not in the scheduler's log in {timeout} s:\n{self.log_text()}"
        )

    def ask(self, action: str, client: str, **more: Any) -> dict[str, Any]:
        """A control action by root (an operator), as the CLI sends it."""
        mtype, fields = control(
            self.socket,
            MsgType.CONTROL,
            {"action": action, "client": client, **more},
            # As the CLI waits: an evict of a holder that ignores its revoke answers after the
            # checkpoint (over 10 s once, beside a full loaded test run).
            timeout=EVICT_REPLY_SECONDS if action == "evict" else REQUEST_SECONDS,
        )
        assert mtype == MsgType.CONTROL_REPLY, fields
        return dict(fields["body"])

    def client(self, client: str) -> dict[str, Any] | None:
        _, fields = control(self.socket, MsgType.STATUS_REQUEST, None)
        doc = json.loads(fields["body"]) if isinstance(fields.get("body"), str) else fields["body"]
        for dev in doc["devices"]:
            for c in dev["clients"]:
                if c["id"] == client:
                    return dict(c)
        return None

    def device_bytes(self, pid: int) -> int:
        """What the stand-in in ``pid`` says the process holds on the device (root may ask)."""
        lib = ctypes.CDLL(str(self.driver))
        lib.fakecuda_process_device_bytes.restype = ctypes.c_longlong
        return int(lib.fakecuda_process_device_bytes(ctypes.c_int(pid)))


def serve_node(node: Node, stop: str, options: dict[str, Any]) -> str:
    """The node scheduler, in a child that is the service account: runs until ``stop`` exists."""
    os.environ["GPUSHARE_FAKE_CHECKPOINT_DIR"] = str(node.ckpt)
    log = logging.getLogger(f"node-{os.getpid()}")
    log.setLevel(logging.DEBUG)
    log.addHandler(logging.FileHandler(node.log))

    async def main() -> None:
        sched = GPUShareScheduler(
            log=log,
            socket_path=node.socket,
            socket_mode=0o666,
            use_nvml=False,
            precopy_idle=False,
            checkpoint_library=str(node.driver),
            **options,
        )
        await sched.start()
        try:
            while not os.path.exists(stop):
                await asyncio.sleep(0.05)
        finally:
            await sched.stop()

    asyncio.run(main())
    return "stopped"


async def _warm_up(node: Node) -> None:
    """Import what the children will need: past the fork they may not read the interpreter's
    files. A scheduler starts and stops here, and an agent connects to it once."""
    warm = node.root / "warm"
    warm.mkdir(mode=0o700, exist_ok=True)
    path = str(warm / "s.sock")
    # A copy of the driver: the stand-in's cuInit serves checkpoints once per process, and a
    # child forked after this one's cuInit would not serve its own.
    driver = shutil.copy(node.driver, warm / "libcuda-warm.so.1")
    sched = GPUShareScheduler(
        socket_path=path,
        use_nvml=False,
        deep_idle_seconds=1.0,
        checkpoint_library=str(driver),
        log=logging.getLogger("warm-up"),
    )
    await sched.start()
    try:
        task = asyncio.ensure_future(CheckpointAgent(path, str(driver)).run())
        await asyncio.sleep(0.3)
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
    finally:
        await sched.stop()


@pytest.fixture(scope="module")
def people(local_users: Callable[[str], LocalUser]) -> tuple[LocalUser, LocalUser]:
    return local_users("svc"), local_users("alice")


@pytest.fixture
def node_files(
    native_build: Any, people: tuple[LocalUser, LocalUser], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Node]:
    build = native_build
    svc, alice = people
    with tmp_dir(0o755) as path:
        root = Path(path)
        shutil.copytree(build.fake_dir, root / "driver")
        shim = root / "libgpushare.so"
        shutil.copy(build.require_shim(), shim)
        program = root / "cudart_like"
        shutil.copy(build.cudart_like, program)
        for p in (root / "driver", shim, program, *(root / "driver").iterdir()):
            p.chmod(0o755)
        for d in ("ck", "logs"):
            (root / d).mkdir(mode=0o1777)
            (root / d).chmod(0o1777)
        run = root / "run"
        run.mkdir(mode=0o755)
        os.chown(run, svc.uid, svc.gid)
        log = root / "logs" / "scheduler.log"
        node = Node(
            root,
            root / "driver" / "libcuda.so.1",
            shim,
            program,
            root / "ck",
            str(run / "s.sock"),
            log,
            svc,
            alice,
        )
        monkeypatch.setenv("GPUSHARE_FAKE_CHECKPOINT_DIR", str(node.ckpt))  # device_bytes()
        asyncio.run(_warm_up(node))
        yield node


@contextlib.contextmanager
def running_node(node: Node, **options: Any) -> Iterator[Node]:
    stop = str(node.root / "logs" / "stop-node")
    pid, rfd = spawn_as(node.svc, serve_node, node, stop, options)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(node.socket):
            assert time.monotonic() < deadline, node.log_text()
            time.sleep(0.05)
        yield node
    finally:
        open(stop, "w").close()
        try:
            collect(pid, rfd, 30)
        finally:
            kill(pid)


def kernel_env(node: Node, client: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env.pop("LD_PRELOAD", None)
    return env | {
        "LD_PRELOAD": str(node.shim),
        "LD_LIBRARY_PATH": str(node.driver.parent),
        "GPUSHARE_SOCKET": node.socket,
        "GPUSHARE_CLIENT_ID": client,
        "GPUSHARE_IDLE_SECONDS": "0.3",
        "GPUSHARE_CONTEXT_BYTES": str(CONTEXT),
        "GPUSHARE_LOG": "info",
        "GPUSHARE_FAKE_CHECKPOINT_DIR": str(node.ckpt),
        "GPUSHARE_FAKE_CONTEXT_BYTES": str(CONTEXT),
        "GPUSHARE_SERVICE_USER": node.svc.name,  # the account the node's socket may belong to
    }


def jupyter_server(node: Node, argv: list[str], env: dict[str, str], out: str) -> tuple[int, str]:
    """Alice's Jupyter server as the test needs it: it starts her kernel (its child) and serves
    as her checkpoint agent until the kernel ends; the kernel's exit code and stdout."""
    import subprocess

    os.environ["GPUSHARE_SERVICE_USER"] = node.svc.name
    with open(out, "w") as stdout, open(out + ".err", "w") as stderr:
        kernel = subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr)
    agent = CheckpointAgent(node.socket, str(node.driver))
    code = asyncio.run(serve_while(agent, kernel))
    return code, Path(out).read_text()


def kernel_state(node: Node, client: str, state: str) -> None:
    """What the Jupyter server extension says when a cell starts (busy) or ends (idle)."""
    assert node.ask("kernel_state", client, state=state)["ok"]


def test_a_service_account_scheduler_puts_alices_kernel_to_sleep_through_her_server(
    node_files: Node,
) -> None:
    with running_node(node_files, deep_idle_seconds=1.5, pool_size="1GiB") as node:
        out = str(node.root / "logs" / "kernel.out")
        argv = [str(node.program), "deep_idle", str(DATA), "10"]
        pid, rfd = spawn_as(node.alice, jupyter_server, node, argv, kernel_env(node, "A"), out)
        try:
            node.wait_log("checkpoint_agent uid=", 20)
            node.wait_log("join client=A", 20)
            kernel_state(node, "A", "busy")
            kernel_state(node, "A", "idle")
            kpid = int((node.client("A") or {})["pid"])
            assert node.device_bytes(kpid) >= CONTEXT + DATA
            log = node.wait_log("asleep client=A", 30)
            # The scheduler, not root and not alice, had the calls made by her own process.
            assert "sleep_failed" not in log, log
            assert node.device_bytes(kpid) == 0, "asleep, it still holds device memory"
            assert (node.client("A") or {})["state"] == "asleep"
            kernel_state(node, "A", "busy")  # its next cell
            node.wait_log("woke client=A", 20)
            assert node.device_bytes(kpid) >= CONTEXT
            code, stdout = collect(pid, rfd, 60)
        finally:
            kill(pid)
    assert code == 0, stdout
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    (woken,) = [e for e in events if e.get("event") == "woken"]
    assert woken["data_ok"], "alice's data did not survive the checkpoint and the restore"
    assert "wake_failed" not in node.log_text()


def hog(node: Node, nbytes: int, stop: str, out: str) -> None:
    """A holder that ignores REVOKE: real device memory (the stand-in's), a grant, then silence."""
    lib = ctypes.CDLL(str(node.driver))
    assert lib.cuInit(0) == 0
    dev, ctx = ctypes.c_int(0), ctypes.c_void_p(0)
    assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
    ptr = ctypes.c_uint64(0)
    assert lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)) == 0
    ctypes.memset(ptr.value, 0x5A, nbytes)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(node.socket)
    hello = {"client_id": "hog", "pid": os.getpid(), "used_bytes": nbytes, **DEVICE}
    sock.sendall(encode(Message(MsgType.HELLO, hello)))
    heard = [read_message_sync(sock)]
    sock.sendall(encode(Message(MsgType.REQUEST, {"used_bytes": nbytes})))
    sock.settimeout(0.2)
    while not os.path.exists(stop):
        with contextlib.suppress(TimeoutError, OSError):
            heard.append(read_message_sync(sock))
    Path(out).write_text(json.dumps([int(m.type) for m in heard if m is not None]))


def hog_under_server(
    node: Node, nbytes: int, stop: str, out: str, holder: Callable[..., None] | None = None
) -> int:
    """Alice's server: the hog (or ``holder``) is its child (forked: the interpreter is not hers
    to exec); the server serves as her checkpoint agent."""
    os.environ["GPUSHARE_SERVICE_USER"] = node.svc.name
    child = os.fork()
    if child == 0:
        code = 0
        try:
            (holder or hog)(node, nbytes, stop, out)
        except BaseException as exc:
            Path(out + ".err").write_text(repr(exc))
            code = 1
        os._exit(code)
    return asyncio.run(serve_while(CheckpointAgent(node.socket, str(node.driver)), child))


def waiter(node: Node, nbytes: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(node.socket)
    hello = {"client_id": "waiter", "pid": os.getpid(), "used_bytes": 0, **DEVICE}
    sock.sendall(encode(Message(MsgType.HELLO, hello)))
    assert (m := read_message_sync(sock)) is not None and m.type == MsgType.WELCOME, m
    sock.sendall(encode(Message(MsgType.REQUEST, {"used_bytes": nbytes})))
    return sock


def test_an_operators_evict_takes_the_memory_of_a_holder_that_ignores_revoke(
    node_files: Node,
) -> None:
    options = {
        "pool_size": "1GiB",
        "base_quantum": 0.3,
        "revoke_deadline_seconds": 1.0,
        "deep_idle_seconds": 0,  # the evict needs no deep idle
    }
    with running_node(node_files, **options) as node:
        stop = str(node.root / "logs" / "stop-hog")
        out = str(node.root / "logs" / "hog.json")
        pid, rfd = spawn_as(node.alice, hog_under_server, node, 768 * MiB, stop, out)
        sock = None
        try:
            node.wait_log("checkpoint_agent uid=", 20)
            with contextlib.suppress(AssertionError):
                node.wait_log("grant client=hog", 20)
            assert "grant client=hog" in node.log_text(), Path(out + ".err").read_text()
            hog_pid = int((node.client("hog") or {})["pid"])
            assert node.device_bytes(hog_pid) >= 768 * MiB
            sock = waiter(node, 768 * MiB)
            node.wait_log("revoke_overdue client=hog", 20)
            # Past its deadline it is counted as released, its memory still on the GPU: the
            # waiter, who does not fit beside it, still waits.
            time.sleep(0.5)
            assert (node.client("waiter") or {})["state"] == "waiting"
            reply = node.ask("evict", "hog")
            assert reply["done"] is True and reply["checkpointed"] is True, reply
            assert "checkpointed" in reply["effect"] and "768" in reply["effect"], reply
            grant = read_message_sync(sock)
            assert grant is not None and grant.type == MsgType.GRANT, grant
            assert node.device_bytes(hog_pid) == 0, "the hog's memory is still on the device"
            log = node.wait_log("force_evict client=hog")
            assert "checkpoint agent of uid" in log, log
            assert (node.client("hog") or {})["state"] == "asleep"
        finally:
            open(stop, "w").close()
            if sock is not None:
                sock.close()
            with contextlib.suppress(Exception):
                collect(pid, rfd, 30)
            kill(pid)
