"""The `gpushare` command's words a newcomer reads first (issue 23, item 8): whole sentences in
the list of commands, paths printed whole, an unknown command called unknown, and keygen naming
the user's file, not its own temporary one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gpushare(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_list_of_commands_has_whole_sentences() -> None:
    out = _gpushare("--help")
    assert out.returncode == 0, out.stderr
    listing = out.stdout.split("Subcommands\n", 1)[1].split("\nOptions\n", 1)[0]
    summaries = re.findall(r"^\n?[a-z-]+\n    (.+)$", listing, re.M)
    assert len(summaries) >= 7, listing
    for text in summaries:
        assert text.endswith((".", ")")), f"cut mid-sentence: {text!r}"


def test_scheduler_help_prints_the_default_socket_whole() -> None:
    out = _gpushare("scheduler", "--help")
    assert "gpushare-$UID/scheduler.sock" in out.stdout, out.stdout
    assert "users.toml \\\n" in out.stdout  # the example's continuation line kept


def test_an_unknown_command_is_called_unknown() -> None:
    out = _gpushare("nosuchcmd")
    assert out.returncode == 2
    assert "unknown command 'nosuchcmd'" in out.stderr, out.stderr
    for name in ("scheduler", "run", "status", "keygen", "release", "evict", "lab"):
        assert name in out.stderr, name


def test_keygen_into_a_missing_directory(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "user.key"
    out = _gpushare("keygen", str(target))
    assert out.returncode == 1
    assert ".tmp" not in out.stderr and "does not exist" in out.stderr, out.stderr
    assert str(target.parent) in out.stderr
