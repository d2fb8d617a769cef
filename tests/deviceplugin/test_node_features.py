"""The node labels for placing pods by one GPU's memory: the device plugin keeps Node Feature
Discovery's local feature file (jupyter_gpushare/deviceplugin/node_features.py) in step with the
GPUs' pools the node scheduler reports."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from jupyter_gpushare.deviceplugin.node_features import feature_text, write_features
from jupyter_gpushare.deviceplugin.plugin import GpuPool
from tests.deviceplugin.kubelet_standin import KubeletStandIn, plugin_for

GiB = 1 << 30


def test_the_labels_name_the_largest_gpus_units_and_the_gpu_count() -> None:
    pools = [GpuPool("GPU-a", 0, 24 * GiB), GpuPool("GPU-b", 1, 80 * GiB + GiB // 2)]
    assert feature_text(pools, GiB) == (
        "gpushare-gpu-memory-largest-gpu=80\ngpushare-gpu-count=2\n"
    )  # whole units, as advertised
    assert feature_text(pools, GiB // 2).startswith("gpushare-gpu-memory-largest-gpu=161\n")
    assert feature_text([], GiB) == "gpushare-gpu-memory-largest-gpu=0\ngpushare-gpu-count=0\n"


def test_the_file_is_replaced_whole_and_only_when_it_changes(tmp_path: Path) -> None:
    assert write_features(str(tmp_path), "a=1\n")
    assert (tmp_path / "gpushare").read_text() == "a=1\n"
    assert oct((tmp_path / "gpushare").stat().st_mode & 0o777) == "0o644"  # NFD reads it
    assert not write_features(str(tmp_path), "a=1\n")
    assert write_features(str(tmp_path), "a=2\n")
    assert sorted(os.listdir(tmp_path)) == ["gpushare"]  # no temporary left behind


async def test_the_plugin_writes_the_features_of_the_schedulers_gpus(
    kubelet: KubeletStandIn, harness: Any, tmp_path: Path
) -> None:
    sched = harness.scheduler(pool="20GiB", fake_devices=2)
    status = await asyncio.to_thread(sched.status)
    pools = sorted(d["pool_bytes"] // GiB for d in status["devices"])
    features = tmp_path / "features.d"
    features.mkdir()
    plugin = plugin_for(kubelet, harness, device_nodes=False, nfd_features_dir=str(features))
    await plugin.start()
    try:
        deadline = time.monotonic() + 30
        while not (features / "gpushare").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        text = (features / "gpushare").read_text()
    finally:
        await plugin.stop()
    assert text == f"gpushare-gpu-memory-largest-gpu={pools[-1]}\ngpushare-gpu-count=2\n"
