"""The sidebar in a real browser: JupyterLab under a base_url prefix, with the gpushare server
extension (embedded scheduler) and two real ipykernel kernels under the shim in front of the
stand-in CUDA driver (as tests/jupyter/test_server_e2e.py). Their footprints do not fit the 1 GiB
pool together and the quantum is long, so they take turns: A's cell holds the GPU until the test
lets it end, B's cell waits, and then the GPU passes to B.

Chromium is Debian's (`apt-get install chromium`; .ci/run installs it), driven by Playwright's
Python API; Playwright's own browser downloads are not used. A screenshot of the panel goes to
the test's tmp dir, and to $GPUSHARE_SCREENSHOT_DIR when set (docs/images/sidebar.png is made so:
``GPUSHARE_SCREENSHOT_DIR=docs/images pytest tests/ui/test_sidebar_browser.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "jupyter"))
from provisioner_helpers import CONTEXT, GPU_PRELUDE  # noqa: E402

MiB = 1 << 20
TOKEN = "gpushare-ui-test"
BASE_URL = "/user/test/"
KERNEL = "gpushare-ui"
FOOTPRINT = 700 * MiB
BUILT = ROOT / "jupyter_gpushare" / "labextension"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    for path in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if os.access(path, os.X_OK):
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def notebook() -> str:
    return json.dumps(
        {
            "cells": [],
            "metadata": {"kernelspec": {"name": KERNEL, "display_name": "gpushare (test)"}},
            "nbformat": 4,
            "nbformat_minor": 5,
        }
    )


class Lab:
    """`python -m jupyterlab` in a subprocess, its state in a tmp dir; stopped by :meth:`stop`."""

    def __init__(self, tmp: Path, fake_dir: Path, shim: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.sock_dir = Path(tempfile.mkdtemp(prefix="gsui-", dir="/tmp"))
        self.runtime = tmp / "runtime"
        self.root = tmp / "root"
        self.root.mkdir()
        for name in ("a.ipynb", "b.ipynb"):
            (self.root / name).write_text(notebook())
        data = tmp / "data"
        # This checkout's build of the sidebar comes first on JUPYTER_PATH.
        (data / "labextensions").mkdir(parents=True)
        (data / "labextensions" / "jupyter-gpushare").symlink_to(BUILT)
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "gpushare (test)",
            "language": "python",
            "env": {
                "LD_LIBRARY_PATH": os.pathsep.join(
                    filter(None, [str(fake_dir), os.environ.get("LD_LIBRARY_PATH")])
                ),
                "GPUSHARE_FAKE_DEVICE_TOTAL": "4GiB",
                "GPUSHARE_CONTEXT_BYTES": str(CONTEXT),
                "GPUSHARE_IDLE_SECONDS": "0",
                "GPUSHARE_LOG": "warn",
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
                ),
            },
            "metadata": {
                "kernel_provisioner": {"provisioner_name": "gpushare-provisioner", "config": {}}
            },
        }
        (data / "kernels" / KERNEL).mkdir(parents=True)
        (data / "kernels" / KERNEL / "kernel.json").write_text(json.dumps(spec, indent=1))
        config = tmp / "jupyter_server_config.py"
        config.write_text(
            "c.ServerApp.jpserver_extensions = {'jupyter_gpushare': True}\n"
            "c.GPUShareExtension.scheduler = 'embedded'\n"
            f"c.GPUShareExtension.socket = {str(self.sock_dir / 'sched.sock')!r}\n"
            "c.GPUShareExtension.status_interval = 0.1\n"
            "c.GPUShareScheduler.use_nvml = False\n"
            "c.GPUShareScheduler.pool_size = '1GiB'\n"
            "c.GPUShareScheduler.base_quantum = 60.0\n"
            "c.GPUShareScheduler.max_quantum = 60.0\n"
            "c.LabApp.news_url = None\n"
            "c.LabApp.check_for_updates_class = 'jupyterlab.NeverCheckForUpdate'\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
        env.pop("LD_PRELOAD", None)
        env.pop("PYTEST_CURRENT_TEST", None)
        env.update(
            {
                "GPUSHARE_LIBRARY": str(shim),
                "JUPYTER_PATH": str(data),
                "JUPYTER_RUNTIME_DIR": str(self.runtime),
                "JUPYTER_CONFIG_DIR": str(tmp / "config"),
                "JUPYTERLAB_SETTINGS_DIR": str(tmp / "lab-settings"),
                "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "lab-workspaces"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.log = tmp / "lab.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jupyterlab",
                    "--no-browser",
                    "--allow-root",
                    f"--port={self.port}",
                    "--ip=127.0.0.1",
                    f"--ServerApp.token={TOKEN}",
                    f"--ServerApp.base_url={BASE_URL}",
                    f"--ServerApp.root_dir={self.root}",
                    f"--config={config}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.root,
                start_new_session=True,
            )
        self.sessions: list[str] = []
        self.clients: list[Any] = []
        deadline = time.monotonic() + 60
        while True:
            try:
                self.get("api/status")
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"JupyterLab did not start:\n{self.log.read_text()}"
                    ) from None
                time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{BASE_URL}"

    def request(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        return json.loads(text) if text else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def status(self) -> dict[str, Any]:
        return self.get("gpushare/api/status")

    def wait_status(self, what: str, predicate: Any, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            doc = self.status()
            if predicate(doc):
                return doc
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {json.dumps(doc, indent=1)}")
            time.sleep(0.1)

    def session(self, path: str) -> str:
        s = self.request(
            "POST",
            "api/sessions",
            {"path": path, "name": path, "type": "notebook", "kernel": {"name": KERNEL}},
        )
        self.sessions.append(s["id"])
        return str(s["kernel"]["id"])

    def client(self, kernel_id: str) -> Any:
        from jupyter_client import BlockingKernelClient

        kc = BlockingKernelClient(connection_file=str(self.runtime / f"kernel-{kernel_id}.json"))
        kc.load_connection_file()
        kc.start_channels()
        self.clients.append(kc)
        kc.wait_for_ready(timeout=60)
        return kc

    def stop(self) -> None:
        for kc in self.clients:
            with contextlib.suppress(Exception):
                kc.stop_channels()
        for sid in self.sessions:
            with contextlib.suppress(Exception):
                self.request("DELETE", f"api/sessions/{sid}")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def run_cell(kc: Any, code: str, out: dict[str, Any], timeout: float = 120) -> None:
    chunks: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            chunks.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            chunks.append("\n".join(msg["content"]["traceback"]))

    try:
        reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        out["status"] = reply["content"]["status"]
    except Exception as exc:  # a timeout: reported by the test
        out["status"] = f"exception: {exc!r}"
    out["text"] = "".join(chunks)


def cell_thread(kc: Any, code: str) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}
    t = threading.Thread(target=run_cell, args=(kc, code, out), daemon=True)
    t.start()
    return t, out


def clients_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for d in doc.get("devices", []) for c in d.get("clients", [])}


def save_screenshot(page: Any, tmp: Path, name: str) -> None:
    target = tmp / name
    page.screenshot(path=str(target), clip=clip_of_sidebar(page))
    extra = os.environ.get("GPUSHARE_SCREENSHOT_DIR")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, Path(extra) / name)


def clip_of_sidebar(page: Any) -> dict[str, float]:
    """The top left of the window: the side bar's tabs and the GPU panel's content."""
    box = page.locator("#jupyter-gpushare-sidebar").bounding_box()
    body = page.locator("#jupyter-gpushare-sidebar .jp-gpushare-body").bounding_box()
    viewport = page.viewport_size
    width = min(viewport["width"], box["x"] + box["width"] + 12)
    height = min(viewport["height"], body["y"] + body["height"] + 12)
    return {"x": 0, "y": 0, "width": width, "height": height}


@pytest.fixture
def chromium() -> str:
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    path = find_chromium()
    if path is None:
        pytest.skip(
            "no chromium found (install Debian's: apt-get install chromium); "
            "Playwright's browser downloads are not used"
        )
    return path


@pytest.fixture
def lab(tmp_path: Path, native_build: Any) -> Iterator[Lab]:
    if not (BUILT / "package.json").exists():
        if shutil.which("node") is None:
            pytest.skip("the sidebar is not built and Node.js is not installed to build it")
        pytest.fail(
            f"the sidebar is not built ({BUILT}): pip install -e . (or jlpm build in "
            "labextension/) builds it",
            pytrace=False,
        )
    shim = native_build.require_shim()
    server = Lab(tmp_path, native_build.fake_dir, shim)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(240)
def test_sidebar_shows_holder_waiter_and_handoff(lab: Lab, chromium: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    stop_a = tmp_path / "stop-a"
    cell_a = f"""
