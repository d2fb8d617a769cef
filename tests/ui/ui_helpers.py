"""Helpers shared by the sidebar's browser tests (test_sidebar_browser.py: JupyterLab;
test_sidebar_notebook7.py: Notebook 7): a real Jupyter server in a subprocess, under a base_url
prefix, with the gpushare server extension (embedded scheduler) and a kernelspec whose kernels
run under the shim in front of the stand-in CUDA driver (as tests/jupyter/test_server_e2e.py);
and Debian's Chromium, driven by Playwright's Python API (Playwright's own browser downloads are
not used).

A uniquely named module (not conftest) so that other test directories' helpers never collide.
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
import urllib.request
from collections.abc import Callable, Container, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "jupyter"))
from provisioner_helpers import CONTEXT, GPU_PRELUDE  # noqa: E402

__all__ = [
    "BASE_URL",
    "BUILT",
    "CHROMIUM_ARGS",
    "CONTEXT",
    "GPU_PRELUDE",
    "KERNEL",
    "TOKEN",
    "Lab",
    "MiB",
    "cell_thread",
    "chromium",
    "clients_of",
    "find_chromium",
    "free_port",
    "keep_screenshot",
    "lab",
    "notebook",
    "require_built_sidebar",
    "require_chromium",
    "run_cell",
    "save_screenshot",
]

MiB = 1 << 20
TOKEN = "gpushare-ui-test"
BASE_URL = "/user/test/"
KERNEL = "gpushare-ui"
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

#: Per app (the module run with ``python -m``): config lines of its own. The app is exposed as
#: ``window.jupyterapp`` so that a test can run its commands (e.g. change the theme).
APP_CONFIG = {
    "jupyterlab": (
        "c.LabApp.news_url = None\n"
        "c.LabApp.check_for_updates_class = 'jupyterlab.NeverCheckForUpdate'\n"
        "c.LabApp.expose_app_in_browser = True\n"
    ),
    "notebook": "c.JupyterNotebookApp.expose_app_in_browser = True\n",
}


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    for path in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if os.access(path, os.X_OK):
            return path
    return None


def require_chromium() -> str:
    """Debian's Chromium, with Playwright to drive it; else the test is skipped."""
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    path = find_chromium()
    if path is None:
        pytest.skip(
            "no chromium found (install Debian's: apt-get install chromium); "
            "Playwright's browser downloads are not used"
        )
    return path


def require_built_sidebar() -> None:
    """This checkout's build of the sidebar is there; else skip (no Node.js) or fail."""
    if not (BUILT / "package.json").exists():
        if shutil.which("node") is None:
            pytest.skip("the sidebar is not built and Node.js is not installed to build it")
        pytest.fail(
            f"the sidebar is not built ({BUILT}): pip install -e . (or jlpm build in "
            "labextension/) builds it",
            pytrace=False,
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def notebook(sources: Sequence[str] = (), hidden: Container[int] = ()) -> str:
    """A notebook on the test's kernelspec with a code cell per source (those at the ``hidden``
    indexes with their source hidden), none run."""
    return json.dumps(
        {
            "cells": [
                {
                    "cell_type": "code",
                    "execution_count": None,
                    "id": f"cell-{n}",
                    "metadata": {"jupyter": {"source_hidden": n in hidden}},
                    "outputs": [],
                    "source": source,
                }
                for n, source in enumerate(sources)
            ],
            "metadata": {"kernelspec": {"name": KERNEL, "display_name": "gpushare (test)"}},
            "nbformat": 4,
            "nbformat_minor": 5,
        }
    )


class Lab:
    """``python -m <app>`` (jupyterlab, or notebook for Notebook 7) in a subprocess, its state in a
    tmp dir; stopped by :meth:`stop`. ``a.ipynb`` and ``b.ipynb`` are in its root."""

    def __init__(self, tmp: Path, fake_dir: Path, shim: Path, app: str = "jupyterlab") -> None:
        self.tmp = tmp
        self.app = app
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
            # The views under test show turns that end with a cell or a quantum; with short cells
            # first, a new short cell would have the running one's memory moved out at once.
            "c.GPUShareScheduler.short_first = False\n"
            "c.GPUShareScheduler.history_resolution = 0.5\n" + APP_CONFIG[app]
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
                # The user's data dir too (the notebook-signing key is written there).
                "JUPYTER_DATA_DIR": str(tmp / "user-data"),
                "JUPYTERLAB_SETTINGS_DIR": str(tmp / "lab-settings"),
                "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "lab-workspaces"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.log = tmp / f"{app}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    app,
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
                    raise AssertionError(f"{app} did not start:\n{self.log.read_text()}") from None
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
        # A kernel starting on a loaded machine may answer a heartbeat after jupyter_client's
        # 1 s: wait_for_ready would then call it dead ("Kernel died before replying").
        kc.hb_channel.time_to_dead = 10.0
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


@pytest.fixture
def chromium() -> str:
    return require_chromium()


@pytest.fixture
def lab(tmp_path: Path, native_build: Any) -> Iterator[Lab]:
    """JupyterLab with this checkout's sidebar, stopped at the test's end."""
    require_built_sidebar()
    shim = native_build.require_shim()
    server = Lab(tmp_path, native_build.fake_dir, shim)
    try:
        yield server
    finally:
        server.stop()


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


def keep_screenshot(target: Path) -> None:
    """A copy of a screenshot in $GPUSHARE_SCREENSHOT_DIR, when set."""
    extra = os.environ.get("GPUSHARE_SCREENSHOT_DIR")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, Path(extra) / target.name)


