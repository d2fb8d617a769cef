"""Issue 22, item 11 (A29c), as real separate uids: token users and local accounts are two
namespaces. A hub user who is named like a local account (the hub's admin made "bob" a hub user
on a node where bob is also a system user) must not own that account's kernels: a token for a
local account's name is refused, on a HELLO and on a control request."""

from __future__ import annotations

from local_users import control, exchange, run_as
from test_hostile_user_held import (  # noqa: F401  (fixtures)
    VICTIM_ID,
    Scene,
    hello,
    open_tmp,
    people,
    refused,
    scene,
)

from jupyter_gpushare.protocol import ErrorCode, MsgType


async def test_a_token_for_a_local_accounts_name_is_refused(scene: Scene) -> None:  # noqa: F811
    victim, hub = scene.people.victim, scene.people.hub
    name, token = victim.name, scene.token(victim.name)
    release = {"action": "release", "client": VICTIM_ID}
    answer = await run_as(
        hub, control, scene.path, MsgType.CONTROL, release, {"user": name, "token": token}
    )
    refused(answer, ErrorCode.FORBIDDEN, "a token may not speak for a local account")
    answers, _ = await run_as(
        hub, exchange, scene.path, [hello(client_id="k2", user=name, token=token)]
    )
    refused(answers[0], ErrorCode.FORBIDDEN, f"account of uid {victim.uid}")
    # A hub user whose name is no local account is still who the token says.
    other = "hub-only-" + name
    ok = await run_as(
        hub,
        control,
        scene.path,
        MsgType.STATUS_REQUEST,
        None,
        {"user": other, "token": scene.token(other)},
    )
    assert ok[0] == MsgType.STATUS, ok
    await scene.victim_unchanged()