import json, os, time
rc, ptr = alloc({FOOTPRINT})
assert rc == 0, rc
deadline = time.time() + 90
n = 0
while time.time() < deadline and not os.path.exists({str(stop_a)!r}):
    assert launch(20000) == 0   # the stand-in's "sleep" kernel: 20 ms of GPU time
    assert sync() == 0
    n += 1
print(json.dumps({{"end": time.time(), "launches": n}}))
"""
    cell_b = f"""
import json, time
rc, ptr = alloc({FOOTPRINT})
assert rc == 0, rc
t0 = time.time()
assert launch(1000) == 0        # blocks until the scheduler grants the device
assert sync() == 0
print(json.dumps({{"t0": t0, "first_launch": time.time()}}))
"""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            page.goto(f"{lab.url}lab?token={TOKEN}", wait_until="domcontentloaded")
            tab = page.locator('.jp-SideBar li.lm-TabBar-tab[data-id="jupyter-gpushare-sidebar"]')
            expect(tab).to_be_visible(timeout=60_000)
            expect(tab).to_have_attribute("title", "Shared GPU")
            tab.click()
            panel = page.locator("#jupyter-gpushare-sidebar")
            expect(panel).to_be_visible()
            expect(panel).to_have_attribute("aria-label", "Shared GPU")
            expect(panel.locator(".jp-gpushare-connection")).to_have_text("live", timeout=15_000)
            # No shim has connected and NVML is off: the panel says there is no GPU (yet).
            message = panel.locator(".jp-gpushare-message")
            expect(message).to_contain_text("No GPU found (disabled")
            expect(message).to_contain_text("GPUs also appear here when a kernel uses one")

            ka = lab.session("a.ipynb")
            kb = lab.session("b.ipynb")
            kca, kcb = lab.client(ka), lab.client(kb)
            for kc in (kca, kcb):
                out: dict[str, Any] = {}
                run_cell(kc, GPU_PRELUDE, out, timeout=60)
                assert out["status"] == "ok", out
            # A quota that A's footprint comes near: the panel warns.
            lab.request("PUT", f"gpushare/api/kernels/{ka}/quota", {"quota": "768MiB"})

            ta, out_a = cell_thread(kca, cell_a)
            lab.wait_status("A to hold the GPU", lambda d: ka in d["devices"][0]["holders"])
            tb, out_b = cell_thread(kcb, cell_b)
            doc = lab.wait_status(
                "B to wait", lambda d: clients_of(d).get(kb, {}).get("state") == "waiting"
            )
            assert ta.is_alive(), out_a

            expect(message).to_have_count(0)
            device = panel.locator(".jp-gpushare-device")
            expect(device).to_have_count(1)
            expect(device.locator(".jp-gpushare-mode")).to_have_text("turns")
            holders = panel.locator(".jp-gpushare-holders .jp-gpushare-kernel")
            waiters = panel.locator(".jp-gpushare-waiters .jp-gpushare-kernel")
            expect(holders).to_have_count(1, timeout=10_000)
            expect(holders.first).to_contain_text("a.ipynb")
            expect(holders.first).to_have_attribute("data-mine", "")
            expect(holders.first).to_have_attribute("aria-label", "a.ipynb (mine): holds the GPU")
            expect(waiters).to_have_count(1)
            expect(waiters.first).to_contain_text("b.ipynb")
            expect(waiters.first).to_contain_text("#1 in queue")
            expect(waiters.first).to_contain_text("waiting")
            expect(device.locator(".jp-gpushare-summary")).to_have_text(
                "a.ipynb holds the GPU; 1 waiting."
            )
            release = holders.first.get_by_role("button", name="Release the GPU held by a.ipynb")
            expect(release).to_be_visible()
            # The memory pool's bar, and A's memory against its quota (716 of 768 MiB: 93%).
            pool_bar = device.get_by_role("progressbar", name="Memory pool of")
            expect(pool_bar).to_have_attribute("aria-valuemax", str(1 << 30))
            resident = doc["devices"][0]["resident_bytes"]
            assert int(pool_bar.get_attribute("aria-valuenow")) > 0, resident
            quota_bar = device.get_by_role(
                "progressbar", name="Memory of a.ipynb against its quota"
            )
            expect(quota_bar).to_have_attribute("aria-valuemax", str(768 * MiB))
            expect(quota_bar).to_have_attribute("aria-valuenow", str(FOOTPRINT + CONTEXT))
            expect(panel.get_by_role("alert")).to_contain_text(
                "a.ipynb uses 716 MiB of its 768 MiB quota (93%)"
            )
            save_screenshot(page, tmp_path, "sidebar.png")

            # A's cell ends: the GPU passes to B, and the panel follows (websocket; no reload).
            stop_a.touch()
            ta.join(timeout=60)
            assert out_a.get("status") == "ok", out_a
            ended = time.monotonic()
            expect(holders).to_have_count(1)
            expect(holders.first).to_contain_text("b.ipynb", timeout=15_000)
            shown = time.monotonic() - ended
            expect(waiters).to_have_count(0)
            tb.join(timeout=60)
            assert out_b.get("status") == "ok", out_b
            print(f"the panel showed the handoff {shown:.2f}s after A's cell ended")
            assert shown < 5, f"the panel showed the handoff {shown:.2f}s after A's cell ended"
            page.screenshot(path=str(tmp_path / "sidebar-handoff.png"))

            # Hidden, the panel closes its websocket; shown again, it reconnects and refetches.
            connection = panel.locator(".jp-gpushare-connection")
            tab.click()
            expect(panel).to_be_hidden()
            expect(connection).to_have_text("offline")
            tab.click()
            expect(panel).to_be_visible()
            expect(connection).to_have_text("live", timeout=15_000)
            expect(holders.first).to_contain_text("b.ipynb")
        finally:
            browser.close()
