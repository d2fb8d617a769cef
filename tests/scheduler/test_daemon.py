"""The node daemon's surroundings: Prometheus metrics, socket permissions, JSON logs, the CLI."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import stat
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sched_helpers import DEVICE, MiB

from jupyter_gpushare.cli import SchedulerApp
from jupyter_gpushare.identity import generate_key, load_key, user_token
from jupyter_gpushare.protocol import MsgType
from jupyter_gpushare.scheduler.shell.logs import JsonFormatter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def series_key(series: str) -> str:
    """``name{labels}`` with its labels sorted: the exposition's label order is not a contract."""
    name, _, labels = series.partition("{")
    return name + "{" + ",".join(sorted(m.group(0) for m in _LABEL.finditer(labels))) + "}"


class Scrape(dict):  # type: ignore[type-arg]
    """{'name{labels}': value}, looked up whatever order the labels are written in."""

    def __getitem__(self, key: str) -> float:
        return float(super().__getitem__(series_key(key)))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(series_key(str(key)))


def scrape(port: int) -> Scrape:
    """The exposition text of the scheduler's /metrics as a :class:`Scrape`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = Scrape()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            dict.__setitem__(out, series_key(name), float(value))
    return out


async def test_metrics_after_a_handoff(make_scheduler: Any, connect: Any, tmp_path: Path) -> None:
    key_path = str(tmp_path / "k")
    generate_key(key_path)
    key = load_key(key_path)
    port = free_port()
    server = await make_scheduler(
        metrics_port=port,
        metrics_interval=0.05,
        token_uids=[os.getuid()],
        user_key_file=key_path,
    )
    a, b = await connect(), await connect()
    await a.hello("a", user="alice", token=user_token(key, "alice"))
    await b.hello("b", user="bob", token=user_token(key, "bob"))
    await a.request(800 * MiB)
    await a.expect(MsgType.GRANT)
    await asyncio.sleep(0.2)  # alice holds the GPU for a while
    await a.send(MsgType.IDLE, idle_ms=100)
    await b.request(800 * MiB)  # does not fit beside alice: her idle turn is revoked
    revoke = await a.expect(MsgType.REVOKE)
    assert revoke["flag"] == 1
    await a.send(
        MsgType.RELEASED, flag=1, evicted_bytes=800 * MiB, bytes_moved=800 * MiB, micros=80_000
    )
    await b.expect(MsgType.GRANT)
    await asyncio.sleep(0.3)  # two refreshes of the gauges

    m = await asyncio.to_thread(scrape, server.metrics.port)
    dev = f'device="{DEVICE}",UUID="{DEVICE}",gpu="",modelName=""'
    assert m[f"gpushare_handoffs_total{{{dev}}}"] == 1
    assert m[f"gpushare_grants_total{{{dev}}}"] == 2
    assert m[f'gpushare_bytes_moved_total{{{dev},direction="evict"}}'] == 800 * MiB
    assert m[f'gpushare_moved_bytes_total{{{dev},direction="evict"}}'] == 800 * MiB
    assert m[f'gpushare_user_holding_clients{{{dev},user="bob"}}'] == 1
    assert m[f"gpushare_wait_seconds_count{{{dev}}}"] == 2
    assert m[f'gpushare_wait_seconds_bucket{{{dev},le="+Inf"}}'] == 2
    assert m[f"gpushare_holders{{{dev}}}"] == 1
    assert m[f'gpushare_holder{{{dev},user="bob"}}'] == 1
    assert f'gpushare_holder{{{dev},user="alice"}}' not in m  # alice holds nothing any more
    assert m[f"gpushare_queue_length{{{dev}}}"] == 0
    assert m[f"gpushare_clients{{{dev}}}"] == 2
    assert m[f'gpushare_user_memory_bytes{{{dev},user="alice"}}'] == 800 * MiB
    assert m[f'gpushare_user_resident_bytes{{{dev},user="alice"}}'] == 0  # evicted
    assert m[f'gpushare_user_resident_bytes{{{dev},user="bob"}}'] == 800 * MiB
    assert m[f'gpushare_user_clients{{{dev},user="bob"}}'] == 1
    assert m[f"gpushare_pool_bytes{{{dev}}}"] == 1 << 30
    assert m["gpushare_connections"] == 2
    # GPU time per user: alice's finished hold (about 0.2 s), bob's current one so far.
    alice = m['gpushare_user_gpu_seconds_total{user="alice"}']
    assert 0.15 < alice < 5
    assert 0 < m['gpushare_user_gpu_seconds_total{user="bob"}'] < 5
    # Bob leaves: his user's gauges vanish on the next refresh, his GPU time stays counted.
    await b.close()
    await asyncio.sleep(0.3)
    m = await asyncio.to_thread(scrape, server.metrics.port)
    assert f'gpushare_user_clients{{{dev},user="bob"}}' not in m
    assert m['gpushare_user_gpu_seconds_total{user="bob"}'] > 0
    port = server.metrics.port
    await server.stop()
    with pytest.raises(OSError):
        await asyncio.to_thread(scrape, port)  # the listener is gone


async def test_metrics_port_in_use(make_scheduler: Any, sock_path: str) -> None:
    from jupyter_gpushare.scheduler.shell.server import SchedulerStartError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(SchedulerStartError, match="cannot serve metrics"):
            await make_scheduler(metrics_port=busy.getsockname()[1])
    assert not os.path.exists(sock_path)  # not left half-started


# --- socket permissions ---------------------------------------------------------------------


async def test_socket_mode_and_group(make_scheduler: Any, sock_dir: str) -> None:
    path = os.path.join(sock_dir, "node", "scheduler.sock")
    group = os.getgroups()[-1] if os.getgroups() else os.getgid()
    await make_scheduler(
        socket_path=path, socket_mode=0o660, socket_group=str(group), socket_dir_mode=0o750
    )
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == group and st.st_uid == os.getuid()
    dst = os.stat(os.path.dirname(path))
    assert stat.S_IMODE(dst.st_mode) == 0o750 and dst.st_gid == group


@pytest.mark.skipif(os.geteuid() == 0, reason="root connects whatever the socket's mode")
async def test_a_peer_without_write_permission_cannot_connect(
    make_scheduler: Any, sock_dir: str
) -> None:
    # Group-only access (0o060): the owner is not in the class the mode lets in, exactly like
    # a user outside socket_group on a node-wide socket of mode 0660.
    path = os.path.join(sock_dir, "g.sock")
    await make_scheduler(socket_path=path, socket_mode=0o060)
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(PermissionError):
        s.connect(path)


NOBODY = 65534
#: Runs as another user: connects, sends the frame given in hex, prints the answer in hex (or
#: the errno's name). Standard library only: that user cannot read this test's virtualenv.
PEER = """
import errno, socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print(errno.errorcode[exc.errno]); sys.exit(0)
s.sendall(bytes.fromhex(sys.argv[2]))
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
    if len(data) >= 12 and len(data) >= 12 + int.from_bytes(data[8:12], "little"):
        break
