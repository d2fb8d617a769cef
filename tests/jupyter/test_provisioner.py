"""GPUShareProvisioner: real ipykernel kernels launched through jupyter_client with the provisioner,
running the real shim in front of the stand-in driver, with a real scheduler subprocess."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.kernelspec import KernelSpec
from jupyter_client.manager import AsyncKernelManager
from jupyter_client.provisioning import KernelProvisionerFactory
from provisioner_helpers import (
    CONTEXT,
    GPU_PRELUDE,
    MiB,
    async_wait_for,
    execute,
    scheduler_clients,
)
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpushare.provisioner import (
    MAGIC_EXTENSION,
    PROVISIONER_NAME,
    GPUShareProvisioner,
    is_ipykernel_argv,
)

ENV_PROBE = (
    "import os, sys, json\n"
    "print(json.dumps({'env': {k: v for k, v in os.environ.items()"
    " if k.startswith(('GPUSHARE_', 'LD_PRELOAD'))}, 'argv': sys.argv,"
    " 'extensions': sorted(get_ipython().extension_manager.loaded)}))"
)


def _spec(config: dict[str, Any] | None = None) -> KernelSpec:
    return KernelSpec(
        argv=["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        display_name="t",
        language="python",
        metadata={
            "kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": config or {}}
        },
    )


# ---------------------------------------------------------------------------------------------
# Without kernels


def test_ipykernel_detection() -> None:
    assert is_ipykernel_argv(["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"])
    assert is_ipykernel_argv(["/usr/bin/python3", "-m", "ipykernel", "-f", "x"])
    assert is_ipykernel_argv(["/env/bin/python", "-mipykernel_launcher"])
    assert is_ipykernel_argv(["/env/bin/ipykernel_launcher", "-f", "x"])
    assert not is_ipykernel_argv(["R", "--slave", "-e", "IRkernel::main()", "--args", "x"])
    assert not is_ipykernel_argv(["python", "-m", "xeus_python"])
    assert not is_ipykernel_argv([])


def test_magic_is_added_once_and_only_to_ipykernel() -> None:
    prov = GPUShareProvisioner(kernel_id="k", kernel_spec=_spec())
    argv = ["python", "-m", "ipykernel_launcher", "-f", "c.json"]
    once = prov._kernel_command(argv)
    assert once == [*argv, f"--InteractiveShellApp.extra_extensions={MAGIC_EXTENSION}"]
    assert prov._kernel_command(once) == once
    assert prov._kernel_command([*argv, "--ext", MAGIC_EXTENSION]) == [
        *argv,
        "--ext",
        MAGIC_EXTENSION,
    ]
    other = ["R", "-e", "IRkernel::main()"]
    assert prov._kernel_command(other) == other
    prov.load_magic = False
    assert prov._kernel_command(argv) == argv


def test_registered_and_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point is found; server config applies; kernel.json's config wins over it."""
    monkeypatch.setenv("GPUSHARE_SOCKET", "/tmp/from-the-server-extension.sock")
    monkeypatch.setenv("JUPYTERHUB_USER", "hubuser")
    factory = KernelProvisionerFactory.instance()
    assert factory.is_provisioner_available(_spec())
    config = Config()
    config.GPUShareProvisioner.memory_limit = "8GiB"
    config.GPUShareProvisioner.weight = 3.0
    km = AsyncKernelManager(config=config)
    prov = factory.create_provisioner_instance("kid", _spec({"weight": 2}), parent=km)
    assert isinstance(prov, GPUShareProvisioner)
    assert prov.memory_limit == "8GiB" and prov.quota_bytes == 8 << 30  # the server's
    assert prov.weight == 2.0  # kernel.json's
    assert prov.socket == "/tmp/from-the-server-extension.sock"
    assert prov.user == "hubuser"
    prov = factory.create_provisioner_instance(
        "kid", _spec({"memory_limit": 1 << 30, "socket": "/s.sock"}), parent=km
    )
    assert prov.quota_bytes == 1 << 30 and prov.socket == "/s.sock"
    monkeypatch.delenv("GPUSHARE_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    prov = GPUShareProvisioner(kernel_id="k", kernel_spec=_spec())
    from jupyter_gpushare.paths import default_socket_path

    assert prov.socket == default_socket_path()
    assert prov.quota_bytes == 0


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(TraitError, match="invalid size"):
        GPUShareProvisioner(kernel_id="k", kernel_spec=_spec(), memory_limit="lots")
    with pytest.raises(TraitError, match="positive"):
        GPUShareProvisioner(kernel_id="k", kernel_spec=_spec(), weight=0)


def test_label(tmp_path: Path) -> None:
    prov = GPUShareProvisioner(kernel_id="k", kernel_spec=_spec())
    assert prov._label_for({"JPY_SESSION_NAME": "nb/train.ipynb"}, "/x") == "nb/train.ipynb"
    assert prov._label_for({}, "/work/dir") == "/work/dir"
    assert prov._label_for({}, None) == os.getcwd()
    prov.label = "fixed"
    assert prov._label_for({"JPY_SESSION_NAME": "a.ipynb"}, "/x") == "fixed"


async def test_missing_shim_is_a_clear_error(
    kernels: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUSHARE_LIBRARY", str(tmp_path / "nowhere" / "libgpushare.so"))
    with pytest.raises(RuntimeError, match=r"cannot start a GPU-shared kernel: GPUSHARE_LIBRARY="):
        await kernels.start()


# ---------------------------------------------------------------------------------------------
# Real kernels


async def test_kernel_environment(
    harness: Any, kernels: Any, shim_library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JUPYTERHUB_USER", "hubuser")
    env = kernels.kernel_env(LD_PRELOAD="libm.so.6", JPY_SESSION_NAME="notebooks/train.ipynb")
    km, kc = await kernels.start({"memory_limit": "256MiB", "weight": 2.5}, env=env)
    probe = (await execute(kc, ENV_PROBE)).ok().json()
    got = probe["env"]
    # The shim is appended to what was preloaded, never replacing it.
    assert got["LD_PRELOAD"] == f"libm.so.6:{shim_library}"
    assert got["GPUSHARE_CLIENT_ID"] == km.kernel_id
    assert got["GPUSHARE_SOCKET"] == str(harness.socket_path)
    assert got["GPUSHARE_MEMORY_LIMIT"] == str(256 * MiB)
    assert got["GPUSHARE_WEIGHT"] == "2.5"
    assert got["GPUSHARE_USER"] == "hubuser"
    assert got["GPUSHARE_LABEL"] == "notebooks/train.ipynb"
    # Its own secret, which its id is bound to (scheduler/shell/kernel_ids.py).
    assert re.fullmatch(r"[0-9a-f]{64}", got["GPUSHARE_KERNEL_SECRET"])
    # The magic is loaded without the user doing anything.
    assert MAGIC_EXTENSION in probe["extensions"]
    assert f"--InteractiveShellApp.extra_extensions={MAGIC_EXTENSION}" in probe["argv"]
    # The shim is loaded in the kernel process (its status API answers).
    loaded = "from jupyter_gpushare import shim; print(shim.read_status()['state'])"
    assert (await execute(kc, loaded)).ok().stdout.strip() == "inactive"


async def test_label_defaults_to_the_working_directory(kernels: Any) -> None:
    _km, kc = await kernels.start()
    probe = (await execute(kc, ENV_PROBE)).ok().json()
    assert probe["env"]["GPUSHARE_LABEL"] == str(kernels.workdir)
    assert "GPUSHARE_MEMORY_LIMIT" not in probe["env"]


async def test_quota_from_kernel_json_reaches_the_shim(harness: Any, kernels: Any) -> None:
    sched = harness.scheduler(pool="1GiB", quantum=5.0)
    km, kc = await kernels.start({"memory_limit": "128MiB"})
    (await execute(kc, GPU_PRELUDE)).ok()
    ok = (await execute(kc, "print(alloc(64 << 20)[0], launch(1000), sync())")).ok()
    assert ok.stdout.split() == ["0", "0", "0"]
    over = await execute(
        kc, "import sys, time\nrc = alloc(128 << 20)[0]\nprint(rc)\ntime.sleep(0.5)"
    )
    assert over.ok().stdout.split() == ["2"], over.describe()  # CUDA_ERROR_OUT_OF_MEMORY
    assert "gpushare: out of memory" in over.stderr, over.describe()
    assert "over its quota of 128.00 MiB" in over.stderr, over.describe()
    (client,) = await asyncio.to_thread(scheduler_clients, sched)
    assert client["id"] == km.kernel_id
    assert client["quota_bytes"] == 128 * MiB
    assert client["used_bytes"] == 64 * MiB + CONTEXT


async def test_shutdown_and_restart_leave_no_stale_client(harness: Any, kernels: Any) -> None:
    sched = harness.scheduler(pool="1GiB", quantum=5.0)
    km, kc = await kernels.start()
    kid = km.kernel_id
    (await execute(kc, GPU_PRELUDE + "\nprint(alloc(200 << 20)[0], launch(300000), sync())")).ok()
    (old,) = await asyncio.to_thread(scheduler_clients, sched)
    assert old["id"] == kid and old["used_bytes"] == 200 * MiB + CONTEXT
    assert old["gpu_seconds"] > 0.2
    old_pid = old["pid"]

    # Work still queued on the device when the restart comes: the shim synchronises and says
    # goodbye before the process ends.
    (await execute(kc, "print(launch(1_000_000))")).ok()
    log_mark = len(sched.log)
    await km.restart_kernel()
    await kc.wait_for_ready(timeout=120)
    log = sched.wait_log(f"goodbye client={kid}", timeout=30, after=log_mark)
    assert f"leave client={kid} (goodbye)" in log[log_mark:]
    assert await asyncio.to_thread(scheduler_clients, sched) == []

    # The restarted kernel registers under its (same) kernel id, as a new client with no usage;
    # its id was bound to a secret at each start (scheduler/shell/kernel_ids.py).
    assert sched.log.count(f"bind_kernel client={kid} ") == 2
    (await execute(kc, GPU_PRELUDE + "\nprint(alloc(32 << 20)[0], launch(1000), sync())")).ok()
    (new,) = await asyncio.to_thread(scheduler_clients, sched)
    assert new["id"] == kid, new
    assert new["pid"] != old_pid
    assert new["used_bytes"] == 32 * MiB + CONTEXT
    assert new["gpu_seconds"] < old["gpu_seconds"]
    assert new["wait_seconds"] < 1.0

    await km.shutdown_kernel()
    await async_wait_for(
        lambda: scheduler_clients(sched) == [], timeout=30, what="the kernel to leave"
    )
    assert f"leave client={kid} (goodbye)" in sched.log.split(f"join client={kid}")[-1]


async def test_kill_gives_the_shim_a_goodbye(harness: Any, kernels: Any) -> None:
    """shutdown_kernel(now=True) skips the shutdown request: the provisioner still sends SIGTERM
    first, and the shim synchronises and says goodbye."""
    sched = harness.scheduler(pool="1GiB", quantum=5.0)
    km, kc = await kernels.start()
    kid = km.kernel_id
    (await execute(kc, GPU_PRELUDE + "\nprint(alloc(8 << 20)[0], launch(200000))")).ok()
    await km.shutdown_kernel(now=True)
    sched.wait_log(f"leave client={kid} (goodbye)", timeout=30)
    assert await asyncio.to_thread(scheduler_clients, sched) == []


async def test_stale_client_is_awaited_before_a_launch(
    harness: Any, kernels: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """While another live process holds the kernel's id, the provisioner waits (bounded) and
    warns; once it is gone the check passes at once."""
    sched = harness.scheduler(pool="1GiB", quantum=5.0)
    holder = harness.spawn(
        "hold", 60.0, 8 * MiB, 20000, client_id="kid-stale", context_bytes=CONTEXT, idle_seconds=0
    )
    holder.wait_event("first_launch", 30)
    prov = GPUShareProvisioner(
        kernel_id="kid-stale",
        kernel_spec=_spec(),
        socket=str(harness.socket_path),
        stale_client_timeout=1.0,
    )
    caplog.set_level(logging.WARNING)
    t0 = time.monotonic()
    await prov._wait_for_stale_client()
    assert 0.9 < time.monotonic() - t0 < 10
    assert "still lists a client kid-stale" in caplog.text
    holder.kill()
    await async_wait_for(lambda: scheduler_clients(sched) == [], timeout=30)
    t0 = time.monotonic()
    await prov._wait_for_stale_client()
    assert time.monotonic() - t0 < 0.9
    # No scheduler at all: no wait either.
    sched.stop()
    t0 = time.monotonic()
    await prov._wait_for_stale_client()
    assert time.monotonic() - t0 < 0.9


async def test_interrupt_while_waiting_for_the_gpu(harness: Any, kernels: Any) -> None:
    """A cell blocked at the gate (another process holds the device, both do not fit the pool)
    is interrupted like any cell: KeyboardInterrupt within a couple of seconds, and the kernel
    stays usable."""
    sched = harness.scheduler(pool="1GiB", quantum=60.0)
    holder = harness.spawn(
        "hold", 120.0, 640 * MiB, 20000, client_id="holder", context_bytes=CONTEXT, idle_seconds=0
    )
    holder.wait_event("first_launch", 30)
    km, kc = await kernels.start()
    kid = km.kernel_id
    (await execute(kc, GPU_PRELUDE + "\nprint(alloc(640 << 20)[0])")).ok()

    cell = asyncio.ensure_future(execute(kc, "rc = launch(1000)\nprint('launched', rc)", 120))

    def waiting() -> bool:
        return any(c["id"] == kid and c["state"] == "waiting" for c in scheduler_clients(sched))

    await async_wait_for(waiting, timeout=30, what="the kernel to wait for the GPU")
    await asyncio.sleep(0.5)
    assert not cell.done()
    interrupted = time.monotonic()
    await km.interrupt_kernel()
    result = await asyncio.wait_for(cell, 30)
    elapsed = time.monotonic() - interrupted
    assert result.status == "error", result.describe()
    assert result.error and result.error["ename"] == "KeyboardInterrupt", result.describe()
    assert "launched" not in result.stdout
    assert elapsed < 3.0, f"the interrupt took {elapsed:.1f}s"

    # The kernel is usable: Python runs, and once the holder is gone the GPU is granted.
    assert (await execute(kc, "print(6 * 7)")).ok().stdout.strip() == "42"
    holder.signal(signal.SIGTERM)
    holder.finish(60)
    done = (await execute(kc, "print(launch(1000), sync())", 60)).ok()
    assert done.stdout.split() == ["0", "0"]
    probe_code = (
        "import json\nfrom jupyter_gpushare import shim\nprint(json.dumps(shim.read_status()))"
    )
    probe = (await execute(kc, probe_code)).ok().json()
    assert probe["state"] == "holding" and probe["waits"] >= 1


async def test_under_jupyter_servers_kernel_manager(
    kernels: Any, tmp_path: Path, shim_library: Path
) -> None:
    """Started as jupyter_server starts a notebook's kernel (a session's JPY_SESSION_NAME is the
    notebook's OS path, the cwd its directory): the label is the path below the server's root."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
    from provisioner_helpers import write_kernelspec

    root = tmp_path / "root"
    (root / "nb").mkdir(parents=True)
    write_kernelspec(kernels.kernels_dir, "gs-server")
    ksm = KernelSpecManager(kernel_dirs=[str(kernels.kernels_dir)], ensure_native_kernel=False)
    mkm = AsyncMappingKernelManager(root_dir=str(root), kernel_spec_manager=ksm)
    env = kernels.kernel_env(JPY_SESSION_NAME=str(root / "nb" / "train.ipynb"))
    kid = await mkm.start_kernel(kernel_name="gs-server", path="nb", env=env)
    try:
        km = mkm.get_kernel(kid)
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=120)
            probe = (await execute(kc, ENV_PROBE)).ok().json()
        finally:
            kc.stop_channels()
        assert probe["env"]["GPUSHARE_CLIENT_ID"] == kid
        assert probe["env"]["GPUSHARE_LABEL"] == os.path.join("nb", "train.ipynb")
        assert probe["env"]["LD_PRELOAD"] == str(shim_library)
    finally:
        await mkm.shutdown_all()
