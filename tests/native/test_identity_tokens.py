"""The real shim proves its user with GPUSHARE_USER_TOKEN (HELLO field 26) to a node scheduler
that shares this uid among users (``token_uids``), end to end with the stand-in driver."""

from __future__ import annotations

import os

from jupyter_gpushare.identity import generate_key, load_key, user_token

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
