"""Two notebooks on one GPU, as a user sees it: a real jupyter-server with the gpushare extension
(embedded scheduler, 24 GiB pool), two sessions on the shipped "Python 3 (GPU shared)" kernel,
PyTorch cells that cannot both be resident. The quantum is 60 s, so the only thing that can hand
the GPU from A to B within the test is the server seeing A's cell end.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

from conftest import card_used_mib, ms_of, process_mib, require

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "gpushare-gpu-test"
GIB = 1 << 30

# A's cell outlasts B's own release: B's 14 GiB are backed beside A's, then B is revoked as the
# grower and moves them out cold (6.3-7 s on an H100, 2026-11-27); with an 8 s cell A's ended
# first once, and B went from releasing to holding without ever being seen waiting.
_CELL_A_TEMPLATE = """
import json, time, torch
x = torch.zeros((14 << 30) // 4, dtype=torch.float32, device="cuda")
torch.cuda.synchronize()
start = time.time(); k = 0
while time.time() - start < {seconds}:
    for _ in range(5):
        x.add_(1.0); k += 1
    torch.cuda.synchronize()
lo, hi = float(x.min()), float(x.max())
print(json.dumps({"start": start, "end": time.time(), "correct": lo == hi == float(k), "k": k}))
"""


def cell_a(seconds: int) -> str:
    """A's cell: 14 GiB of float32 += 1 for ``seconds``, then checked."""
    return _CELL_A_TEMPLATE.replace("{seconds}", str(seconds))


CELL_A = cell_a(14)

CELL_B = """
import json, time, torch
t0 = time.time()
y = torch.zeros((14 << 30) // 4, dtype=torch.float32, device="cuda")  # waits for the GPU
torch.cuda.synchronize()
first = time.time(); k = 0
while time.time() - first < 2:
    y.add_(2.0); k += 1
    torch.cuda.synchronize()
lo, hi = float(y.min()), float(y.max())
print(json.dumps({"t0": t0, "first": first, "correct": lo == hi == 2.0 * k, "k": k}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, tmp: Path, ordering: str = "interactive", more_config: str = "") -> None:
        require("jupyter_server")
        require("torch")
        self.port = _free_port()
        # Kernels on Unix sockets in a short runtime directory of their own (a socket's path has
        # at most 107 bytes; pytest's tmp_path is longer): a TCP port picked free can be taken
        # before the kernel binds it (tests/jupyter/server_helpers.py, seen on a loaded host).
        self.runtime = Path(tempfile.mkdtemp(prefix="jr-"))
        data = tmp / "data" / "kernels" / "python3-gpushare"
        data.mkdir(parents=True)
        spec = json.loads(
            (ROOT / "jupyter-data" / "kernels" / "python3-gpushare" / "kernel.json").read_text()
        )
        spec["env"] = {"GPUSHARE_IDLE_SECONDS": "0", "GPUSHARE_LOG": "info"}
        (data / "kernel.json").write_text(json.dumps(spec))
        config = tmp / "jupyter_server_config.py"
        config.write_text(
            "c.ServerApp.jpserver_extensions = {'jupyter_gpushare': True}\n"
            "c.GPUShareScheduler.pool_size = '24GiB'\n"
            "c.GPUShareScheduler.base_quantum = 60.0\n"
            "c.GPUShareScheduler.max_quantum = 120.0\n"
            f"c.GPUShareScheduler.ordering = {ordering!r}\n"
            # Both notebooks on one GPU, also on a machine with several (where the provisioner
            # would otherwise place them on different GPUs and they would never take turns).
            "c.GPUShareProvisioner.device = '0'\n"
            "c.KernelManager.transport = 'ipc'\n" + more_config
        )
        env = {
            **__import__("os").environ,
            "JUPYTER_PATH": str(tmp / "data"),
            "JUPYTER_RUNTIME_DIR": str(self.runtime),
            "JUPYTER_CONFIG_DIR": str(tmp / "config"),
            "PYTHONUNBUFFERED": "1",
        }
        self.log = tmp / "server.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jupyter_server",
                    f"--port={self.port}",
                    "--no-browser",
                    "--allow-root",
                    f"--ServerApp.token={TOKEN}",
                    f"--ServerApp.root_dir={tmp}",
                    f"--config={config}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmp,
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                self.get("api/status")
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"server did not start:\n{self.log.read_text()}") from None
                time.sleep(0.3)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        return json.loads(text) if text else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def status(self) -> dict:
        return self.get("gpushare/api/status")

    def clients(self) -> dict[str, dict]:
        return {c["id"]: c for d in self.status()["devices"] for c in d["clients"]}

    def session(self, notebook: str) -> tuple[str, str]:
        s = self.request(
            "POST",
            "api/sessions",
            {
                "path": notebook,
                "name": notebook,
                "type": "notebook",
                "kernel": {"name": "python3-gpushare"},
            },
        )
        return s["id"], s["kernel"]["id"]

    def client(self, kernel_id: str) -> Any:
        from jupyter_client import BlockingKernelClient

        kc = BlockingKernelClient(connection_file=str(self.runtime / f"kernel-{kernel_id}.json"))
        kc.load_connection_file()
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        return kc

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.runtime, ignore_errors=True)
        # the server's own words (its kernels' stderr among them): why a kernel died, say
        lines = self.log.read_text(errors="replace").splitlines()
        print("---- server log (last 120 lines) ----", *lines[-120:], sep="\n")


def scheduler_events(log: str) -> list[tuple[float, str]]:
    """(time, line) of the scheduler's grant/revoke/evict/restore lines in the server's log."""
    out = []
    for line in log.splitlines():
        if not any(
            w in line
            for w in (
                "grant client",
                "revoke client",
                "evicted client",
                "restored client",
                "release client",
            )
        ):
            continue
        stamp = " ".join(line[3:].split()[:2])  # "[I 2026-11-22 11:49:22.554 Name] ..."
        out.append((datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp(), line))
    return out


def run_cell(kc: Any, code: str, out: dict[str, Any]) -> None:
    chunks: list[str] = []

    def hook(msg: dict) -> None:
        if msg["msg_type"] == "stream":
            chunks.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            chunks.append("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, timeout=300, output_hook=hook)
    out["status"] = reply["content"]["status"]
    out["text"] = "".join(chunks)
    lines = [ln for ln in out["text"].splitlines() if ln.startswith("{")]
    out["record"] = json.loads(lines[-1]) if lines else None


def wait_until_holding_14gib(server: Server, kernel: str, timeout: float = 120.0) -> None:
    """Until the status shows ``kernel`` running with CELL_A's 14 GiB on the GPU."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = server.clients().get(kernel)
        if c and c["state"] == "running" and c["used_bytes"] > 10 * GIB:
            return
        time.sleep(0.3)
    raise AssertionError(f"{kernel} never held its 14 GiB: {server.status()}")


def test_two_notebook_kernels_take_turns_on_the_gpu(tmp_path: Path) -> None:
    """B's cell needs the room A's cell holds, so B waits until A's cell ends, then A's 14 GiB
    leave and B runs. (The interactive ordering pauses only cells that fit side by side, so it
    decides the same here: on an H100 under it, B was granted 0.3 s after A's cell ended. The
    run recorded in docs/gpu-verification.md pins "fair".)"""
    server = Server(tmp_path, ordering="fair")
    try:
        sa, ka = server.session("a.ipynb")
        sb, kb = server.session("b.ipynb")
        kca, kcb = server.client(ka), server.client(kb)
        for kc in (kca, kcb):  # each kernel gets its CUDA context first
            warm: dict[str, Any] = {}
            run_cell(kc, "import torch; torch.ones(1, device='cuda').sum().item()", warm)
            assert warm["status"] == "ok", warm["text"]

        a: dict[str, Any] = {}
        ta = threading.Thread(target=run_cell, args=(kca, CELL_A, a))
        ta.start()
        wait_until_holding_14gib(server, ka)

        b: dict[str, Any] = {}
        tb = threading.Thread(target=run_cell, args=(kcb, CELL_B, b))
        tb.start()
        seen_waiting = None
        while ta.is_alive():
            doc = server.status()
            clients = {c["id"]: c for d in doc["devices"] for c in d["clients"]}
            if clients.get(kb, {}).get("state") == "waiting":
                seen_waiting = doc
                break
            time.sleep(0.2)
        ta.join(timeout=300)
        tb.join(timeout=300)
        assert a["status"] == "ok" and b["status"] == "ok", (a["text"], b["text"])
        ra, rb = a["record"], b["record"]
        assert ra["correct"] and rb["correct"], (ra, rb)

        # While A's cell ran, the status showed A holding the GPU and B waiting, by notebook.
        assert seen_waiting is not None, "B was never seen waiting"
        device = next(d for d in seen_waiting["devices"] if d["clients"])  # GPU 0 (pinned)
        assert device["holders"] == [ka] and device["queue"] == [kb], device
        paths = {c["id"]: c["jupyter"]["paths"] for c in device["clients"]}
        assert paths[ka] == ["a.ipynb"] and paths[kb] == ["b.ipynb"], paths

        # The scheduler's log times the handoff. A was revoked because its cell ended (iopub
        # idle), not because a quantum ran out (60 s), and B was granted once A's 14 GiB had been
        # evicted. (B's first allocation and fill may run in the moment before the scheduler
        # learns its new size; from then on B waits.)
        events = scheduler_events(server.log.read_text())
        idle_revoke = next(t for t, line in events if f"revoke client={ka}" in line)
        assert "reason='idle'" in dict((t, ln) for t, ln in events)[idle_revoke]
        grant_b = next(t for t, line in events if f"grant client={kb}" in line and t >= idle_revoke)
        notice = idle_revoke - ra["end"]
        handoff = grant_b - idle_revoke
        # Recorded on an H100: notice 3-6 ms (every run in docs/gpu-runs), handoff 0.30 s since
        # the memory engine (2026-11-24 runs 5 and b/1; 1.00-1.74 s before it). Bounds: 3x each.
        assert -0.005 < notice < 3 * 0.006, f"A was revoked {notice:.3f}s after its cell ended"
        assert handoff < 3 * 0.30, f"B was granted {handoff:.2f}s after A's revoke"
        print(
            f"A's cell ended; the scheduler revoked A {notice * 1000:.0f} ms later (idle) and "
            f"granted B {handoff:.2f}s after that, evicting A's 14 GiB in between; "
            "both results correct"
        )
        for _, line in events:
            print(line)

        for kc in (kca, kcb):
            kc.stop_channels()
        for s in (sa, sb):
            server.request("DELETE", f"api/sessions/{s}")
        deadline = time.monotonic() + 30
        while server.clients() and time.monotonic() < deadline:
            time.sleep(0.3)
        assert server.clients() == {}, "a kernel stayed registered after shutdown"
    finally:
        server.stop()


DEEP_IDLE_S = 3.0
HOLD_CELL = """
import json, os, torch
held = torch.arange((1 << 30) // 4, dtype=torch.int32, device="cuda")
torch.cuda.synchronize()
print(json.dumps({"pid": os.getpid()}))
"""
WAKE_CELL = """
import json, time, torch
t0 = time.perf_counter()
last = int(held[-1].item())  # the cell's first GPU call: waits for the wake and the restore
first_call_s = time.perf_counter() - t0
intact = last == held.numel() - 1 and bool(
    torch.equal(held, torch.arange(held.numel(), dtype=torch.int32, device="cuda"))
)
print(json.dumps({"first_call_s": first_call_s, "intact": intact}))
"""


def test_a_notebook_kernel_sleeps_deeply_and_its_next_cell_wakes_it(tmp_path: Path) -> None:
    """Issue 11 through a real Jupyter server: a kernel whose cell put 1 GiB on the GPU and ended
    goes to sleep after deep_idle_seconds (status "asleep", its process gone from nvidia-smi, the
    card back to its baseline); its next cell finds its data, and its first GPU call comes back
    within 1.5 s plus the data's restore."""
    baseline = card_used_mib()
    server = Server(
        tmp_path, more_config=f"c.GPUShareScheduler.deep_idle_seconds = {DEEP_IDLE_S}\n"
    )
    try:
        session, kid = server.session("sleepy.ipynb")
        kc = server.client(kid)
        held: dict[str, Any] = {}
        run_cell(kc, HOLD_CELL, held)
        assert held["status"] == "ok", held["text"]
        ended = time.monotonic()
        pid = held["record"]["pid"]
        listed_awake = process_mib(pid)  # None: nvidia-smi cannot map this container's pids
        awake = card_used_mib() - baseline
        assert awake >= 1024 and (listed_awake is None or listed_awake >= 1024), (
            awake,
            listed_awake,
        )

        deadline = time.monotonic() + 60
        while server.clients()[kid]["state"] != "asleep":
            assert time.monotonic() < deadline, f"never asleep: {server.clients()[kid]}"
            time.sleep(0.2)
        asleep_after = time.monotonic() - ended
        deadline = time.monotonic() + 30
        while (listed := process_mib(pid)) is not None:
            assert time.monotonic() < deadline, f"nvidia-smi still lists the kernel: {listed} MiB"
            time.sleep(0.2)
        asleep = card_used_mib() - baseline
        # Recorded: 4 MiB over the baseline (H100 runs 5 and 7, e4bbf26). Bound: 3x that.
        assert asleep <= 3 * 4, f"the card still holds {asleep} MiB over its baseline"
        seen = (
            f"nvidia-smi listed it with {listed_awake} MiB awake, not at all asleep"
            if listed_awake is not None
            else "nvidia-smi lists no pid of this machine's processes"
        )
        print(
            f"asleep {asleep_after:.2f} s after its cell ended (deep_idle_seconds "
            f"{DEEP_IDLE_S}); {seen}; the card {awake} MiB over its baseline awake, "
            f"{asleep} MiB asleep"
        )

        woken: dict[str, Any] = {}
        t0 = time.monotonic()
        run_cell(kc, WAKE_CELL, woken)
        cell_s = time.monotonic() - t0
        assert woken["status"] == "ok", woken["text"]
        record = woken["record"]
        assert record["intact"], record
        log = server.log.read_text()
        woke_s = ms_of(log, "woke", kid) / 1000
        restored_s = ms_of(log, "restored", kid) / 1000
        print(
            f"next cell: first GPU call {record['first_call_s']:.3f} s (the driver's restore "
            f"and unlock {woke_s:.3f} s, 1 GiB back {restored_s:.3f} s), the whole cell as "
            f"Jupyter ran it {cell_s:.3f} s; data intact"
        )
        # Issue 11: the next cell starts within 1.5 s plus its data at restore speed. Recorded:
        # the first call 0.287-0.370 s, of which the driver's restore and unlock and the memory's
        # 0.266-0.342 s (H100, runs 5 and 7). Bound: 3x this run's own restore and unlock.
        assert record["first_call_s"] <= 3 * (woke_s + restored_s), (record, woke_s, restored_s)

        kc.stop_channels()
        server.request("DELETE", f"api/sessions/{session}")
    finally:
        server.stop()
