"""The README opens with two commands (run JupyterLab; run the tests) and CI must run the second
one verbatim: a README whose test command drifts from .ci/run fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("## ")]  # the commands stand before the first section
    return re.findall(r"```bash\n(.+?)\n```", head)


def test_the_readme_opens_with_a_lab_command_and_a_test_command() -> None:
    lab, tests = _readme_commands()
    assert lab.endswith(".venv/bin/gpushare lab"), lab
    assert tests.endswith(".venv/bin/pytest"), tests


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    _lab, tests = _readme_commands()
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines, f"{tests!r} is not a line of .ci/run"
