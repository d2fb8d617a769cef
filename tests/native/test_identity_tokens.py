"""The real shim proves its user with GPUSHARE_USER_TOKEN (HELLO field 26) to a node scheduler
that shares this uid among users (``token_uids``), and its kernel id with GPUSHARE_KERNEL_SECRET
(HELLO field 46), end to end with the stand-in driver."""

from __future__ import annotations

import asyncio
import os

from jupyter_gpushare.identity import generate_key, load_key, user_token
from jupyter_gpushare.scheduler.shell.kernel_ids import secret_digest
from jupyter_gpushare.scheduler_client import SchedulerClient

MiB = 1 << 20


def test_shim_sends_its_token_and_gets_its_users_ceiling(harness):
    key_path = harness.tmp / "user.key"
    generate_key(str(key_path))
    key = load_key(str(key_path))
    users = harness.tmp / "users.toml"
    users.write_text('[defaults]\nquota = "2GiB"\n[users.alice]\nquota = "256MiB"\n')
    config = harness.tmp / "node_config.py"
    config.write_text(f"c.GPUShareScheduler.token_uids = [{os.getuid()}]\n")
    sched = harness.scheduler(
        args=("--config", str(config), "--users-config", str(users), "--user-key", str(key_path))
    )
    common = {"context_bytes": 64 * MiB, "memory_limit": "1GiB"}

    # A valid token: registered as alice, and alice's 256 MiB ceiling beats the 1 GiB asked.
    ok = harness.run(
        "status", MiB, client_id="alice-k", user="alice", user_token=user_token(key, "alice"),
        **common,
    ).ok()  # fmt: skip
    st = ok.event("status")["status"]
    assert st["connected"] == 1
    assert st["quota_bytes"] == 256 * MiB
    log = sched.wait_log("join client=alice-k")
    assert "join client=alice-k device=" in log and " user=alice " in log

    # A token made for someone else: refused; the process runs unshared and says why.
    forged = harness.run(
        "status", MiB, client_id="mallory-k", user="alice", user_token=user_token(key, "bob"),
        **common,
    ).ok()  # fmt: skip
    assert forged.event("status")["status"]["connected"] == 0
    assert "the token for user 'alice' is not valid" in forged.stderr
    # No token at all (a kernel started outside the hub on the shared uid): refused too.
    bare = harness.run("status", MiB, client_id="bare-k", user="alice", **common).ok()
    assert bare.event("status")["status"]["connected"] == 0
    assert "GPUSHARE_USER_TOKEN" in bare.stderr
    log = sched.log
    assert "join client=mallory-k" not in log and "join client=bare-k" not in log


def test_shim_sends_its_kernel_secret_and_keeps_its_bound_id(harness):
    """GPUSHARE_KERNEL_SECRET (HELLO field 46): the shim with the secret its id was bound to
    gets the id; the same id with another secret gets ``<id>#<pid>`` (docs/protocol.md,
    "Kernel ids")."""
    sched = harness.scheduler()
    secret = "a1" * 32
    client = SchedulerClient(str(harness.socket_path), timeout=10.0)
    reply = asyncio.run(
        client.control("bind_kernel", client="kern-1", secret_sha256=secret_digest(secret))
    )
    assert reply["ok"] is True
    other = harness.run("status", MiB, client_id="kern-1", kernel_secret="b2" * 32).ok()
    assert other.event("status")["status"]["connected"] == 1
    assert "join client=kern-1#" in sched.wait_log("join client=kern-1#")
    harness.run("status", MiB, client_id="kern-1", kernel_secret=secret).ok()
    assert "join client=kern-1 device=" in sched.wait_log("join client=kern-1 device=")