print(data.hex())
"""
SYSTEM_PYTHON = "/usr/bin/python3"


def as_nobody(path: str, msg: Any, groups: list[int]) -> Any:
    """Send ``msg`` as uid 65534 (a real second identity for SO_PEERCRED); the decoded answer,
    or the errno name of a failed connect."""
    import subprocess

    from jupyter_gpushare.protocol import decode_frame, encode

    out = subprocess.run(
        [SYSTEM_PYTHON, "-c", PEER, path, encode(msg).hex()],
        user=NOBODY, group=NOBODY, extra_groups=groups, capture_output=True, text=True,
        timeout=30, cwd="/",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout.strip()
    return text if text.startswith("E") else decode_frame(bytes.fromhex(text))


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="needs root to run a peer as another uid",
)
async def test_socket_group_and_real_peer_credentials(
    make_scheduler: Any, connect: Any, sock_dir: str
) -> None:
    from jupyter_gpushare.protocol import ErrorCode, Message

    os.chmod(sock_dir, 0o711)  # let the other user reach the scheduler's own directory
    path = os.path.join(sock_dir, "node", "scheduler.sock")
    group = 0  # a group uid 65534 is not in unless given it
    await make_scheduler(
        socket_path=path, socket_mode=0o660, socket_group=str(group), socket_dir_mode=0o755
    )
    status = Message(MsgType.STATUS_REQUEST, {"user": "root"})
    # Outside the socket's group: the kernel refuses the connection.
    assert await asyncio.to_thread(as_nobody, path, status, []) == "EACCES"
    # In the group: connected, and identified by its real uid whatever it claims.
    root_kernel = await connect(path)
    await root_kernel.hello("root-k", user="root")
    reply = await asyncio.to_thread(as_nobody, path, status, [group])
    assert reply.type == MsgType.STATUS
    doc = reply["body"]
    assert doc["identity"] == {"user": "nobody", "admin": False, "by": "uid"}
    assert doc["devices"][0]["clients"] == []
    assert doc["devices"][0]["others"][0]["user"] == "root"
    release = Message(MsgType.CONTROL, {"body": {"action": "release", "client": "root-k"}})
    reply = await asyncio.to_thread(as_nobody, path, release, [group])
    # Another user's client is not found, as a missing one: the id is not confirmed.
    assert reply.type == MsgType.ERROR and reply["error_code"] == ErrorCode.NOT_FOUND


# --- logs and the command line --------------------------------------------------------------


def test_json_log_lines() -> None:
    fmt = JsonFormatter()
    rec = logging.LogRecord(
        "GPUShareScheduler", logging.INFO, "", 0,
        "revoke client=%s evict=%d %s held_ms=%s reason=%r",
        ("k1", 1, "bytes=1048576 (1.00 MiB)", "12.5", "quantum expired"), None,
    )  # fmt: skip
    doc = json.loads(fmt.format(rec))
    assert doc["event"] == "revoke" and doc["level"] == "info"
    assert doc["client"] == "k1" and doc["evict"] == 1 and doc["bytes"] == 1048576
    assert doc["held_ms"] == 12.5 and doc["reason"] == "quantum expired"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", doc["ts"])
    assert doc["message"].startswith("revoke client=k1 evict=1")
    plain = json.loads(fmt.format(logging.LogRecord("x", logging.WARNING, "", 0, "hi", (), None)))
    assert plain == {"ts": plain["ts"], "level": "warning", "logger": "x", "message": "hi"}
    clash = json.loads(
        fmt.format(logging.LogRecord("x", logging.INFO, "", 0, "join level=3", (), None))
    )
    assert clash["level"] == "info" and clash["field_level"] == 3


def test_scheduler_cli_options(tmp_path: Path) -> None:
    app = SchedulerApp()
    app.initialize(
        [
            "--users-config", "/etc/gpushare/users.toml", "--user-key", "/etc/gpushare/user.key",
            "--metrics-port", "9464", "--metrics-address", "0.0.0.0", "--socket-group", "gpushare",
            "--log-format", "json",
        ]
    )  # fmt: skip
    cfg = app.config.GPUShareScheduler
    assert cfg.users_config == "/etc/gpushare/users.toml"
    assert cfg.user_key_file == "/etc/gpushare/user.key"
    assert cfg.metrics_port == 9464 and cfg.metrics_address == "0.0.0.0"
    assert cfg.socket_group == "gpushare"
    assert app.log_style == "json"
    assert all(isinstance(h.formatter, JsonFormatter) for h in app.log.handlers)


# --- the deploy/ files ----------------------------------------------------------------------

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_deploy_files_are_consistent() -> None:
    """The systemd unit's command line parses, and the example configs it names load."""
    import configparser
    import shlex

    from traitlets.config import PyFileConfigLoader

    from jupyter_gpushare.scheduler.shell.users import load_users_config

    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((DEPLOY / "systemd" / "gpushare-scheduler.service").read_text())
    service = unit["Service"]
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["RuntimeDirectory"] == "gpushare"
    assert "PrivateDevices" not in service  # NVML needs /dev/nvidia*
    argv = shlex.split(service["ExecStart"].replace("\\\n", " "))
    assert argv[1] == "scheduler"
    options = [a for a in argv[2:] if a != "--config" and not a.endswith(".py")]
    app = SchedulerApp()
    app.initialize(options)
    assert app.config.GPUShareScheduler.socket_path == "/run/gpushare/scheduler.sock"
    assert app.log_style == "json"
    assert os.path.basename(app.config.GPUShareScheduler.users_config) == "users.toml"

    cfg = PyFileConfigLoader("gpushare_config.py", path=str(DEPLOY)).load_config()
    assert cfg.GPUShareScheduler.socket_mode == 0o660
    assert cfg.GPUShareScheduler.socket_group == "gpushare"

    # Its groups carry members lists, so it loads on any machine (no system group needed).
    users = load_users_config(str(DEPLOY / "users.toml"))
    assert users.limits("alice", users.listed_groups("alice")).quota == 60 << 30
    assert users.is_admin("ops", None, users.listed_groups("ops"))


