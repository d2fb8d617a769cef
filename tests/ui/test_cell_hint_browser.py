"""Cell hints in a real browser (docs/architecture.md "Cell hints", docs/jupyter.md `cellHints`):
JupyterLab with the gpushare server extension and real kernels under the shim on the stand-in
driver (ui_helpers.Lab). a.ipynb's kernel allocates 700 MiB; b.ipynb's kernel then needs 700 MiB
of the 1 GiB pool, so a.ipynb's idle memory is evicted; b.ipynb's kernel is shut down, and
a.ipynb's memory stays on the host (restore ahead is off by default: only a hint brings it back).

a.ipynb is open in the page. With the `cellHints` setting off, focusing and editing its code cell
sends nothing and the memory stays away. With it on (the default), the same sends one
`POST gpushare/api/kernels/{id}/hint` after the typing pauses, and the scheduler restores the
kernel's memory before any cell runs: the status says nothing of it is evicted any more. Last, the
rate: with the status the page sees still saying the memory is away, edits every second for
16 s after the hint send one more hint only once 10 s have passed (hint.ts: 0.4 s of quiet, at
most once per kernel in 10 s).

The extension under test is this checkout's build (jupyter_gpushare/labextension); a build older
than labextension/src fails the test rather than testing old code (`jlpm build` in
labextension/, or `pip install -e .`, rebuilds it).
"""

from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from ui_helpers import (
    BUILT,
    CHROMIUM_ARGS,
    GPU_PRELUDE,
    ROOT,
    TOKEN,
    Lab,
    MiB,
    clients_of,
    notebook,
    run_cell,
)

FOOTPRINT = 700 * MiB
SETTINGS = "jupyter-gpushare:sidebar"
#: hint.ts: HINT_MIN_INTERVAL_MS, HINT_DEBOUNCE_MS.
MIN_INTERVAL_S = 10.0
DEBOUNCE_S = 0.4
HINT_URL = re.compile(r".*/gpushare/api/kernels/[^/]+/hint/?(\?.*)?$")
STATUS_URL = re.compile(r".*/gpushare/api/status(\?.*)?$")
HOLD = f"""rc, ptr = alloc({FOOTPRINT})
assert rc == 0, rc
assert launch(1000) == 0
assert sync() == 0"""


def require_current_build() -> None:
    """The built extension is not older than its sources: else this test would drive old code."""
    built = (BUILT / "package.json").stat().st_mtime
    sources = [
        p for p in (ROOT / "labextension" / "src").rglob("*.ts*") if "__tests__" not in p.parts
    ]
    newer = [str(p.relative_to(ROOT)) for p in sources if p.stat().st_mtime > built]
    assert not newer, (
        f"the built extension ({BUILT}) is older than {', '.join(sorted(newer))}: "
        "run `jlpm build` in labextension/ (or `pip install -e .`)"
    )


def _evicted(doc: dict[str, Any], kernel_id: str) -> int:
    return int(clients_of(doc).get(kernel_id, {}).get("evicted_bytes", 0))


def _save_settings(page: Any, values: dict[str, Any]) -> None:
    """As the Settings editor does; the page is reloaded to read them."""
    page.evaluate(
        """async ([id, raw]) => {
          await window.jupyterapp.serviceManager.settings.save(id, raw);
        }""",
        [SETTINGS, json.dumps(values)],
    )


def _open(page: Any, lab: Lab) -> Any:
    """a.ipynb in the page, its kernel connected; its first code cell."""
    page.goto(f"{lab.url}lab/tree/a.ipynb?token={TOKEN}", wait_until="domcontentloaded")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands")
    page.wait_for_function(
        "() => window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel",
        timeout=60_000,
    )
    cell = page.locator(".jp-Notebook .jp-CodeCell").first
    cell.wait_for(timeout=60_000)
    return cell


def _edit(cell: Any, text: str) -> None:
    """Focus the cell's editor and type (each key an edit)."""
    cell.locator(".cm-content").click()
    cell.page.keyboard.press("End")
    cell.page.keyboard.type(text, delay=30)


@pytest.fixture
def lab_a(lab: Lab, tmp_path: Path) -> Lab:
    """The server with a.ipynb (two code cells), hints off in the settings to begin with, the
    status looked at every second."""
    (lab.root / "a.ipynb").write_text(notebook(("x = 1", "y = 2")))
    settings = tmp_path / "lab-settings" / "jupyter-gpushare" / "sidebar.jupyterlab-settings"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"pollSeconds": 1, "cellHints": False}))
    news = tmp_path / "lab-settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True, exist_ok=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    return lab


