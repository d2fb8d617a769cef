"""Several GPUs: the provisioner asks the scheduler where a kernel goes and starts it with
CUDA_VISIBLE_DEVICES; pins from the server's config and from kernel.json; fallbacks. The end-to-end
tests run real kernels and a real scheduler that finds two GPUs through the stand-in NVML; each
kernel's stand-in driver honours CUDA_VISIBLE_DEVICES as the real one does."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from jupyter_client.kernelspec import KernelSpec
from provisioner_helpers import GPU_PRELUDE, MiB, async_wait_for, execute

from jupyter_gpushare import provisioner as provisioner_module
from jupyter_gpushare.provisioner import PROVISIONER_NAME, GPUShareProvisioner
from jupyter_gpushare.scheduler.shell import server as server_module
from jupyter_gpushare.scheduler.shell.devices import DeviceInfo, Discovery
from jupyter_gpushare.scheduler.shell.kernel_ids import ENV_KERNEL_SECRET
from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler

GiB = 1 << 30
G0 = "GPU-00000000-aaaa-0000-0000-000000000000"
G1 = "GPU-11111111-bbbb-0000-0000-000000000001"
# The stand-in driver's UUIDs of its devices 0 and 1 (native/tests/fake_libcuda.c).
FAKE0 = "GPU-6a757079-7465-722d-6770-757368617265"
FAKE1 = "GPU-6a757079-7465-722d-6770-757368617266"


def _spec(metadata: dict[str, Any] | None = None) -> KernelSpec:
    return KernelSpec(
        argv=["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        display_name="t",
        language="python",
        metadata={"kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": {}}}
        | (metadata or {}),
    )


@pytest.fixture(autouse=True)
def reachable_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML in this (server) process cannot tell which GPUs it can reach, unless a test says."""
    monkeypatch.setattr(provisioner_module, "_reachable", None)


