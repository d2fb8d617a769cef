"""The documentation site (docs/conf.py: Sphinx, MyST, the PyData theme) builds from docs/ with
every warning an error and nitpicky references: each link between pages, to a section, or to a
file of the repository resolves (links to the repository's files become GitHub addresses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_with_every_link_resolved(tmp_path: Path) -> None:
    pytest.importorskip("myst_parser", reason="pip install -e '.[docs]' (or '.[test]')")
    pytest.importorskip("pydata_sphinx_theme", reason="pip install -e '.[docs]' (or '.[test]')")
    html = str(tmp_path / "html")
    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-n", "-W", "--keep-going", "-q", "-E", "docs", html],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    index = (tmp_path / "html" / "index.html").read_text()
    for page in ("try-without-a-gpu.html", "install.html", "performance.html"):
        assert page in index and (tmp_path / "html" / page).is_file(), page
    # A link to a file outside the pages went to the repository, not nowhere.
    try_page = (tmp_path / "html" / "try-without-a-gpu.html").read_text()
    assert "github.com/jupyter-gpushare/jupyter-gpushare/blob/main/README.md" in try_page
