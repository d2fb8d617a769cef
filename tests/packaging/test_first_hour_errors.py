"""Bad input gets one line, exit 2, and nothing started (issue 23, items 4 and 8): the scheduler's
command line and config files, and a build from a git clone on a machine without Node.js."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.packaging.test_packaging import _path_without_node
from tests.packaging.test_readme_first_command import _clean_copy

ROOT = Path(__file__).resolve().parents[2]


def _gpushare(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    sock_dir = tmp_path / "run"
    sock_dir.mkdir(mode=0o700, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env |= {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", *args, "--socket", str(sock_dir / "s.sock")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,  # a scheduler that starts runs on: the old code's failure
        stdin=subprocess.DEVNULL,
    )


def _one_line(out: subprocess.CompletedProcess[str], *words: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    for word in words:
        assert word in text, text
    assert "listening on" not in text


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--metrics-port", "99999"), ("--metrics-port", "65535")),
        (("--pool", "0.5"), ("--pool", "'0.5GiB'")),
    ],
)
def test_bad_scheduler_options(tmp_path: Path, args: tuple[str, ...], words: tuple[str]) -> None:
    _one_line(_gpushare(tmp_path, "scheduler", *args), *words)


@pytest.mark.parametrize("where", ["--config", "config path"])
def test_a_config_file_that_does_not_load_starts_nothing(tmp_path: Path, where: str) -> None:
    config = tmp_path / "config" / "gpushare_config.py"
    config.parent.mkdir()
    config.write_text('c.GPUShareScheduler.pool_size = ("24GiB"\n')
    extra = ("--config", str(config)) if where == "--config" else ()
    _one_line(_gpushare(tmp_path, "scheduler", *extra), "SyntaxError", "gpushare_config")


def test_a_build_without_node_says_so_in_one_line(tmp_path: Path) -> None:
    """A git clone (no prebuilt sidebar) on a machine without Node.js: the build stops at once
    with the one line that says what to install, not a traceback from the JavaScript build."""
    src = tmp_path / "clone"
    _clean_copy(src)
    assert not (src / "jupyter_gpushare" / "labextension" / "package.json").exists()
    env = {**os.environ, "PATH": _path_without_node(tmp_path / "bin")}
    code = "import sys, hatchling.build as b; b.build_wheel(sys.argv[1])"
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "dist")],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert "Node.js" in text and "nodejs.org" in text, text
