from __future__ import annotations

import pytest

from jupyter_gpushare.paths import SYSTEM_SOCKET, default_socket_path
from jupyter_gpushare.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 2**30),
        ("24G", 24 * 2**30),
        ("24gb", 24 * 2**30),
        ("512M", 512 * 2**20),
        ("512 MiB", 512 * 2**20),
        ("1.5G", 1610612736),
        (".5K", 512),
        ("1073741824", 1073741824),
        ("1073741824B", 1073741824),
        ("  2 T ", 2 * 2**40),
        ("0", 0),
        (1073741824, 1073741824),
        (0, 0),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ("", "expected a number"),
        ("GiB", "expected a number"),
        ("-1G", "cannot be negative"),
        ("1.2.3G", "expected a number"),
        ("12 parsecs", "unknown unit 'parsecs'"),
        ("5Gb/s", "expected a number"),
        (-5, "negative"),
        (True, "invalid size"),
        (2.5, "got float"),
        (None, "got NoneType"),
    ],
)
def test_parse_size_errors(bad: object, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(bad)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1024, "1.00 KiB"),
        (1536 * 2**20, "1.50 GiB"),
        (24 * 2**30, "24.00 GiB"),
        (3 * 2**40, "3.00 TiB"),
        (5000 * 2**40, "5000.00 TiB"),
    ],
)
def test_format_size(size: int, text: str) -> None:
    assert format_size(size) == text


def test_parse_format_round_trip() -> None:
    for n in (1, 2**20, 3 * 2**30 + 2**29):
        assert parse_size(format_size(n).replace(" ", "")) == n


def test_socket_path_explicit() -> None:
    assert default_socket_path({"GPUSHARE_SOCKET": "/x/y.sock"}, uid=1000) == "/x/y.sock"
    assert default_socket_path({"GPUSHARE_SOCKET": "/x/y.sock"}, uid=0) == "/x/y.sock"


def test_socket_path_root() -> None:
    assert default_socket_path({"XDG_RUNTIME_DIR": "/run/user/0"}, uid=0) == SYSTEM_SOCKET
    assert SYSTEM_SOCKET == "/run/gpushare/scheduler.sock"


def test_socket_path_user() -> None:
    env = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    assert default_socket_path(env, uid=1000) == "/run/user/1000/gpushare-1000/scheduler.sock"
    assert default_socket_path({}, uid=1000) == "/tmp/gpushare-1000/scheduler.sock"
    assert default_socket_path({"XDG_RUNTIME_DIR": ""}, uid=7) == "/tmp/gpushare-7/scheduler.sock"
    assert default_socket_path({"GPUSHARE_SOCKET": ""}, uid=7) == "/tmp/gpushare-7/scheduler.sock"


def test_socket_path_from_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSHARE_SOCKET", "/somewhere/s.sock")
    assert default_socket_path() == "/somewhere/s.sock"