@pytest.fixture
async def node(sock_dir: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An in-process scheduler whose NVML finds two GPUs with 10 GiB pools."""
    devices = [DeviceInfo(0, G0, "Test GPU", 80 * GiB), DeviceInfo(1, G1, "Test GPU", 80 * GiB)]

    async def discover() -> Discovery:
        return Discovery(devices)

    monkeypatch.setattr(server_module, "discover_devices_async", discover)
    sched = GPUShareScheduler(
        socket_path=f"{sock_dir}/node.sock",
        use_nvml=True,
        utilization_interval=0,
        pool_size="10GiB",
    )
    await sched.start()
    yield sched
    await sched.stop()


def _prov(node: Any, kernel_id: str, spec: KernelSpec | None = None, **kw: Any) -> Any:
    return GPUShareProvisioner(
        kernel_id=kernel_id, kernel_spec=spec or _spec(), socket=node.socket_path, **kw
    )


async def test_kernels_are_placed_apart_and_the_placement_is_kept(node: Any) -> None:
    a, b = _prov(node, "ka", memory_limit="6GiB"), _prov(node, "kb", memory_limit="6GiB")
    env_a: dict[str, str] = {}
    env_b: dict[str, str] = {}
    await a._place(env_a)
    await b._place(env_b)
    assert env_a == {"CUDA_VISIBLE_DEVICES": G0} and env_b == {"CUDA_VISIBLE_DEVICES": G1}
    assert b.placement == {"device": G1, "index": 1, "source": "scheduler", "fits": True}
    info = await b.get_provisioner_info()
    assert info["gpushare_device"]["device"] == G1
    restored = _prov(node, "kb")
    await restored.load_provisioner_info(info)
    assert restored.placement == b.placement


async def test_only_gpus_this_server_reaches(node: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose NVML sees GPU 1 only (a container given one GPU of the node): its kernels
    are placed there, whatever the node-wide scheduler sees."""
    monkeypatch.setattr(provisioner_module, "_reachable", provisioner_module._UNKNOWN)

    async def discover() -> Discovery:
        return Discovery([DeviceInfo(0, G1, "Test GPU", 80 * GiB)])

    monkeypatch.setattr(provisioner_module, "discover_devices_async", discover)
    for kernel in ("k1", "k2"):
        env: dict[str, str] = {}
        await _prov(node, kernel)._place(env)
        assert env == {"CUDA_VISIBLE_DEVICES": G1}


async def test_pins_from_config_and_kernel_json(node: Any) -> None:
    env: dict[str, str] = {}
    await _prov(node, "k1", device="1")._place(env)
    assert env["CUDA_VISIBLE_DEVICES"] == G1
    # kernel.json's metadata.gpushare.device wins over the server's configuration.
    env = {}
    prov = _prov(node, "k2", _spec({"gpushare": {"device": G0}}), device="1")
    await prov._place(env)
    assert env["CUDA_VISIBLE_DEVICES"] == G0 and prov.placement["source"] == "pinned"
    with pytest.raises(RuntimeError, match=r"cannot start the kernel on GPU '5'.*index 5"):
        await _prov(node, "k3", device="5")._place({})


async def test_an_explicit_cuda_visible_devices_is_kept(node: Any) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    prov = _prov(node, "k", device="0")
    await prov._place(env)
    assert env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert prov.placement == {"device": "1", "source": "environment"}
    assert node._placements == {}  # the scheduler was not asked


async def test_placement_off(node: Any) -> None:
    env: dict[str, str] = {}
    await _prov(node, "k", place_kernels=False)._place(env)
    assert env == {} and node._placements == {}


async def test_without_a_scheduler(sock_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    missing = f"{sock_dir}/none.sock"
    env: dict[str, str] = {}
    prov = GPUShareProvisioner(kernel_id="k", kernel_spec=_spec(), socket=missing)
    prov.log = logging.getLogger("test-prov")
    await prov._place(env)
    assert env == {} and prov.placement is None
    assert "not placed on a GPU" in caplog.text and "does not exist" in caplog.text
    # A pin still applies, as given; an index in nvidia-smi's (PCI bus) order.
    prov = GPUShareProvisioner(kernel_id="k", kernel_spec=_spec(), socket=missing, device="1")
    await prov._place(env)
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


async def test_one_gpu_sets_nothing(sock_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def discover() -> Discovery:
        return Discovery([DeviceInfo(0, G0, "Test GPU", 80 * GiB)])

    monkeypatch.setattr(server_module, "discover_devices_async", discover)
    sched = GPUShareScheduler(socket_path=f"{sock_dir}/one.sock", utilization_interval=0)
    await sched.start()
    try:
        env: dict[str, str] = {}
        await _prov(sched, "k")._place(env)
        assert env == {}
        await _prov(sched, "k", device="0")._place(env)  # a pin is honoured even so
        assert env == {"CUDA_VISIBLE_DEVICES": G0}
    finally:
        await sched.stop()


# ---------------------------------------------------------------------------------------------
# End to end: real kernels, the stand-in driver with two devices

WHERE = (
    GPU_PRELUDE
    + r"""
import json, os
_n = _ct.c_int()
_check(_cu.cuDeviceGetCount(_ct.byref(_n)), "cuDeviceGetCount")
_u = (_ct.c_ubyte * 16)()
_check(_cu.cuDeviceGetUuid_v2(_u, _dev), "cuDeviceGetUuid_v2")
_h = bytes(_u).hex()
alloc(300 << 20)
launch(1000)
sync()
print(json.dumps({"count": _n.value, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "uuid": f"GPU-{_h[:8]}-{_h[8:12]}-{_h[12:16]}-{_h[16:20]}-{_h[20:]}"}))
"""
)


async def test_two_kernels_run_on_two_gpus(harness: Any, kernels: Any) -> None:
    sched = harness.scheduler(pool="1GiB", quantum=30.0, fake_devices=2)
    env = kernels.kernel_env(GPUSHARE_FAKE_DEVICES="2")
    seen = {}
    for name in ("nb-a", "nb-b"):
        km, kc = await kernels.start({"memory_limit": "600MiB"}, name=name, env=env)
        out = (await execute(kc, WHERE)).ok().json()
        seen[km.kernel_id] = out
        assert out["count"] == 1 and out["uuid"] == out["visible"], out  # one GPU, the placed one
        assert km.provisioner.placement["device"] == out["uuid"]
    assert {o["uuid"] for o in seen.values()} == {FAKE0, FAKE1}, seen

    def both_listed() -> Any:
        devices = {d["uuid"]: d for d in sched.status()["devices"]}
        ids = {u: [c["id"] for c in d["clients"]] for u, d in devices.items()}
        want = {o["uuid"]: [k] for k, o in seen.items()}
        return devices if ids == want else None

    devices = await async_wait_for(both_listed, timeout=10, what="each kernel on its GPU")
    assert {d["index"] for d in devices.values()} == {0, 1}
    for dev in devices.values():
        (client,) = dev["clients"]
        assert client["state"] == "running" and client["used_bytes"] >= 300 * MiB
    assert "place client=" in sched.log


def test_a_shimmed_program_registers_on_the_visible_device(harness: Any) -> None:
    sched = harness.scheduler(pool="1GiB", quantum=30.0)  # no NVML: devices come from HELLOs
    extra = {"GPUSHARE_FAKE_DEVICES": "2"}
    runs = [
        harness.run("saxpy", 1024, client_id=f"p{i}", extra={**extra, "CUDA_VISIBLE_DEVICES": v})
        for i, v in enumerate(("1", FAKE0))
    ]
    for run in runs:
        run.ok()
    log = sched.log
    assert f"join client=p0 device={FAKE1}" in log and f"join client=p1 device={FAKE0}" in log


async def test_the_kernels_id_is_bound_to_its_secret_placed_or_not(
    node: Any, sock_dir: str
) -> None:
    """Every kernel gets a secret of its own, and its id is bound to the secret's digest before
    it starts, with placement off too (scheduler/shell/kernel_ids.py; A16c); a restart binds
    the id to its new secret. Without a scheduler the kernel gets its secret all the same."""
    for attempt in range(2):
        env: dict[str, str] = {}
        await _prov(node, "k", place_kernels=False)._bind_kernel(env)
        secret = env[ENV_KERNEL_SECRET]
        assert node._kernel_ids.proves("k", secret), attempt
    assert not node._kernel_ids.proves("k", "0" * 64)
    missing = GPUShareProvisioner(kernel_id="k2", kernel_spec=_spec(), socket=f"{sock_dir}/no.sock")
    env = {}
    await missing._bind_kernel(env)
    assert len(env[ENV_KERNEL_SECRET]) == 64
    # ... and its bind is tried again in the background until the kernel ends.
    assert missing._bind_retry is not None and not missing._bind_retry.done()
    await missing.cleanup()
    assert missing._bind_retry is None
