"""The shim reads sizes (GPUSHARE_MEMORY_LIMIT, GPUSHARE_CONTEXT_BYTES) with the same grammar as
the Python side (jupyter_gpushare/units.py): the two parsers must agree wherever the value fits in
64 bits, and the C one must refuse, never wrap, what does not."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from jupyter_gpushare.units import parse_size
from tests.conftest import _load_build_module

ROOT = Path(__file__).resolve().parents[2]
U64_MAX = (1 << 64) - 1

SIZES = [
    "0",
    "1",
    "1073741824",
    "8GiB",
    "512M",
    "1.5G",
    " 2 t ",
    "0.5k",
    "18446744073709551615",  # the largest 64-bit value: valid on both sides
    "18446744073709551614B",
    "16777215T",
    "16777215.999999T",  # just under 2**64 bytes
    "17179869183.999G",
]
TOO_BIG = ["18446744073709551616", "16777216T", "99999999999999999999", "17179869184G"]
INVALID = ["", "G", "1.2.3", "-1", "5 XB", "1e9"]


@pytest.fixture(scope="module")
def probe(native_build, tmp_path_factory) -> Path:
    build = _load_build_module()
    out = tmp_path_factory.mktemp("sizes") / "size_probe"
    src = ROOT / "native" / "src" / "base"
    return build.build_program(
        [ROOT / "native" / "tests" / "size_probe.c", src / "config.c", src / "log.c"], out
    )


def c_parse(probe: Path, values: list[str]) -> list[int | None]:
    out = subprocess.run([str(probe), *values], capture_output=True, text=True, check=True)
    return [None if line == "invalid" else int(line) for line in out.stdout.splitlines()]


def test_c_and_python_agree_on_every_size_that_fits(probe):
    expected = [parse_size(v) for v in SIZES]
    assert all(e <= U64_MAX for e in expected)
    assert c_parse(probe, SIZES) == expected


def test_sizes_beyond_64_bits_are_refused_not_wrapped(probe):
    for v in TOO_BIG:  # both sides refuse: units.py says why, the C parser fails
        with pytest.raises(ValueError, match="u64"):
            parse_size(v)
    assert c_parse(probe, TOO_BIG) == [None] * len(TOO_BIG)


def test_malformed_sizes_are_refused_on_both_sides(probe):
    for v in INVALID:
        with pytest.raises(ValueError):
            parse_size(v)
    assert c_parse(probe, INVALID) == [None] * len(INVALID)
