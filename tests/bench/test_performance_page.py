"""docs/performance.md is exactly what the documented command writes from the committed results
(`python3 -m bench.report docs/perf-runs --update-docs`), so running it loses nothing: what the
report does not write lives in docs/performance-notes.md, which the page links."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.report import COMMITTED

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_the_committed_page_is_what_the_report_writes(tmp_path: Path) -> None:
    assert COMMITTED == "python3 -m bench.report docs/perf-runs --update-docs"
    doc = tmp_path / "performance.md"
    # The command less --update-docs, which would write into the tree: the same page elsewhere.
    images = str(tmp_path / "images")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.report",
            "docs/perf-runs",
            "--doc",
            str(doc),
            "--images",
            images,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert doc.read_text() == (DOCS / "performance.md").read_text(), (
        "docs/performance.md is not what the report writes: run "
        f"`{COMMITTED}` and move hand-written text to docs/performance-notes.md"
    )


def test_the_hand_written_notes_are_kept_and_linked() -> None:
    page = (DOCS / "performance.md").read_text()
    notes = (DOCS / "performance-notes.md").read_text()
    assert "[performance-notes.md](performance-notes.md)" in page
    # What the report does not write: the cold-eviction study and the "measured at" column.
    assert "## 9. Cold eviction" in notes and "## 9. Cold eviction" not in page
    assert "| benchmark | target | result | met | measured at |" in notes