@pytest.mark.timeout(300)
def test_cell_hint_restores_memory_is_rate_limited_and_can_be_off(
    lab_a: Lab, chromium: str, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    require_current_build()
    lab = lab_a
    # a.ipynb's kernel holds 700 MiB; b.ipynb's 700 MiB then evict it (idle), and b leaves.
    ka = lab.session("a.ipynb")
    kca = lab.client(ka)
    for code in (GPU_PRELUDE, HOLD):
        out: dict[str, Any] = {}
        run_cell(kca, code, out, timeout=60)
        assert out["status"] == "ok", out
    kb = lab.session("b.ipynb")
    kcb = lab.client(kb)
    for code in (GPU_PRELUDE, HOLD):
        out = {}
        run_cell(kcb, code, out, timeout=60)
        assert out["status"] == "ok", out
    lab.wait_status("a.ipynb's memory evicted", lambda d: _evicted(d, ka) > 0)
    kcb.stop_channels()
    lab.clients.remove(kcb)
    session_b = lab.sessions.pop()
    lab.request("DELETE", f"api/sessions/{session_b}")
    lab.wait_status("b.ipynb's kernel gone", lambda d: kb not in clients_of(d))
    assert _evicted(lab.status(), ka) > 0, lab.status()

    hints: list[tuple[float, str]] = []  # (when, url) of each hint the page sends
    answers: list[int] = []
    pretend_away = False  # the status the page sees says a.ipynb's memory is away

    def on_hint(route: Any) -> None:
        hints.append((time.monotonic(), route.request.url))
        response = route.fetch()
        answers.append(response.status)
        route.fulfill(response=response)

    def on_status(route: Any) -> None:
        if not pretend_away:
            route.continue_()
            return
        response = route.fetch()
        doc = response.json()
        for c in clients_of(doc).values():
            c["evicted_bytes"] = max(int(c.get("used_bytes", 0)), 1)
        route.fulfill(response=response, json=doc)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 600})
            page.route(HINT_URL, on_hint)
            page.route(STATUS_URL, on_status)
            status_item = page.locator(".jp-gpushare-statusbar")

            # Hints off: focus and edits send nothing, and the memory stays on the host.
            cell = _open(page, lab)
            expect(status_item).to_contain_text("1 evicted", timeout=15_000)
            _edit(cell, "  # off")
            page.locator(".jp-Notebook .jp-CodeCell").nth(1).locator(".cm-content").click()
            page.wait_for_timeout((DEBOUNCE_S + 2.5) * 1000)  # routes are served meanwhile
            assert hints == [], hints
            assert _evicted(lab.status(), ka) > 0, lab.status()

            # Hints on (the default): one hint once the typing pauses; the scheduler brings the
            # memory back with no cell run.
            _save_settings(page, {"pollSeconds": 1})
            cell = _open(page, lab)
            expect(status_item).to_contain_text("1 evicted", timeout=15_000)
            _edit(cell, "  # on")
            deadline = time.monotonic() + 15
            while not hints and time.monotonic() < deadline:
                page.wait_for_timeout(100)
            assert len(hints) == 1, hints
            assert ka in hints[0][1], hints
            lab.wait_status(
                "the hint to bring a.ipynb's memory back", lambda d: _evicted(d, ka) == 0
            )
            assert clients_of(lab.status())[ka]["state"] != "running"  # no cell ran
            expect(status_item).not_to_contain_text("evicted", timeout=15_000)
            first = hints[0][0]

            # The rate: the page is told the memory is still away; edits every second for 16 s
            # after the first hint send one more hint only after 10 s.
            pretend_away = True
            expect(status_item).to_contain_text("1 evicted", timeout=15_000)
            n = 0
            while time.monotonic() < first + MIN_INTERVAL_S + 6:
                n += 1
                _edit(cell, f" {n}")
                page.wait_for_timeout(1000)
            page.wait_for_timeout(int((DEBOUNCE_S + 1) * 1000))
            gaps = [round(b[0] - a[0], 2) for a, b in itertools.pairwise(hints)]
            said = f"{len(hints)} hints for {n} edits after the first; gaps {gaps} s"
            print(said)
            assert len(hints) == 2, said
            # The second waited out the interval (less the route's lag), and came soon after it.
            assert MIN_INTERVAL_S - 0.5 <= gaps[0] <= MIN_INTERVAL_S + 4.5, said
            assert answers and all(a == 200 for a in answers), answers
        finally:
            browser.close()