def test_sighup_reloads_and_logs_are_json(tmp_path: Path, sock_dir: str) -> None:
    """The real daemon: SIGHUP reloads (a bad file is rejected and the daemon keeps running),
    SIGTERM stops it, and every log line is one JSON object."""
    import signal
    import subprocess
    import sys
    import time

    users = tmp_path / "users.toml"
    users.write_text('[defaults]\nquota = "1GiB"\n')
    sock = os.path.join(sock_dir, "d.sock")
    log_path = tmp_path / "daemon.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    argv = [
        sys.executable, "-m", "jupyter_gpushare", "scheduler", "--socket", sock, "--no-nvml",
        "--users-config", str(users), "--log-format", "json",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_for(text: str, count: int = 1) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lines = [json.loads(line) for line in log_path.read_text().splitlines() if line]
            if sum(text in d["message"] for d in lines) >= count:
                return lines
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not logged:\n{log_path.read_text()}")

    try:
        wait_for("listening on")
        users.write_text('[defaults]\nquota = "lots"\n')
        proc.send_signal(signal.SIGHUP)
        lines = wait_for("reload failed")
        (failed,) = [d for d in lines if "reload failed" in d["message"]]
        assert failed["level"] == "error" and "lots" in failed["message"]
        assert proc.poll() is None  # still serving, with the old file
        users.write_text('[defaults]\nquota = "2GiB"\n')
        proc.send_signal(signal.SIGHUP)
        lines = wait_for("reloaded")
        access = [d for d in lines if d["message"].startswith("access: users config")]
        assert len(access) == 2 and "2.00 GiB" in access[-1]["message"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not os.path.exists(sock)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
