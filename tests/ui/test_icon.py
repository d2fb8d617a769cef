"""The sidebar's icon (labextension/src/index.ts's GPU_SVG) rendered by Chromium at the size the
sidebar shows it, 16 px: it must read as a chip (a body with pins on all four sides, the same
seen from each side), and be drawn on the pixel grid so that no edge blurs into grey. The icon it
replaced, a card with a bracket, read as a chat bubble at this size."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from ui_helpers import CHROMIUM_ARGS

ROOT = Path(__file__).resolve().parents[2]
FILL = (0x61, 0x61, 0x61)


def _svg() -> str:
    text = (ROOT / "labextension" / "src" / "index.ts").read_text()
    found = re.search(r"const GPU_SVG = `(.*?)`;", text, re.S)
    assert found, "GPU_SVG not found in labextension/src/index.ts"
    return found.group(1)


def _render(chromium: str) -> list[list[tuple[int, int, int]]]:
    from PIL import Image
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 64, "height": 64}, device_scale_factor=1)
            page.set_content(
                '<body style="margin:0;background:#fff">'
                f'<div id="icon" style="width:16px;height:16px;line-height:0">{_svg()}</div>'
            )
            png = page.locator("#icon").screenshot()
        finally:
            browser.close()
    im = Image.open(io.BytesIO(png)).convert("RGB")
    assert im.size == (16, 16), im.size
    return [[im.getpixel((x, y)) for x in range(16)] for y in range(16)]


def _near(p: tuple[int, int, int], q: tuple[int, int, int]) -> bool:
    return max(abs(a - b) for a, b in zip(p, q, strict=True)) <= 8


def _runs(cells: list[bool]) -> int:
    return sum(1 for i, on in enumerate(cells) if on and (i == 0 or not cells[i - 1]))


@pytest.mark.timeout(120)
def test_icon_is_a_crisp_chip_at_16px(chromium: str) -> None:
    pixels = _render(chromium)
    white = (255, 255, 255)
    blurred = [
        (x, y, p)
        for y, row in enumerate(pixels)
        for x, p in enumerate(row)
        if not _near(p, white) and not _near(p, FILL)
    ]
    assert not blurred, f"pixels neither background nor ink (off the pixel grid): {blurred[:8]}"
    ink = [[_near(p, FILL) for p in row] for row in pixels]
    # The same seen from each side (a chip; a speech bubble or a card is not).
    turned = [[ink[15 - x][y] for x in range(16)] for y in range(16)]
    assert ink == turned, "\n".join("".join("#" if c else "." for c in row) for row in ink)
    # Pins: the outermost inked row on each side is three separate pins.
    top = next(row for row in ink if any(row))
    assert _runs(top) == 3, top
    # A body with a hollow ring around a die in the middle.
    assert ink[8][8] and ink[7][7]
    assert not ink[5][8] and not ink[8][5]
