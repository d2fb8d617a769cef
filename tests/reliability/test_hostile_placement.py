"""Issue 22, A26, as real separate uids: ``place`` ghost reservations.

The provisioner places a kernel before it starts (the ``place`` control action): room is kept on
the chosen GPU until the kernel connects or the reservation expires (``placement_timeout``).
mallory places 40 made-up kernel ids of 4 GiB each that never connect: before, both 4 GiB GPUs
looked full for two minutes, and alice's 1 GiB kernel was placed as if it fit nowhere. Now a
user has at most 16 pending (her oldest make way for her newest), and another user's
reservations are only hints: where they would leave no room, alice is placed without them.
"""

from __future__ import annotations

from typing import Any

from local_users import control, open_to_everyone, run_as

from jupyter_gpushare.protocol import MsgType

GIB = 1 << 30


def _place_many(path: str, count: int, need: int) -> list[Any]:
    body = {"action": "place", "need": need}
    return [control(path, MsgType.CONTROL, {**body, "client": f"ghost-{n}"}) for n in range(count)]


async def test_a26_ghost_reservations_do_not_fill_every_gpu(
    local_users: Any, make_scheduler: Any
) -> None:
    mallory, alice = local_users("mallory"), local_users("alice")
    node = await make_scheduler(pool_size="4GiB", placement_timeout=120.0)
    open_to_everyone(node)
    for n in range(2):
        node._register_device(f"GPU-a26-{n}", "Test GPU", 8 * GIB)
    path = node.socket_path
    answers = await run_as(mallory, _place_many, path, 40, 4 * GIB)
    assert all(a[0] == MsgType.CONTROL_REPLY for a in answers), answers[:2]
    held = [p for cid, p in node._placements.items() if cid.startswith("ghost-")]
    assert len(held) == 16, held
    (kind, reply) = await run_as(
        alice, control, path, MsgType.CONTROL, {"action": "place", "client": "k", "need": GIB}
    )
    assert kind == MsgType.CONTROL_REPLY, reply
    assert reply["body"]["fits"] is True, reply
    # Her own placements still work: her newest reservation is kept.
    assert "ghost-39" in node._placements
