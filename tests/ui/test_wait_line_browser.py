"""The wait, in the cell, in a real browser: JupyterLab with the gpushare server extension and two
real kernels under the shim on the stand-in driver (ui_helpers.Lab). a.ipynb's kernel holds the
GPU (driven from the test); b.ipynb is open in the page and its cell's GPU call waits, because
both footprints do not fit the 1 GiB pool and the quantum is long. The cell must show the live
wait line naming what it waits behind, the status bar must count my kernels, and when a.ipynb's
cell ends the line must turn into "Got the GPU after N s" and a toast must say the turn came.
Then the settings switch the notification and the status-bar item off, and a second turn raises
no toast.

Screenshots (wait-line.png: the waiting cell; wait-line-granted.png: the line after the grant and
the toast) go to the test's tmp dir and $GPUSHARE_SCREENSHOT_DIR when set
(``GPUSHARE_SCREENSHOT_DIR=docs/images pytest tests/ui/test_wait_line_browser.py`` makes the
README's).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from ui_helpers import (
    CHROMIUM_ARGS,
    GPU_PRELUDE,
    TOKEN,
    Lab,
    MiB,
    cell_thread,
    clients_of,
    keep_screenshot,
    notebook,
    run_cell,
    save_screenshot,
)

FOOTPRINT = 700 * MiB
SETTINGS = "jupyter-gpushare:sidebar"
#: Starts b.ipynb's cells; not awaited (the command's promise ends with the cells).
RUN_ALL = "() => { void window.jupyterapp.commands.execute('notebook:run-all-cells'); }"

#: b.ipynb's cells: the stand-in driver's prelude (once), then a GPU call that waits for the
#: device, and a 1.5 s kernel so that the turn is seen.
PRELUDE_B = f"""if "alloc" not in globals():
    exec({GPU_PRELUDE!r})
    rc, ptr = alloc({FOOTPRINT})
    assert rc == 0, rc"""
CELL_B = """assert launch(1_500_000) == 0  # waits for the GPU, then 1.5 s of GPU time
assert sync() == 0
print("b ran")"""


def _hold_until(stop: Path) -> str:
    return f"""
import os, time
if "ptr_a" not in globals():
    rc, ptr_a = alloc({FOOTPRINT})
    assert rc == 0, rc
deadline = time.time() + 90
while time.time() < deadline and not os.path.exists({str(stop)!r}):
    assert launch(20000) == 0
    assert sync() == 0
