"""The access rules at their edges (jupyter_gpushare/scheduler/shell/access.py): the users
config's quota ceiling, and who may have MPS end a process on a uid that many users share.
The scheduler's end-to-end tests (test_security.py, test_scheduler_control.py) ask far from
these edges; the mutation check (tools/mutation_check.py) found a ceiling doubled and the
shared-uid rule dropped both passing them."""

from __future__ import annotations

from pathlib import Path

from jupyter_gpushare.scheduler.shell.access import Access, AccessFiles
from jupyter_gpushare.scheduler.shell.users import Identity, load_users_config

GiB = 1 << 30
HUB_UID = 4242  # the uid every hub user's kernel runs as (token_uids)


def access(tmp_path: Path) -> Access:
    config = tmp_path / "users.toml"
    config.write_text('[defaults]\nquota = "8GiB"\n\n[users.alice]\nquota = "none"\n')
    files = AccessFiles(load_users_config(str(config)), b"k" * 32, frozenset({HUB_UID}))
    return Access(own_uid=0, files=files)


def test_a_quota_over_the_ceiling_by_a_byte_is_refused_unless_an_admin_sets_it(tmp_path):
    rules = access(tmp_path)
    bob = Identity("bob", 1001)
    assert rules.quota_refusal(bob, bob, 8 * GiB) is None  # at the ceiling
    assert rules.quota_refusal(bob, bob, 1 * GiB) is None
    over = rules.quota_refusal(bob, bob, 8 * GiB + 1)
    assert over and "over the ceiling of 8.00 GiB" in over, over
    assert "no quota" in (rules.quota_refusal(bob, bob, 0) or "")  # none where there is one
    admin = Identity("ops", 0, admin=True)
    assert rules.quota_refusal(admin, bob, 64 * GiB) is None
    alice = Identity("alice", 1002)  # no ceiling for her
    assert rules.quota_refusal(alice, alice, 64 * GiB) is None
    assert rules.effective_quota(bob, 9 * GiB) == 8 * GiB
    assert rules.effective_quota(bob, 9 * GiB, by_admin=True) == 9 * GiB


def test_on_a_shared_uid_only_the_kernels_own_user_may_have_it_terminated(tmp_path):
    rules = access(tmp_path)
    bob = Identity("bob", HUB_UID, token=True)
    # The process runs as the hub's uid, as bob's does: the uid proves nothing.
    assert not rules.may_terminate(bob, HUB_UID, HUB_UID, kernel_users=["alice"])
    assert rules.may_terminate(bob, HUB_UID, HUB_UID, kernel_users=["bob"])
    assert not rules.may_terminate(None, HUB_UID, HUB_UID, kernel_users=["alice"])
    admin = Identity("ops", 0, admin=True)
    assert rules.may_terminate(admin, 0, HUB_UID, kernel_users=["alice"])
    # Off the shared uid, the uid rule: the owner (or an admin uid) only.
    carol = Identity("carol", 1003)
    assert rules.may_terminate(carol, 1003, 1003, kernel_users=[])
    assert not rules.may_terminate(carol, 1003, 1004, kernel_users=["carol"])
