"""The ``%gpushare`` magic: rendering (no kernel), and in real kernels under the shim, loaded by
the provisioner without the user doing anything."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from provisioner_helpers import (
    CONTEXT,
    GPU_PRELUDE,
    MiB,
    async_wait_for,
    execute,
    scheduler_clients,
)

from jupyter_gpushare.magic import HELP, NOT_SHARED, GPUShareReport, gpushare_command
from jupyter_gpushare.scheduler_view import NO_GPU

STATUS = {
    "version": 1,
    "state": "waiting",
    "connected": True,
    "evicted": False,
    "used_bytes": 3 << 30,
    "managed_bytes": (3 << 30) - CONTEXT,
    "pinned_bytes": CONTEXT,
    "evicted_bytes": 0,
    "quota_bytes": 8 << 30,
    "pool_bytes": 24 << 30,
    "gated_calls": 10,
    "waits": 3,
    "wait_seconds": 12.5,
    "current_wait_seconds": 4.25,
    "holding_seconds": 125.0,
    "idle_seconds": 0.0,
    "client_id": "k-1",
    "socket_path": "/nonexistent/s.sock",
    "device_uuid": "GPU-1",
    "library_version": "0.1.0",
}
DEVICE = {
    "uuid": "GPU-1",
    "name": "NVIDIA H100",
    "mode": "turns",
    "clients": [{}, {}],
    "queue": ["k-1"],
    "pool_bytes": 24 << 30,
    "resident_bytes": 20 << 30,
    "quantum_ms": 5000,
}


# ---------------------------------------------------------------------------------------------
# Without a kernel


def test_report_waiting_plain_and_html() -> None:
    entry = {"id": "k-1", "queue_position": 2, "label": "<b>train</b>.ipynb", "gpu_seconds": 120}
    report = GPUShareReport(dict(STATUS), entry, DEVICE)
    text = repr(report)
    assert report.state == "waiting"
    assert "waiting for the GPU (4.2 s, position 2 in the queue)" in text
    assert "3.00 GiB used of 8.00 GiB quota (pool 24.00 GiB)" in text
    assert "all resident on the GPU" in text
    assert "2 min 05 s held (scheduler: 2 min 00 s)" in text
    assert "3 waits, 12.5 s in total" in text
    assert "NVIDIA H100 (GPU-1), turns mode, 2 kernels, 1 waiting" in text
    assert "quantum 5 s" in text
    html = report._repr_html_()
    assert "waiting for the GPU" in html and "NVIDIA H100" in html
    assert "<b>train</b>" not in html and "&lt;b&gt;train&lt;/b&gt;.ipynb" in html
    assert "width:37.5%" in html  # 3 of 8 GiB
    # Colours are JupyterLab's theme variables (light and dark themes), not fixed ones.
    assert "color:var(--jp-warn-color1" in html and not re.search(r"#[0-9a-fA-F]{3,6}\b", html)
    # On a node with several GPUs the device line says which one the kernel is on.
    on_gpu1 = repr(GPUShareReport(dict(STATUS), entry, dict(DEVICE, index=1)))
    assert "device     GPU 1: NVIDIA H100 (GPU-1), turns mode" in on_gpu1, on_gpu1


def test_report_evicted_and_without_scheduler() -> None:
    status = dict(STATUS, state="idle", evicted=True, evicted_bytes=2 << 30)
    report = GPUShareReport(status, None, None, "no answer from the scheduler (gone)")
    text = str(report)
    assert report.state == "evicted"
    assert "idle, memory evicted to the host" in text
    assert "2.00 GiB evicted to the host, 1.00 GiB resident" in text
    assert "no answer from the scheduler (gone)" in text


def test_outside_the_shim() -> None:
    """This test process does not run under the shim: every command says so clearly."""
    report = gpushare_command("status")
    assert isinstance(report, GPUShareReport) and report.status is None
    assert repr(report) == NOT_SHARED and "install-kernelspec" in report._repr_html_()
    assert gpushare_command("") is not None and repr(gpushare_command("")) == NOT_SHARED
    assert gpushare_command("release") == NOT_SHARED
    assert gpushare_command("quota") == NOT_SHARED
    assert gpushare_command("--help") == HELP
    unknown = gpushare_command("frobnicate")
    assert (
        isinstance(unknown, str) and "unknown command 'frobnicate'" in unknown and HELP in unknown
    )


def test_report_counts_other_users_in_a_filtered_view() -> None:
    """A node scheduler shows a non-admin only their own kernels and the others summed per user:
    the device line still counts every kernel and every waiter."""
    filtered = {
        **DEVICE,
        "clients": [{}],
        "queue": ["k-1"],
        "queue_users": ["alice", "bob", "bob"],
        "others": [{"user": "bob", "clients": 3, "running": 1, "waiting": 2}],
    }
    text = repr(GPUShareReport(dict(STATUS), {}, filtered))
    assert "4 kernels, 3 waiting" in text


# ---------------------------------------------------------------------------------------------
# In kernels


async def test_status_release_and_quota_in_a_kernel(harness: Any, kernels: Any) -> None:
    sched = harness.scheduler(pool="1GiB", quantum=5.0)
    km, kc = await kernels.start({"memory_limit": "128MiB"})
    kid = km.kernel_id

    # Loaded by the provisioner: no %load_ext. Before any GPU call the shim is inactive.
    before = (await execute(kc, "%gpushare status")).ok()
    assert "inactive (no CUDA context yet)" in before.text, before.describe()
    # This scheduler has no NVML and no kernel has reported a GPU yet: plain words say so.
    assert f"device     {NO_GPU}" in before.text, before.describe()

    (await execute(kc, GPU_PRELUDE + "\nprint(alloc(64 << 20)[0], launch(1000), sync())")).ok()
    cell = (await execute(kc, "%gpushare")).ok()
    text, html = cell.text, cell.html
    assert "running (holds the GPU)" in text, cell.describe()
    assert f"{(64 * MiB + CONTEXT) >> 20}.00 MiB used of 128.00 MiB quota (pool 1.00 GiB)" in text
    assert "all resident on the GPU (64.00 MiB evictable, 16.00 MiB pinned)" in text
    assert "1 wait" in text
    assert "gpushare stand-in GPU" in text and "shared mode, 1 kernel, 0 waiting" in text
    assert kid in text and str(kernels.workdir) in text
    assert "running (holds the GPU)" in html and kid in html and "<table>" in html

    released = (await execute(kc, "%gpushare release")).ok()
    assert "released the GPU" in released.stdout, released.describe()

    def idle() -> bool:
        return any(c["id"] == kid and c["state"] == "idle" for c in scheduler_clients(sched))

    await async_wait_for(idle, timeout=30, what="the scheduler to see the release")
    after = (await execute(kc, "%gpushare status")).ok()
    assert "idle (does not hold the GPU)" in after.text, after.describe()

    shown = (await execute(kc, "%gpushare quota")).ok()
    assert "memory quota 128.00 MiB (pool 1.00 GiB); 80.00 MiB used" in shown.stdout

    changed = (await execute(kc, "%gpushare quota 256MiB")).ok()
    assert "128.00 MiB -> 256.00 MiB" in changed.stdout, changed.describe()
    (client,) = await asyncio.to_thread(scheduler_clients, sched)
    assert client["quota_bytes"] == 256 * MiB

    async def shim_quota() -> int:
        probe = "from jupyter_gpushare import shim; print(shim.read_status()['quota_bytes'])"
        return int((await execute(kc, probe)).ok().stdout)

    for _ in range(100):
        if await shim_quota() == 256 * MiB:
            break
        await asyncio.sleep(0.1)
    assert await shim_quota() == 256 * MiB
    # The new quota holds: 128 MiB more now fits.
    more = (await execute(kc, "print(alloc(128 << 20)[0])")).ok()
    assert more.stdout.strip() == "0", more.describe()

    bad = (await execute(kc, "%gpushare quota lots")).ok()
    assert "invalid size 'lots'" in bad.stdout
    helped = (await execute(kc, "%gpushare --help")).ok()
    assert "%gpushare release" in helped.stdout


async def test_status_without_a_scheduler(kernels: Any) -> None:
    """No scheduler at the socket: the kernel runs unshared, and the magic says so."""
    _km, kc = await kernels.start()
    (await execute(kc, GPU_PRELUDE + "\nprint(alloc(16 << 20)[0], launch(1000), sync())")).ok()
    cell = (await execute(kc, "%gpushare status")).ok()
    assert "unshared (no scheduler reachable" in cell.text, cell.describe()
    assert "no answer from the scheduler" in cell.text
    released = (await execute(kc, "%gpushare release")).ok()
    assert "not connected to a scheduler" in released.stdout
    quota = (await execute(kc, "%gpushare quota 1GiB")).ok()
    assert "cannot set the quota" in quota.stdout


async def test_quota_over_the_users_ceiling_is_refused(harness: Any, kernels: Any) -> None:
    """A hub user (a token on a shared uid) may not raise a kernel's quota past the ceiling
    that the operator's users config sets; the magic says so, and the quota stays."""
    import os

    from jupyter_gpushare.identity import generate_key, load_key, user_token

    key_path = harness.tmp / "user.key"
    generate_key(str(key_path))
    users = harness.tmp / "users.toml"
    users.write_text('[defaults]\nquota = "192MiB"\n')
    config = harness.tmp / "node_config.py"
    config.write_text(f"c.GPUShareScheduler.token_uids = [{os.getuid()}]\n")
    harness.scheduler(
        pool="1GiB",
        args=("--config", str(config), "--users-config", str(users), "--user-key", str(key_path)),
    )
    token = user_token(load_key(str(key_path)), "alice")
    env = kernels.kernel_env(GPUSHARE_USER="alice", GPUSHARE_USER_TOKEN=token)
    _km, kc = await kernels.start({"memory_limit": "128MiB"}, env=env)
    (await execute(kc, GPU_PRELUDE + "\nprint(alloc(16 << 20)[0], launch(1000), sync())")).ok()

    refused = (await execute(kc, "%gpushare quota 256MiB")).ok()
    assert "cannot set the quota: forbidden" in refused.stdout, refused.describe()
    assert "over the ceiling of 192.00 MiB" in refused.stdout
    allowed = (await execute(kc, "%gpushare quota 160MiB")).ok()
    assert "128.00 MiB -> 160.00 MiB" in allowed.stdout, allowed.describe()
    status = (await execute(kc, "%gpushare status")).ok()
    assert "160.00 MiB quota" in status.text, status.describe()
