"""The sidebar in Notebook 7 (``python -m notebook``), in a real browser: its notebook page has a
left side panel, and the Shared GPU panel is one of its widgets, opened from the menu (View >
Left Sidebar > Show Shared GPU). The server is as in test_sidebar_browser.py (ui_helpers.py):
base_url prefix, the gpushare server extension with its embedded scheduler, and a kernel under
the shim in front of the stand-in CUDA driver.

The notebook's kernel (started under the gpushare provisioner) has not touched the GPU at first:
the panel says there is no GPU. Then a cell of that kernel takes the GPU, and the panel shows it
as the holder, by its notebook's name. A screenshot (sidebar-notebook7.png) goes to the test's
tmp dir, and to $GPUSHARE_SCREENSHOT_DIR when set.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
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
    require_built_sidebar,
    require_chromium,
    run_cell,
    save_screenshot,
)


@pytest.fixture
def chromium() -> str:
    return require_chromium()


@pytest.fixture
def notebook7(tmp_path: Path, native_build: Any) -> Iterator[Lab]:
    pytest.importorskip("notebook", minversion="7", reason="Notebook 7 is not installed")
    require_built_sidebar()
    shim = native_build.require_shim()
    server = Lab(tmp_path, native_build.fake_dir, shim, app="notebook")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(180)
def test_sidebar_in_notebook7(notebook7: Lab, chromium: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    nb = notebook7
    # The notebook's session first: the page opens it, on the same kernel.
    kernel = nb.session("a.ipynb")
    kc = nb.client(kernel)
    stop = tmp_path / "stop"
    cell = f"""
import os, time
rc, ptr = alloc({64 * MiB})
assert rc == 0, rc
deadline = time.time() + 60
while time.time() < deadline and not os.path.exists({str(stop)!r}):
    assert launch(20000) == 0   # the stand-in's "sleep" kernel: 20 ms of GPU time
    assert sync() == 0
"""
    thread: threading.Thread | None = None
    out: dict[str, Any] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            page.goto(f"{nb.url}notebooks/a.ipynb?token={TOKEN}", wait_until="domcontentloaded")
            expect(page.locator(".jp-NotebookPanel")).to_be_visible(timeout=60_000)
            # Notebook 7's notebook page, not JupyterLab's.
            expect(page.locator("body")).to_have_attribute("data-notebook", "notebooks")
            panel = page.locator("#jupyter-gpushare-sidebar")
            expect(panel).to_be_hidden()

            # View > Left Sidebar > Show Shared GPU.
            page.locator(".lm-MenuBar-item", has_text="View").click()
            page.locator(".lm-Menu-item", has_text="Left Sidebar").click()
            page.get_by_role("menuitem", name="Show Shared GPU").click()
            expect(panel).to_be_visible()
            expect(panel).to_have_attribute("aria-label", "Shared GPU")
            expect(panel.locator(".jp-gpushare-connection")).to_have_text(
                "live updates", timeout=15_000
            )
            message = panel.locator(".jp-gpushare-message")
            expect(message).to_contain_text("No NVIDIA GPU found (disabled")

            run_cell(kc, GPU_PRELUDE, out, timeout=60)
            assert out["status"] == "ok", out
            thread, out = cell_thread(kc, cell)
            nb.wait_status(
                "the kernel to hold the GPU", lambda d: kernel in d["devices"][0]["holders"]
            )

            expect(message).to_have_count(0)
            device = panel.locator(".jp-gpushare-device")
            expect(device).to_have_count(1)
            holders = panel.locator(".jp-gpushare-holders .jp-gpushare-kernel")
            expect(holders).to_have_count(1, timeout=10_000)
            expect(holders.first).to_contain_text("a.ipynb")
            expect(holders.first).to_have_attribute("data-mine", "")
            expect(holders.first).to_have_attribute("aria-label", "a.ipynb (mine): holds the GPU")
            expect(device.locator(".jp-gpushare-summary")).to_contain_text("a.ipynb holds the GPU")
            save_screenshot(page, tmp_path, "sidebar-notebook7.png")

            # The side panel's own close button hides it (and the panel goes offline).
            page.locator("#jp-left-stack .jp-SidePanel-collapse").click()
            expect(panel).to_be_hidden()
            expect(panel.locator(".jp-gpushare-connection")).to_have_text("offline")
        finally:
            browser.close()
            stop.touch()
            if thread is not None:
                thread.join(timeout=60)
    assert out.get("status") == "ok", out
    # The page opened the notebook on its session's kernel: no second kernel.
    assert [s["kernel"]["id"] for s in nb.get("api/sessions")] == [kernel]
