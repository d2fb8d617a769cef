"""Issue 22, A11, as real separate uids: info lines a peer causes are bounded per uid.

mallory cycles REQUEST → GRANT → RELEASED as fast as the scheduler answers: each cycle is a
``grant`` and a ``release`` line. Before, every one reached the log (2.9 MB/s in round two,
before the frame budget; still one line per frame after it). Now a uid's info lines are at most
``info_burst`` (300) a minute, then counted; alice's lines are hers and still logged.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
from local_users import open_to_everyone, run_as
from local_users import shim as _shim

from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync

CYCLES = 600


def _connect(path: str, client_id: str | None = None) -> socket.socket:
    """A connection; with ``client_id``, a shim's, welcomed on the GPU it makes known."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20.0)
    sock.connect(path)
    if client_id is not None:
        hello = {"pid": os.getpid(), "client_id": client_id, "device_uuid": "GPU-a11"}
        sock.sendall(encode(Message(MsgType.HELLO, {**hello, "device_total": 8 << 30})))
        read_message_sync(sock)  # WELCOME
    return sock


def _cycle(path: str, cycles: int) -> int:
    sock = _connect(path, "flood")
    grants = 0
    for _ in range(cycles):
        sock.sendall(encode(Message(MsgType.REQUEST, {"used_bytes": 1 << 20})))
        msg = read_message_sync(sock)
        grants += msg is not None and msg.type == MsgType.GRANT
        sock.sendall(encode(Message(MsgType.RELEASED, {"flag": 0})))
    sock.close()
    return grants


async def test_a11_a_peers_info_lines_are_bounded(
    local_users: Any, make_scheduler: Any, caplog: pytest.LogCaptureFixture
) -> None:
    mallory, alice = local_users("mallory"), local_users("alice")
    node = await make_scheduler(pool_size="4GiB")
    open_to_everyone(node)
    caplog.set_level("INFO")
    grants = await run_as(mallory, _cycle, node.socket_path, CYCLES, timeout=120)
    assert grants == CYCLES
    lines = [r.getMessage() for r in caplog.records]
    hers = [ln for ln in lines if "client=flood" in ln]
    assert len(hers) <= 300, len(hers)
    # alice's kernel, after the flood: its lines are logged.
    fields = {"client_id": "alice-k", "device_uuid": "GPU-a11"}
    await run_as(alice, _shim, node.socket_path, fields, 1 << 20, 0.2)
    assert any("join client=alice-k" in r.getMessage() for r in caplog.records)


def _place_many(path: str, count: int) -> int:
    """A shim that makes its GPU known, then ``count`` placements on one connection; how many
    were answered with a device."""
    shim, sock = _connect(path, "placer"), _connect(path)
    placed = 0
    for n in range(count):
        body = {"action": "place", "client": f"placed-{n}", "need": 1 << 20}
        sock.sendall(encode(Message(MsgType.CONTROL, {"body": body})))
        reply = read_message_sync(sock)
        placed += reply is not None and reply.type == MsgType.CONTROL_REPLY
    sock.close()
    shim.close()
    return placed


async def test_r3_a_peers_placements_are_logged_within_its_budget(
    local_users: Any, make_scheduler: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Round 3: ``place`` was logged at INFO outside the per-uid budget (11,056 lines, 4.1 MB,
    in 20 s). Now its lines are mallory's, at most ``info_burst`` a minute; alice's are logged."""
    mallory, alice = local_users("mallory"), local_users("alice")
    node = await make_scheduler(pool_size="4GiB", frames_per_second=0)
    open_to_everyone(node)
    caplog.set_level("INFO")
    placed = await run_as(mallory, _place_many, node.socket_path, CYCLES, timeout=120)
    assert placed == CYCLES
    hers = [r.getMessage() for r in caplog.records if "place client=placed-" in r.getMessage()]
    assert len(hers) <= 300, len(hers)
    fields = {"client_id": "alice-k", "device_uuid": "GPU-a11"}
    await run_as(alice, _shim, node.socket_path, fields, 1 << 20, 0.2)
    assert any("join client=alice-k" in r.getMessage() for r in caplog.records)
