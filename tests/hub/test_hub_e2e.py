"""End to end on JupyterHub: one node scheduler, two hub users, one uid.

A real JupyterHub (configurable-http-proxy, SimpleLocalProcessSpawner, DummyAuthenticator with a
password) configured by deploy/jupyterhub/jupyterhub_config.py, the file docs/operators/
jupyterhub.md shows; one node scheduler (``gpushare scheduler``) with the node's user key and
``token_uids`` = this uid, the uid every single-user server runs as here. Alice and Bob log in,
start their servers through the hub's REST API and a "Python 3 (GPU shared)" kernel each through
their server's REST API, and run a cell that uses the (stand-in) GPU. Then:

* both kernels are clients of the one scheduler, each under its hub user's name (the hub's
  GPUSHARE_USER / GPUSHARE_USER_TOKEN, checked by the scheduler);
* Alice's gpushare status shows her kernel in full (label, kernel id, memory) and Bob's only in
  the per-user sums (``others``: how many kernels, how much memory), never its id or label;
* Alice cannot release Bob's kernel: her server answers 404 (her view has no such kernel, and it
  does not confirm that another user's kernel of that id exists); the scheduler, asked directly
  with her token, refuses with ``forbidden``;
* Bob can release his own.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hub_helpers import Hub, find_or_install_chp, wait_for

from jupyter_gpushare.identity import generate_key, load_key, user_token
from jupyter_gpushare.protocol import ErrorCode
from jupyter_gpushare.scheduler_client import SchedulerClient, SchedulerError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "jupyter"))
from openapi_helpers import openapi_schema  # noqa: E402
from provisioner_helpers import GPU_PRELUDE  # noqa: E402

MiB = 1 << 20

#: The cell: a context on the stand-in driver (tests/jupyter's GPU_PRELUDE), 64 MiB and one
#: launch: the shim says HELLO and asks the scheduler for the device.
CELL = (
    GPU_PRELUDE
    + """
