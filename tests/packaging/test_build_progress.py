"""pip shows only a spinner while a build runs, and the sidebar's takes minutes: the build hook
says what it does on the terminal itself (/dev/tty, which pip does not capture), and on stderr
where there is no terminal (CI), which `pip install -v` shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_build_says_what_it_does_without_a_terminal() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import hatch_build; hatch_build.say('building the sidebar')"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,  # no controlling terminal, as in CI
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == "jupyter-gpushare: building the sidebar\n", out.stderr


def test_the_install_guide_names_the_npm_registry_and_the_proxy_variables() -> None:
    text = (ROOT / "docs" / "install.md").read_text()
    for words in ("https://registry.npmjs.org", "YARN_HTTPS_PROXY", "YARN_CA_FILE_PATH"):
        assert words in text
    assert "HTTPS_PROXY" in text and "PIP_CERT" in text