print("a done")
"""


@pytest.fixture
def lab_b(lab: Lab, tmp_path: Path) -> Lab:
    """The server, with b.ipynb's waiting cell, and settings that notify after a 1 s wait and
    look at the status every second (schema/sidebar.json)."""
    (lab.root / "b.ipynb").write_text(notebook((PRELUDE_B, CELL_B), hidden={0}))
    settings = tmp_path / "lab-settings" / "jupyter-gpushare" / "sidebar.jupyterlab-settings"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"turnAfterSeconds": 1, "pollSeconds": 1}))
    # JupyterLab's own "notified about news?" toast would cover ours in the screenshots.
    news = tmp_path / "lab-settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True, exist_ok=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    return lab


def _kernel_of(lab: Lab, path: str) -> str:
    for s in lab.get("api/sessions"):
        if s["path"] == path:
            return str(s["kernel"]["id"])
    raise AssertionError(f"no session for {path}: {lab.get('api/sessions')}")


def _shot(page: Any, tmp: Path, name: str) -> None:
    target = tmp / name
    page.screenshot(path=str(target))
    keep_screenshot(target)


@pytest.mark.timeout(300)
def test_wait_line_toast_status_bar_and_settings(lab_b: Lab, chromium: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    ka = lab_b.session("a.ipynb")
    kca = lab_b.client(ka)
    out: dict[str, Any] = {}
    run_cell(kca, GPU_PRELUDE, out, timeout=60)
    assert out["status"] == "ok", out

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 420})
            page.goto(f"{lab_b.url}lab/tree/b.ipynb?token={TOKEN}", wait_until="domcontentloaded")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands")
            status_item = page.locator(".jp-gpushare-statusbar")
            expect(status_item).to_be_visible(timeout=60_000)
            cell = page.locator(".jp-Notebook .jp-CodeCell").nth(1)
            expect(cell).to_be_visible(timeout=60_000)
            page.wait_for_function(
                "() => document.querySelector('.jp-Notebook') && "
                "window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel"
            )
            kb = _kernel_of(lab_b, "b.ipynb")

            # a.ipynb holds the GPU; b.ipynb's cell runs and waits behind it.
            stop_a = tmp_path / "stop-a"
            ta, out_a = cell_thread(kca, _hold_until(stop_a))
            lab_b.wait_status("A to hold the GPU", lambda d: ka in d["devices"][0]["holders"])
            page.evaluate(RUN_ALL)
            lab_b.wait_status(
                "B to wait", lambda d: clients_of(d).get(kb, {}).get("state") == "waiting"
            )
            line = cell.locator(".gpushare-wait")
            expect(line).to_have_count(1, timeout=15_000)
            expect(line).to_have_attribute("data-phase", "waiting")
            expect(line).to_contain_text("Waiting for the GPU: 1st in line, behind your a.ipynb")
            expect(line).to_contain_text(re.compile(r"\(turn ends in ~\d+ s\)"))
            expect(status_item).to_have_text("GPU: 1 running, 1 waiting", timeout=10_000)
            time.sleep(1.5)  # a wait long enough for the toast's threshold (1 s)
            _shot(page, tmp_path, "wait-line.png")

            stop_a.touch()
            ta.join(timeout=60)
            assert out_a.get("status") == "ok", out_a
            expect(line).to_have_attribute("data-phase", "granted", timeout=20_000)
            # B's 700 MiB were allocated while it waited: no physical memory until the grant
            # (deferred backing), so nothing was restored and the line names no restore.
            expect(line).to_have_text(re.compile(r"^Got the GPU after \d+\.\d s$"))
            expect(cell.locator(".jp-Cell-outputArea")).to_contain_text("b ran", timeout=20_000)
            # Still one line: the wait's display was updated in place, not appended to.
            expect(cell.locator(".gpushare-wait")).to_have_count(1)
            toast = page.locator(".jp-toast-message", has_text="Your turn: b.ipynb got the GPU")
            expect(toast).to_be_visible(timeout=15_000)
            # a.ipynb's cell ended and it went idle; its memory left the GPU for b.ipynb.
            evicted = page.locator(".jp-toast-message", has_text="Your idle kernel a.ipynb was")
            expect(evicted).to_contain_text("moved off the GPU: 700 MiB now in host memory")
            expect(page.locator(".jp-gpushare-statusbar")).to_have_text(
                re.compile(r"^GPU: (1 running, 1 evicted|1 idle, 1 evicted)$")
            )
            _shot(page, tmp_path, "wait-line-granted.png")

            # After these turns the sidebar draws the last hour: each of my kernels' memory and
            # GPU use, and the GPU's (held or not: this stand-in has no NVML utilisation).
            page.evaluate("() => window.jupyterapp.commands.execute('gpushare:show')")
            panel = page.locator("#jupyter-gpushare-sidebar")
            expect(panel).to_be_visible()
            memory = panel.locator(".jp-gpushare-mine svg.jp-gpushare-spark-memory")
            expect(memory).to_have_count(2, timeout=15_000)
            expect(memory.first).to_have_attribute("aria-label", re.compile(r"^Memory of .*"))
            for i in range(2):
                assert int(memory.nth(i).get_attribute("data-points") or 0) >= 2
                assert memory.nth(i).locator("polyline").get_attribute("points")
            gpu_use = panel.locator(".jp-gpushare-mine svg.jp-gpushare-spark-gpu")
            expect(gpu_use).to_have_count(2)
            held = panel.locator("svg.jp-gpushare-spark-device")
            expect(held).to_have_count(1)
            expect(held).to_have_attribute("aria-label", re.compile(r"held by a kernel, last"))
            page.set_viewport_size({"width": 1100, "height": 900})
            expect(memory).to_have_count(2)
            save_screenshot(page, tmp_path, "sidebar-history.png")
            page.set_viewport_size({"width": 1100, "height": 420})

            # Evict asks first; Cancel leaves the kernel as it was.
            evict = panel.get_by_role("button", name=re.compile(r"^Evict b\.ipynb: "))
            evict.click()
            dialog = page.locator(".jp-Dialog")
            expect(dialog).to_contain_text("Evict b.ipynb?")
            expect(dialog).to_contain_text("its memory")
            dialog.get_by_role("button", name="Cancel").click()
            expect(dialog).to_have_count(0)
            time.sleep(1.0)
            assert "control evict" not in lab_b.log.read_text()

            # Switch the turn notification and the status-bar item off, as the Settings
            # editor does, and reload: a second turn raises no toast.
            page.evaluate(
                """async id => {
                  const s = await window.jupyterapp.serviceManager.settings.fetch(id);
                  const raw = JSON.stringify({turnAfterSeconds: 1, pollSeconds: 1,
                                              notifyTurn: false, statusBar: false});
                  await window.jupyterapp.serviceManager.settings.save(id, raw);
                }""",
                SETTINGS,
            )
            page.reload(wait_until="domcontentloaded")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands")
            cell = page.locator(".jp-Notebook .jp-CodeCell").nth(1)
            expect(cell).to_be_visible(timeout=60_000)
            expect(page.locator(".jp-gpushare-statusbar")).to_be_hidden(timeout=15_000)
            stop_a.unlink()
            ta, out_a = cell_thread(kca, _hold_until(stop_a))
            lab_b.wait_status("A to hold again", lambda d: ka in d["devices"][0]["holders"])
            page.wait_for_function(
                "() => window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel"
            )
            page.evaluate(RUN_ALL)
            line = cell.locator(".gpushare-wait")
            expect(line).to_have_attribute("data-phase", "waiting", timeout=15_000)
            time.sleep(2.0)
            stop_a.touch()
            ta.join(timeout=60)
            expect(line).to_have_attribute("data-phase", "granted", timeout=20_000)
            expect(cell.locator(".jp-Cell-outputArea")).to_contain_text("b ran", timeout=20_000)
            time.sleep(3.0)  # three looks at the status: none may raise the toast
            expect(page.locator(".jp-toast-message", has_text="Your turn")).to_have_count(0)
        finally:
            browser.close()