import json, os
rc, _ = alloc(64 << 20)
assert rc == 0, rc
assert launch(1000) == 0
assert sync() == 0
print(json.dumps({k: os.environ.get(k) for k in ("GPUSHARE_USER", "GPUSHARE_CLIENT_ID")}))
"""
)


@pytest.fixture
def hub_setup(native_build: Any, harness: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    shim = native_build.require_shim()
    chp = find_or_install_chp()
    state = Path(tempfile.mkdtemp(prefix="gshub-", dir="/tmp"))
    key_file = state / "user.key"
    generate_key(str(key_file))
    uid = os.getuid()
    scheduler = harness.scheduler(
        pool="1GiB",
        quantum=60.0,
        args=(
            f"--GPUShareScheduler.user_key_file={key_file}",
            f"--GPUShareScheduler.token_uids={uid}",
        ),
    )
    env = {
        # The stand-in driver and this checkout's build of the shim (the provisioner finds it
        # through GPUSHARE_LIBRARY); kernels inherit the server's environment.
        "LD_LIBRARY_PATH": os.pathsep.join(
            filter(None, [str(native_build.fake_dir), os.environ.get("LD_LIBRARY_PATH")])
        ),
        "GPUSHARE_LIBRARY": str(shim),
        "GPUSHARE_SOCKET": str(harness.socket_path),
        "GPUSHARE_FAKE_DEVICE_TOTAL": "4GiB",
        "GPUSHARE_CONTEXT_BYTES": str(16 * MiB),
        "GPUSHARE_IDLE_SECONDS": "0",
        "GPUSHARE_LOG": "info",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    hub = Hub(state, chp=chp, key_file=key_file, socket_path=harness.socket_path, env=env)
    ok = False
    try:
        yield {"hub": hub, "scheduler": scheduler, "key": load_key(str(key_file))}
        ok = True
    finally:
        hub.stop()
        if not ok:
            print(hub.describe())
            print(f"--- scheduler log ---\n{scheduler.log}")
        for name in ("jupyterhub.log",):
            with_log = state / name
            if with_log.exists():
                shutil.copyfile(with_log, tmp_path / name)
        shutil.rmtree(state, ignore_errors=True)


def clients(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for d in doc.get("devices", []) for c in d.get("clients", [])}


def scheduler_as(setup: dict[str, Any], user: str) -> SchedulerClient:
    """A control connection to the node scheduler speaking for ``user`` (with the hub's token)."""
    sched = setup["scheduler"]
    return SchedulerClient(
        str(sched.socket_path), timeout=10, user=user, token=user_token(setup["key"], user)
    )


def test_two_hub_users_share_one_node_scheduler(hub_setup: dict[str, Any]) -> None:
    t0 = time.monotonic()
    hub: Hub = hub_setup["hub"]
    alice, bob = hub.login("alice"), hub.login("bob")
    # A wrong password is refused: the authenticator is the hub's, not a pass-through.
    with pytest.raises(AssertionError, match="answered 403"):
        hub.login("alice", password="wrong")
    for user in (alice, bob):
        user.start_server()
    for user in (alice, bob):
        user.wait_server()
    kernels: dict[str, str] = {}
    for user in (alice, bob):
        kernels[user.name] = user.start_kernel()
    for user in (alice, bob):
        out = user.execute(kernels[user.name], CELL)
        assert f'"GPUSHARE_USER": "{user.name}"' in out, out

    # Both kernels are clients of the one node scheduler, each under its hub user's name: each
    # user's view (through their token) has their own kernel, and the other user in the sums.
    def registered(user: str) -> dict[str, Any] | None:
        doc = scheduler_as(hub_setup, user).status_sync()
        other = "bob" if user == "alice" else "alice"
        own = [c for c in clients(doc).values() if c["id"].split("#")[0] == kernels[user]]
        others = {o["user"]: o for d in doc["devices"] for o in d.get("others", [])}
        ok = own and own[0]["user"] == user and others.get(other, {}).get("clients") == 1
        return doc if ok else None

    for name in ("alice", "bob"):
        wait_for(f"{name}'s kernel in the scheduler", partial(registered, name), 30, hub.describe)
    a_kernel, b_kernel = kernels["alice"], kernels["bob"]

    # Alice's gpushare status, from her server: her kernel in full, Bob's only in the sums.
    doc = alice.status()
    jsonschema.validate(doc, openapi_schema("Status"))  # docs/rest-api.yaml describes it
    assert doc["scheduler"]["mode"] == "node", doc["scheduler"]
    assert doc["identity"] == {"user": "alice", "admin": False, "by": "token"}, doc["identity"]
    assert doc["viewer"] == {"name": "alice", "admin": False}, doc["viewer"]
    [device] = doc["devices"]
    [mine] = device["clients"]
    assert mine["id"].split("#")[0] == a_kernel and mine["user"] == "alice", mine
    assert mine["redacted"] is False and mine["label"], mine
    assert mine["jupyter"]["local"] is True and mine["jupyter"]["kernel_id"] == a_kernel, mine
    assert mine["jupyter"]["kernel_name"] == "python3-gpushare", mine
    assert mine["used_bytes"] >= 64 * MiB, mine
    [theirs] = device["others"]
    assert theirs["user"] == "bob" and theirs["clients"] == 1, theirs
    assert theirs["used_bytes"] >= 64 * MiB, theirs  # how much the others use is no secret
    assert b_kernel not in json.dumps(doc), "Bob's kernel id leaked into Alice's status"

    # Bob's view is the mirror image.
    [bdev] = bob.status()["devices"]
    assert [c["jupyter"]["kernel_id"] for c in bdev["clients"]] == [b_kernel], bdev
    assert [(o["user"], o["clients"]) for o in bdev["others"]] == [("alice", 1)], bdev
    # Everything the servers and kernels sent so far (HELLOs, busy/idle, status reads) was
    # accepted under their hub users: nothing was refused.
    log = hub_setup["scheduler"].log
    assert "forbidden" not in log, log
    sched = hub_setup["scheduler"]
    # A second cell each: the first one's busy can reach the server before the kernel's shim
    # has said HELLO (the shim registers on the cell's first CUDA call), and be answered
    # "no client"; by now both kernels are registered.
    for user in (alice, bob):
        user.execute(kernels[user.name], "1 + 1")
    for user in ("alice", "bob"):  # each server tells the scheduler its kernel's cell ended
        # The server's watcher sends busy/idle from a queue of its own: the line may come a
        # moment after the cell's reply (it once came after this check, so wait for it).
        line = f"control kernel_state client={kernels[user]} by {user}"
        wait_for(f"{user}'s kernel_state in the scheduler log",
                 lambda line=line: line in sched.log, 10, lambda: sched.log)  # fmt: skip

    # Alice cannot release Bob's kernel. Her server answers 404: her status has no such kernel,
    # and the server does not tell her whether another user's kernel of that id exists. The
    # scheduler itself, asked with her token, says not_found: another user's client ids are not
    # confirmed to exist (docs/protocol.md).
    r = alice.api("POST", f"gpushare/api/kernels/{b_kernel}/release")
    assert r.status_code == 404, (r.status_code, r.text)
    with pytest.raises(SchedulerError) as refused:
        scheduler_as(hub_setup, "alice").control_sync("release", client=b_kernel)
    assert refused.value.code == int(ErrorCode.NOT_FOUND), refused.value
    # Bob can.
    reply = bob.json("POST", f"gpushare/api/kernels/{b_kernel}/release")
    assert reply.get("ok") is True, reply
    assert time.monotonic() - t0 < 120
