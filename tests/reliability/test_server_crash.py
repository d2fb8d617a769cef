"""The Jupyter server killed (SIGKILL) while a gpushare kernel holds memory under the node
scheduler, then started again.

What happens, and what this test holds on to (docs/reliability.md): jupyter_client starts each
kernel with JPY_PARENT_PID, and ipykernel's parent poller ends the kernel (``os._exit(1)``) within
about a second of its server's death: a crashed server's kernels do not outlive it (Jupyter's own
behaviour by default, with or without gpushare; test_server_adopt.py covers the opt-in where
kernels survive and the new server adopts them). The shim's socket closes with the process, so
the node scheduler drops the kernel's grant and memory at once: nothing stays attributed to it,
and the new server starts cleanly, sees no stale kernel, and runs new kernels under the same
scheduler.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient
from provisioner_helpers import GPU_PRELUDE

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
TOKEN = "gpushare-crash-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``jupyter server`` in a subprocess with the gpushare extension on the node scheduler."""

    def __init__(self, tmp: Path, env: dict[str, str], sock: str) -> None:
        self.tmp, self.env, self.sock = tmp, env, sock
        self.port = free_port()
        self.log = tmp / f"server-{self.port}.log"
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        args = [
            sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={self.port}",
            f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={self.tmp}",
            "--allow-root",
            f"--GPUShareExtension.scheduler={self.sock}",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(
                args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                self.get("api/status")
                doc = self.get("gpushare/api/status")
                if doc["scheduler"]["error"] is None:
                    return self
            except OSError:
                pass
            assert self.popen.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {TOKEN}"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read() or b"null")

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()  # the server alone: its kernels run in sessions of their own
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie counts as gone: it runs nothing and holds no socket.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def run_cell(runtime: Path, kid: str, code: str) -> None:
    kc = BlockingKernelClient(connection_file=str(runtime / f"kernel-{kid}.json"))
    kc.load_connection_file()
    # No heartbeat: jupyter_client takes a kernel whose beat is 1 s late for dead, which a loaded
    # machine makes happen; the kernel_info reply (60 s) says whether it is up.
    kc.start_channels(hb=False)
    try:
        kc.wait_for_ready(timeout=60)
        reply = kc.execute_interactive(code, timeout=60, output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        kc.stop_channels()


def kernelspec_and_env(harness: Any, tmp_path: Path, name: str) -> tuple[dict[str, str], Path]:
    """A kernelspec ``name`` under the gpushare provisioner and the stand-in driver, and the
    environment of a server that finds it (its runtime directory returned with it)."""
    shim = harness.build.require_shim()
    data = tmp_path / "data"
    spec_dir = data / "kernels" / name
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": name,
        "language": "python",
        "env": {
            "LD_LIBRARY_PATH": str(harness.build.fake_dir),
            "GPUSHARE_CONTEXT_BYTES": str(16 * MiB),
            "GPUSHARE_IDLE_SECONDS": "0",
            "PYTHONPATH": str(ROOT),
        },
        "metadata": {"kernel_provisioner": {"provisioner_name": "gpushare-provisioner"}},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    runtime = tmp_path / "runtime"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "JUPYTER"))}
    env.pop("LD_PRELOAD", None)
    env |= {
        "GPUSHARE_LIBRARY": str(shim),
        "JUPYTER_PATH": str(data),
        "JUPYTER_RUNTIME_DIR": str(runtime),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "PYTHONPATH": str(ROOT),
    }
    return env, runtime


@pytest.mark.timeout(240)
def test_server_killed_its_kernels_end_and_nothing_stays_attributed(harness, tmp_path):
    sched = harness.scheduler(pool="1GiB", quantum=30.0)
    env, runtime = kernelspec_and_env(harness, tmp_path, "gpushare-crash")
    sock = str(harness.socket_path)
    first = Server(tmp_path, env, sock).start()
    try:
        kid = first.request("POST", "api/kernels", {"name": "gpushare-crash"})["id"]
        run_cell(runtime, kid, GPU_PRELUDE + f"\nassert alloc({300 * MiB})[0] == 0\n")
        t0 = time.monotonic()
        clients = {c["id"]: c for d in sched.status()["devices"] for c in d["clients"]}
        asking = time.monotonic() - t0  # the baseline: one `gpushare status`, on this machine now
        assert clients[kid]["used_bytes"] == 316 * MiB, clients
        kernel_pid = clients[kid]["pid"]

        killed_at = time.monotonic()
        first.kill()
        # ipykernel's parent poller looks every second: 3x that.
        while pid_alive(kernel_pid):
            assert time.monotonic() - killed_at < 3.0, "the kernel outlived its server"
            time.sleep(0.05)
        ended = time.monotonic() - killed_at
        # The scheduler drops it at once: what the test sees is at most the status read in
        # flight as the kernel ended and the next one; 3 reads' time.
        while True:
            devices = sched.status()["devices"]
            if all(not d["clients"] and d["resident_bytes"] == 0 for d in devices):
                break
            assert time.monotonic() - killed_at < ended + 3 * asking, (asking, devices)
            time.sleep(0.05)
        dropped = time.monotonic() - killed_at
        print(
            f"server SIGKILL -> kernel gone {ended:.2f} s, scheduler clean {dropped:.2f} s "
            f"(one status read: {asking:.2f} s)"
        )
        assert "leave client=" + kid in sched.log

        second = Server(tmp_path, env, sock).start()
        try:
            assert second.get("api/kernels") == []
            doc = second.get("gpushare/api/status")
            assert all(not d["clients"] for d in doc["devices"]), doc
            kid2 = second.request("POST", "api/kernels", {"name": "gpushare-crash"})["id"]
            run_cell(runtime, kid2, GPU_PRELUDE + f"\nassert alloc({100 * MiB})[0] == 0\n")
            doc = second.get("gpushare/api/status")
            (client,) = [c for d in doc["devices"] for c in d["clients"]]
            assert client["id"] == kid2 and client["jupyter"]["local"] is True, client
            second.request("DELETE", f"api/kernels/{kid2}")
        finally:
            second.stop()
    finally:
        first.kill()
