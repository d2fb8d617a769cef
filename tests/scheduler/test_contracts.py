"""Contracts the C shim and the Python side share, read from both sides.

Message types and field tags (native/src/base/protocol.h vs jupyter_gpushare/protocol.py), the
frame's constants, the version (shim.h vs _version.py), the default socket path (the shim's C vs
paths.py) and the size syntax (config.c's parser, compiled here, vs units.py). A change on one
side only fails here, not in a user's session.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpushare import protocol
from jupyter_gpushare._version import __version__
from jupyter_gpushare.paths import SYSTEM_SOCKET, default_socket_path
from jupyter_gpushare.units import parse_size

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "native" / "src"
BASE = SRC / "base"
HERE = Path(__file__).resolve().parent


def _c_enum(header: str, name: str) -> dict[str, int]:
    body = re.search(r"enum\s+" + name + r"\s*\{(.*?)\}", header, re.S)
    assert body, f"enum {name} not found in protocol.h"
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", body.group(1), flags=re.S)
    out = {}
    for entry in text.split(","):
        if entry.strip():
            key, _, value = entry.partition("=")
            out[key.strip()] = int(value.strip(), 0)
    return out


def _c_define(text: str, name: str) -> str:
    match = re.search(rf"#define\s+{name}\s+(\S+)", text)
    assert match, f"#define {name} not found"
    return match.group(1)


def test_message_types_agree() -> None:
    header = (BASE / "protocol.h").read_text()
    c_types = {k.removeprefix("GS_MSG_"): v for k, v in _c_enum(header, "gs_msg_type").items()}
    assert c_types == {t.name: int(t) for t in protocol.MsgType}


def test_field_tags_agree() -> None:
    header = (BASE / "protocol.h").read_text()
    c_tags = _c_enum(header, "gs_tag")
    tag_max = c_tags.pop("GS_TAG_MAX")
    c_fields = {k.removeprefix("GS_TAG_").lower(): v for k, v in c_tags.items()}
    # Every tag either side knows, the other knows under the same name and number.
    assert c_fields == protocol.FIELD_TAGS
    assert tag_max == max(c_fields.values())


def test_frame_constants_agree() -> None:
    header = (BASE / "protocol.h").read_text()
    assert int(_c_define(header, "GS_PROTO_VERSION"), 0) == protocol.VERSION
    assert int(_c_define(header, "GS_PROTO_HEADER"), 0) == protocol.HEADER.size
    assert int(_c_define(header, "GS_PROTO_MAX_PAYLOAD").rstrip("uU"), 0) == protocol.MAX_PAYLOAD


def test_versions_agree() -> None:
    shim_h = (BASE / "shim.h").read_text()
    assert _c_define(shim_h, "GS_VERSION") == f'"{__version__}"'


def _socket_path_function() -> str:
    """The C function that computes the default socket path, in whichever room of native/src
    keeps it."""
    for source in sorted(SRC.glob("*/*.c")):
        text = source.read_text()
        match = re.search(r"\n[^\n]*gs_socket_default_path\([^)]*\)\s*\{(.*?)\n\}", text, re.S)
        if match:
            return match.group(1)
    raise AssertionError("no gs_socket_default_path() in native/src/*/*.c")


def test_default_socket_path_agrees() -> None:
    body = _socket_path_function()
    literals = re.findall(r'"((?:[^"\\]|\\.)*)"', body)
    # The order of the shim's choices: $GPUSHARE_SOCKET, root's system socket, then
    # ${XDG_RUNTIME_DIR:-/tmp}/gpushare-$UID/scheduler.sock.
    assert "GPUSHARE_SOCKET" in literals and "XDG_RUNTIME_DIR" in literals
    assert SYSTEM_SOCKET in literals
    assert default_socket_path({}, uid=0) == SYSTEM_SOCKET
    fallback = [s for s in literals if s.startswith("/") and s != SYSTEM_SOCKET]
    assert fallback == ["/tmp"], literals
    per_user = [s for s in literals if "%u" in s]
    assert len(per_user) == 1, literals
    c_format = per_user[0].replace("%u", "%d")
    for env, runtime in (({"XDG_RUNTIME_DIR": "/run/user/1234"}, "/run/user/1234"), ({}, "/tmp")):
        assert default_socket_path(env, uid=1234) == c_format % (runtime, 1234)
    assert default_socket_path({"GPUSHARE_SOCKET": "/x/y.sock"}, uid=1234) == "/x/y.sock"


# -- the size syntax ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def c_parse(tmp_path_factory: pytest.TempPathFactory) -> Any:
    spec = importlib.util.spec_from_file_location("gpushare_native_build", ROOT / "native/build.py")
    assert spec and spec.loader
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    out = tmp_path_factory.mktemp("size") / "size_probe"
    # config.c holds the parser; log.c what config.c logs with.
    sources = [HERE / "contracts" / "size_probe.c", BASE / "config.c", BASE / "log.c"]
    build.build_program(sources, out)

    def parse(texts: list[str]) -> list[int | None]:
        run = subprocess.run(
            [str(out)], input="".join(t + "\n" for t in texts), capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        return [None if v == "-" else int(v) for v in run.stdout.splitlines()]

    return parse


def _py_parse(text: str) -> int | None:
    try:
        return parse_size(text)
    except ValueError:
        return None


EDGES = [
    "0",
    "1",
    "24GiB",
    "24 GiB",
    " 24gib ",
    "512M",
    "512mb",
    "1.5G",
    "1.",
    ".5G",
    ".",
    "",
    "1e3",
    "-1",
    "+1",
    "0x10",
    "1KiB",
    "1kB",
    "1 T",
    "1.0000000000001T",
    "3.999999999999999999K",
    "16777215.99999T",
    "16777216T",
    "16777215T",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999",
    "17179869184G",
    "17179869183.999G",
    "1 G B",
    "1GiBs",
    "G",
    "1\t\vG",
    "\u0663",
    "1\u00a0G",
    "\uff11G",
    "1 gib\r",
    "1._5",
    "1..5",
    "12abc",
    "1PiB",
    "1 B",
]


def test_size_syntax_agrees_on_edge_cases(c_parse: Any) -> None:
    got = c_parse(EDGES)
    mismatches = [
        (t, c, _py_parse(t)) for t, c in zip(EDGES, got, strict=True) if c != _py_parse(t)
    ]
    assert not mismatches, mismatches


_size_text = st.builds(
    lambda ws1, num, ws2, unit, ws3: f"{ws1}{num}{ws2}{unit}{ws3}",
    st.sampled_from(["", " ", "\t"]),
    st.one_of(
        st.integers(0, 1 << 66).map(str),
        st.decimals(min_value=0, max_value=1 << 45, allow_nan=False, places=6).map(str),
        st.from_regex(r"[0-9]{0,22}(\.[0-9]{0,16})?", fullmatch=True),
    ),
    st.sampled_from(["", " "]),
    st.sampled_from(
        [
            "",
            "b",
            "K",
            "kb",
            "KiB",
            "m",
            "MB",
            "mib",
            "G",
            "gb",
            "GiB",
            "t",
            "TB",
            "TiB",
            "P",
            "x",
            "Gi",
        ]
    ),
    st.sampled_from(["", " "]),
)


@settings(max_examples=400, deadline=None)
@given(texts=st.lists(_size_text, min_size=1, max_size=50))
def test_size_syntax_agrees_on_generated_sizes(c_parse: Any, texts: list[str]) -> None:
    got = c_parse(texts)
    mismatches = [
        (t, c, _py_parse(t)) for t, c in zip(texts, got, strict=True) if c != _py_parse(t)
    ]
    assert not mismatches, mismatches
