"""Restore ahead on the wire (docs/protocol.md, "Restore ahead"): the decision's frame, the
shim's answer (RESTORED with flag 1) and Jupyter's hint (kernel_state "coming")."""

from __future__ import annotations

from jupyter_gpushare.protocol import Message, MsgType, decode_frame, encode
from jupyter_gpushare.scheduler.core.events import Coming, RestoreAhead, Restored
from jupyter_gpushare.scheduler.shell.translate import (
    Refusal,
    check_client_action,
    decision_message,
    shim_event,
)

GiB = 1 << 30
MEMORY = {"used": 9 * GiB, "managed": 8 * GiB, "pinned": GiB, "evicted": 8 * GiB}


def test_a_restore_ahead_goes_out_as_its_own_frame() -> None:
    msg = decision_message(RestoreAhead("k1", 8 * GiB))
    assert msg.type == MsgType.RESTORE_AHEAD == 0x89
    assert decode_frame(encode(msg)) == msg


def test_the_answer_to_a_restore_ahead_says_what_stayed_and_what_is_clean() -> None:
    fields = {
        "flag": 1,
        "bytes_moved": 6 * GiB,
        "micros": 130_000,
        "evicted_bytes": 2 * GiB,
        "precopied_bytes": 6 * GiB,
    }
    event = shim_event(Message(MsgType.RESTORED, fields), "k1", 3.0, MEMORY)
    assert event == Restored(3.0, "k1", 6 * GiB, 130_000, True, 2 * GiB, 6 * GiB)
    # a claim of clean bytes is bounded by what the client could have restored
    fields["precopied_bytes"] = 100 * GiB
    event = shim_event(Message(MsgType.RESTORED, fields), "k1", 3.0, MEMORY)
    assert isinstance(event, Restored) and event.precopied == 8 * GiB


def test_a_restored_after_a_grant_is_no_restore_ahead() -> None:
    msg = Message(MsgType.RESTORED, {"bytes_moved": GiB, "micros": 20_000})
    event = shim_event(msg, "k1", 3.0, MEMORY)
    assert event == Restored(3.0, "k1", GiB, 20_000)
    assert isinstance(event, Restored) and not event.ahead


def test_jupyter_says_a_cell_is_coming() -> None:
    action = check_client_action("kernel_state", {"client": "k1", "state": "coming"})
    assert not isinstance(action, Refusal)
    assert action.event(5.0) == Coming(5.0, "k1")
    assert action.reply()["state"] == "coming"
    refused = check_client_action("kernel_state", {"client": "k1", "state": "soon"})
    assert isinstance(refused, Refusal)


def test_the_switch_reaches_the_policy_and_is_off_by_default() -> None:
    from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler

    assert GPUShareScheduler(restore_ahead=True).policy_config().restore_ahead
    assert not GPUShareScheduler().policy_config().restore_ahead
