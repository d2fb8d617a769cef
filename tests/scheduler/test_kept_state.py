"""The kept state (``state.json``, scheduler/shell/resume.py): bounded in bytes by its writer,
each user's share on its own; read whole or refused whole, with a log line."""

from __future__ import annotations

import os
from typing import Any

import pytest

from jupyter_gpushare.scheduler.shell.kernel_ids import KernelIds, secret_digest
from jupyter_gpushare.scheduler.shell.resume import (
    MAX_STATE_BYTES,
    PER_USER_BYTES,
    KeptClient,
    KeptState,
    fair_shares,
)

LONG = "\U0001f600" * 249  # 12 bytes a character in JSON


def test_fair_shares_give_each_its_want_or_an_equal_share() -> None:
    assert fair_shares({"a": 10, "b": 20}, 100) == {"a": 10, "b": 20}
    assert fair_shares({"a": 10, "b": 200, "c": 200}, 100) == {"a": 10, "b": 45, "c": 45}
    assert sum(fair_shares({str(n): 1000 for n in range(7)}, 100).values()) <= 100


def test_one_users_long_ids_take_only_that_users_share() -> None:
    ids = KernelIds()
    ids.bind("alice-k", "alice", secret_digest("a"))
    for n in range(1024):
        ids.bind(f"{LONG}{n:07d}", "mallory", secret_digest("m"))
    clients = [KeptClient(f"{LONG}c{n}", f"{LONG}c{n}", 1001, "mallory") for n in range(200)]
    clients.append(KeptClient("alice-k", "alice-k", 1000, "alice", "g1", 1.0))
    text = KeptState(1.0, clients, ids.kept()).to_json()
    mallorys = len(text.encode()) - len(KeptState(1.0, clients[-1:], {}).to_json().encode())
    assert mallorys <= PER_USER_BYTES + 1024, mallorys
    back = KeptState.from_json(text)
    assert back.find("alice-k", 1000) is not None
    again = KernelIds()
    again.restore(back.bound)
    assert again.proves("alice-k", "a")


def test_many_users_together_stay_under_the_bound_and_the_small_keep_all() -> None:
    bound = {f"user{u}": [[f"{LONG}{n:07d}", "0" * 64] for n in range(200)] for u in range(90)}
    bound["alice"] = [["alice-k", "1" * 64]]
    text = KeptState(1.0, [], bound).to_json()
    assert len(text.encode()) <= MAX_STATE_BYTES
    assert KeptState.from_json(text).bound["alice"] == [["alice-k", "1" * 64]]


def test_a_state_written_before_per_user_entries_is_still_read() -> None:
    """An upgrade's restart: the file of the version before keeps its holds and bindings."""
    old = (
        '{"saved": 5.0, "clients": [{"requested_id": "k", "client_id": "k", "uid": 1000, '
        '"user": "alice", "grant": "g", "since": 4.0}], '
        '"bound": [["k", "alice", "' + "1" * 64 + '"], ["j", "alice", "' + "2" * 64 + '"]]}'
    )
    state = KeptState.from_json(old)
    assert state.find("k", 1000) is not None
    assert state.bound == {"alice": [["j", "2" * 64], ["k", "1" * 64]]}


def _private(tmp: str) -> str:
    directory = os.path.join(tmp, ".gpushare-private")
    os.mkdir(directory, 0o700)
    return directory


@pytest.mark.parametrize("what", ["too long", "malformed"])
def test_a_file_over_the_bound_or_malformed_is_refused_whole(tmp_path: Any, what: str) -> None:
    directory = _private(str(tmp_path))
    path = os.path.join(directory, KeptState.FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        if what == "too long":
            f.write('{"saved": 1, "users": {}}' + " " * MAX_STATE_BYTES)
        else:
            f.write('{"saved": 1, "users": {"a": {"clients": [{"x": 1}]}}}')
    why = KeptState.take(directory, now=2.0)
    assert isinstance(why, str) and "none of it is read" in why, why
    assert not os.path.exists(path)


async def test_the_scheduler_says_it_refused_the_kept_state(
    make_scheduler: Any, sock_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    directory = _private(os.path.dirname(sock_path))
    fd = os.open(os.path.join(directory, KeptState.FILE), os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("{not json")
    await make_scheduler()
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("kept state is refused whole" in line for line in lines), lines
