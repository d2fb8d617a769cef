"""Typos are refused, not taken at their word: a bare number below 1 MiB for a pool, quota or
memory limit ("did you mean 24GiB?"), stray words before ``--``, unknown options, and negative
sizes in both flag forms. Each is one line that names the flag as the user typed it, exit 2, and
nothing started. The shim reads GPUSHARE_MEMORY_LIMIT by the same rule as the Python side."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpushare.scheduler.shell.users import UsersConfigError, parse_users_config
from jupyter_gpushare.shim import shim_environment
from jupyter_gpushare.units import BARE_NUMBER_FLOOR, parse_memory_size, parse_size

ROOT = Path(__file__).resolve().parents[2]


def _gpushare(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    sock_dir = tmp_path / "run"
    sock_dir.mkdir(mode=0o700, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "GPUSHARE_"))}
    env |= {
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "PYTHONPATH": str(ROOT),
        "GPUSHARE_SOCKET": str(sock_dir / "s.sock"),
    }
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # a scheduler that starts runs on: the old code's failure
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    ("args", "words", "not_words"),
    [
        (("scheduler", "--pool", "24"), ("--pool", "did you mean 24GiB?"), ("pool_size",)),
        (("scheduler", "--pool", "-1GiB"), ("--pool", "cannot be negative"), ("expected one",)),
        (("scheduler", "--pool=-1GiB"), ("--pool", "cannot be negative"), ("pool_size",)),
        (("scheduler", "--bogus"), ("unknown option --bogus",), ("expected one",)),
        (("--bogus",), ("gpushare: unknown option --bogus",), ("expected one",)),
        (("scheduler", "--log-format", "yaml"), ("--log-format", "'yaml'"), ("log_style",)),
        (("scheduler", "--metrics-port", "99999"), ("--metrics-port", "65535"), ("metrics_port",)),
        (("scheduler", "stray"), ("unexpected argument 'stray'",), ()),
        (("scheduler", "--pool"), ("--pool needs a value",), ()),
        (
            ("run", "--memory-limit", "24", "GB", "--", "true"),
            ("'GB' before `--`", "did you mean --memory-limit 24GB?"),
            (),
        ),
        (("run", "GB", "--", "true"), ("'GB' before `--`",), ()),
        (("run", "--memory-limit", "24", "--", "true"), ("--memory-limit", "24GiB?"), ()),
        (("run", "--memory-limit", "-1GiB", "--", "true"), ("cannot be negative",), ()),
        (("status", "--json", "extra"), ("unexpected argument 'extra'",), ()),
    ],
)
def test_a_typo_is_one_line_naming_the_flag(
    tmp_path: Path, args: tuple[str, ...], words: tuple[str, ...], not_words: tuple[str, ...]
) -> None:
    out = _gpushare(tmp_path, *args)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    for word in words:
        assert word in text, text
    for word in not_words:
        assert word not in text, text
    assert "listening on" not in text


def test_a_config_file_names_its_own_setting(tmp_path: Path) -> None:
    config = tmp_path / "config" / "gpushare_config.py"
    config.parent.mkdir()
    config.write_text("c.GPUShareScheduler.pool_size = 24\n")
    out = _gpushare(tmp_path, "scheduler", "--no-nvml")
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "c.GPUShareScheduler.pool_size: invalid size 24" in text, text
    assert "did you mean 24GiB?" in text and "listening on" not in text, text


@pytest.mark.parametrize("value", ["24", 24, "1048575", " 3 ", "0.5"])
def test_a_bare_number_under_a_mebibyte_is_a_forgotten_unit(value: Any) -> None:
    with pytest.raises(ValueError, match=rf"did you mean {str(value).strip()}GiB\?"):
        parse_memory_size(value)


@pytest.mark.parametrize("value", ["0", 0, "24B", "512KiB", "1048576", 1 << 20, "24GiB"])
def test_sizes_meant_as_written_still_parse(value: Any) -> None:
    assert parse_memory_size(value) == parse_size(value)


def test_quotas_in_the_users_config_follow_the_rule() -> None:
    with pytest.raises(UsersConfigError, match="did you mean 8GiB"):
        parse_users_config({"users": {"a": {"quota": 8}}})


def test_a_small_quota_reaches_the_shim_with_its_unit() -> None:
    env = shim_environment({}, library="/x/libgpushare.so", quota="512KiB")
    assert env["GPUSHARE_MEMORY_LIMIT"] == "524288B"
    env = shim_environment({}, library="/x/libgpushare.so", quota="8GiB")
    assert env["GPUSHARE_MEMORY_LIMIT"] == str(8 << 30)


#: The same texts through both sides: refused by parse_memory_size exactly where the shim ignores
#: GPUSHARE_MEMORY_LIMIT with its "did you mean" warning.
SHIM_CASES = ["24", "1048575", "0.5", "0", "24B", "512KiB", "1048576", "2GiB"]


def test_the_shim_reads_memory_limits_by_the_same_rule(harness: Any) -> None:
    for value in SHIM_CASES:
        try:
            expected: int | None = parse_memory_size(value)
        except ValueError:
            expected = None
        run = harness.run("status", memory_limit=value).ok()
        quota = run.event("status")["status"]["quota_bytes"]
        warned = [line for line in run.shim_lines if "did you mean" in line]
        if expected is None:
            assert quota == 0 and warned, (value, run.describe())
            assert f"did you mean {value}GiB?" in warned[0], warned
        else:
            assert quota == expected and not warned, (value, run.describe())
    assert BARE_NUMBER_FLOOR == 1 << 20
