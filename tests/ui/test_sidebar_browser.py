"""The sidebar in a real browser: JupyterLab under a base_url prefix, with the gpushare server
extension (embedded scheduler) and two real ipykernel kernels under the shim in front of the
stand-in CUDA driver (as tests/jupyter/test_server_e2e.py). Their footprints do not fit the 1 GiB
pool together and the quantum is long, so they take turns: A's cell holds the GPU until the test
lets it end, B's cell waits, and then the GPU passes to B. Last, the theme changes to JupyterLab
Dark, and the panel's text must stay readable (light on dark).

Chromium is Debian's (`apt-get install chromium`; .ci/run installs it), driven by Playwright's
Python API; Playwright's own browser downloads are not used (ui_helpers.py has what this test
shares with test_sidebar_notebook7.py). Screenshots of the panel (sidebar.png, and
sidebar-dark.png in the dark theme) go to the test's tmp dir, and to $GPUSHARE_SCREENSHOT_DIR
when set (docs/images/sidebar.png is made so:
``GPUSHARE_SCREENSHOT_DIR=docs/images pytest tests/ui/test_sidebar_browser.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ui_helpers import (
    CHROMIUM_ARGS,
    CONTEXT,
    GPU_PRELUDE,
    TOKEN,
    Lab,
    MiB,
    cell_thread,
    change_theme,
    clients_of,
    require_built_sidebar,
    require_chromium,
    run_cell,
    save_screenshot,
    text_colors,
)

FOOTPRINT = 700 * MiB


@pytest.fixture
def chromium() -> str:
    return require_chromium()


@pytest.fixture
def lab(tmp_path: Path, native_build: Any) -> Iterator[Lab]:
    require_built_sidebar()
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
            # Why B waits, as the scheduler says it (docs/reliability.md).
            expect(waiters.first.locator(".jp-gpushare-kernel-why")).to_contain_text(
                "'s kernel: its turn ends in"
            )
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

            # JupyterLab Dark: the panel follows the theme (its colours are the theme's
            # variables), and its text stays readable, light on dark.
            title = panel.locator(".jp-gpushare-title")
            holder = holders.first.locator(".jp-gpushare-kernel-name").first
            warning = panel.locator(".jp-gpushare-warning").first
            light = {
                "title": text_colors(title),
                "holder": text_colors(holder),
                "warning": text_colors(warning),
            }
            change_theme(page, "JupyterLab Dark")
            expect(page.locator("body")).to_have_attribute("data-jp-theme-light", "false")
            expect(holders.first).to_contain_text("b.ipynb")
            # The theme's stylesheet is in, but colours may still be on their way (transitions).
            dark = {
                "title": text_colors(title, until=lambda c: c["backgroundLuminance"] < 0.2),
                "holder": text_colors(holder, until=lambda c: c["backgroundLuminance"] < 0.2),
                "warning": text_colors(warning, until=lambda c: c["backgroundLuminance"] < 0.2),
            }
            print(f"light: {light}\ndark: {dark}")
            for part in ("title", "holder", "warning"):
                assert dark[part]["color"] != light[part]["color"], (part, light, dark)
                assert dark[part]["background"] != light[part]["background"], (part, light, dark)
                # Light text on a dark background, at least WCAG AA's 4.5:1.
                assert dark[part]["colorLuminance"] > dark[part]["backgroundLuminance"], dark
                assert dark[part]["backgroundLuminance"] < 0.2, dark
                assert dark[part]["contrast"] >= 4.5, dark
                assert light[part]["contrast"] >= 4.5, light
            save_screenshot(page, tmp_path, "sidebar-dark.png")
        finally:
            browser.close()
