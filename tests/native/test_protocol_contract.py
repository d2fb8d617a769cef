"""The wire contract has two halves, native/src/protocol.h and jupyter_gpushare/protocol.py: this
test reads both and fails on any message type or field tag that one side names differently."""

from __future__ import annotations

import re
from pathlib import Path

from jupyter_gpushare.protocol import FIELDS, MsgType

HEADER = Path(__file__).resolve().parents[2] / "native" / "src" / "protocol.h"


def _c_enum(prefix: str) -> dict[str, int]:
    text = HEADER.read_text()
    return {
        name.lower(): int(value, 0)
        for name, value in re.findall(rf"\b{prefix}([A-Z0-9_]+)\s*=\s*(0x[0-9A-Fa-f]+|\d+)", text)
        if name != "MAX"
    }


def test_message_types_agree():
    c_side = _c_enum("GS_MSG_")
    py_side = {m.name.lower(): int(m) for m in MsgType}
    assert c_side == py_side
    # The pre-copy pair this contract was extended with.
    assert c_side["precopy"] == 0x87 and c_side["precopied"] == 0x09


# Fields the C side has and the Python side does not read yet, with why.
C_ONLY = {"resume_secret": "issue 15: the scheduler's half lands with its own change"}


def test_field_tags_agree():
    c_side = _c_enum("GS_TAG_")
    py_side = {name: tag for tag, (name, _type) in FIELDS.items()}
    assert {k: v for k, v in c_side.items() if k not in C_ONLY} == py_side
    assert c_side["precopied_bytes"] == 43
