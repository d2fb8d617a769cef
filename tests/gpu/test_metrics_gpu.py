"""The scheduler's metrics on a real GPU: NVML's index and model name as dcgm-exporter's `gpu`
and `modelName` labels, and a utilisation gauge that moves while a kernel trains."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conftest import _listening, shimmed_env, start_workload
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}


def test_metrics_carry_nvml_labels_and_utilisation(tmp_path: Path) -> None:
    sock, port = tmp_path / "gpushare.sock", free_port()
    log = (tmp_path / "scheduler.log").open("w")
    sched = subprocess.Popen(
        [sys.executable, "-m", "jupyter_gpushare", "scheduler", f"--socket={sock}",
         "--pool=24GiB", f"--metrics-port={port}", "--metrics-address=127.0.0.1",
         "--GPUShareScheduler.metrics_interval=0.2",
         "--GPUShareScheduler.utilization_interval=0.2"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not _listening(sock):
            assert sched.poll() is None and time.monotonic() < deadline, "no scheduler"
            time.sleep(0.05)
        status = subprocess.run(
            [sys.executable, "-m", "jupyter_gpushare", "status", "--json", f"--socket={sock}"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        devices = {d["uuid"]: d for d in json.loads(status)["devices"]}
        worker = start_workload("torch_train.py", "400", env=shimmed_env(sock))
        peak = 0.0
        while worker.poll() is None:
            fams = scrape(port)
            for s in fams["gpushare_gpu_utilization_ratio"].samples:
                assert 0.0 <= s.value <= 1.0, s
                peak = max(peak, s.value)
            time.sleep(0.2)
        assert worker.returncode == 0, worker.stderr.read() if worker.stderr else ""
        fams = scrape(port)
        pools = fams["gpushare_pool_bytes"].samples
        assert {s.labels["UUID"] for s in pools} == set(devices)
        for s in pools:
            dev = devices[s.labels["UUID"]]
            assert s.labels["gpu"] == str(dev["index"]), s
            assert s.labels["modelName"] == dev["name"], s
        assert peak > 0, "the utilisation gauge never moved while a kernel trained"
        print(f"devices={[(d['index'], d['name']) for d in devices.values()]} peak={peak}")
    finally:
        sched.send_signal(signal.SIGTERM)
        sched.wait(timeout=15)
        log.close()