def save_screenshot(page: Any, tmp: Path, name: str) -> Path:
    """The side bar's tabs and the GPU panel's content, to tmp (and $GPUSHARE_SCREENSHOT_DIR)."""
    target = tmp / name
    page.screenshot(path=str(target), clip=clip_of_sidebar(page))
    keep_screenshot(target)
    return target


def clip_of_sidebar(page: Any) -> dict[str, float]:
    """The top left of the window: the side bar's tabs and the GPU panel's content (the panel
    keeps its elements across live updates, so each box is simply measured)."""
    panel = page.locator("#jupyter-gpushare-sidebar").bounding_box()
    body = page.locator("#jupyter-gpushare-sidebar .jp-gpushare-body").bounding_box()
    assert panel is not None and body is not None, "the GPU panel or its content is not shown"
    viewport = page.viewport_size
    width = min(viewport["width"], panel["x"] + panel["width"] + 12)
    height = min(viewport["height"], body["y"] + body["height"] + 12)
    return {"x": 0, "y": 0, "width": width, "height": height}


#: In the page: an element's text colour, the background it is drawn on (the nearest ancestor's
#: that is not transparent) and their WCAG contrast ratio; colours as [r, g, b] in 0..255.
_COLORS_JS = """
(el) => {
  const rgb = s => (s.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => {
    const f = c => ((c /= 255) <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4);
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const text = rgb(getComputedStyle(el).color);
  // The background as drawn: translucent layers composited over the first opaque one above them.
  const layers = [];
  let background = [255, 255, 255];
  for (let node = el; node; node = node.parentElement) {
    const bg = rgb(getComputedStyle(node).backgroundColor);
    const a = bg.length === 4 ? bg[3] : 1;
    if (a >= 1) {
      background = bg.slice(0, 3);
      break;
    }
    if (a > 0) layers.push(bg);
  }
  for (const layer of layers.reverse()) {
    background = background.map((c, i) => layer[3] * layer[i] + (1 - layer[3]) * c);
  }
  // Text of some opacity (the themes' font colours are): as drawn on its background.
  const alpha = text.length === 4 ? text[3] : 1;
  const color = text.slice(0, 3).map((c, i) => Math.round(alpha * c + (1 - alpha) * background[i]));
  const [hi, lo] = [lum(color), lum(background)].sort((a, b) => b - a);
  return {
    color, background, colorLuminance: lum(color), backgroundLuminance: lum(background),
    contrast: (hi + 0.05) / (lo + 0.05),
  };
}
"""


def text_colors(
    locator: Any, until: Callable[[dict[str, Any]], bool] | None = None, timeout: float = 10
) -> dict[str, Any]:
    """The computed text colour of ``locator``'s element, its background and their contrast;
    with ``until``, measured again (for up to ``timeout`` seconds) until it holds."""
    deadline = time.monotonic() + timeout
    while True:
        colors: dict[str, Any] = locator.evaluate(_COLORS_JS)
        if until is None or until(colors):
            return colors
        if time.monotonic() > deadline:
            return colors
        time.sleep(0.05)


def change_theme(page: Any, theme: str) -> None:
    """Runs the app's 'apputils:change-theme' (the app is exposed as window.jupyterapp) and waits
    until the theme is loaded."""
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands")
    page.evaluate(
        "theme => window.jupyterapp.commands.execute('apputils:change-theme', {theme})", theme
    )
    page.wait_for_function(
        "theme => document.body.dataset.jpThemeName === theme", arg=theme, timeout=30_000
    )
