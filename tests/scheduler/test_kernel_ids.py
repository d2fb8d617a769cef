"""The scheduler's kernel-id bindings (scheduler/shell/kernel_ids.py): what proves an id, who may
bind it, and that one user's bindings cannot push another's out."""

from __future__ import annotations

from jupyter_gpushare.scheduler.shell.kernel_ids import (
    OWNED_PER_USER,
    PER_USER,
    IdOwners,
    KernelIds,
    bound_id,
    secret_digest,
)


def test_only_the_secret_proves_the_id_and_its_other_gpus() -> None:
    ids = KernelIds()
    assert ids.bind("k", "alice", secret_digest("s3cret")) is None
    assert ids.proves("k", "s3cret") and ids.proves("k/1", "s3cret")
    assert not ids.proves("k", "") and not ids.proves("k", "other")
    assert not ids.proves("k#12", "s3cret") and not ids.proves("k/x", "s3cret")
    assert bound_id("k/1") == "k" and bound_id("a/b") == "a/b" and bound_id("/1") == "/1"


def test_another_user_cannot_rebind_but_the_owner_can() -> None:
    ids = KernelIds()
    ids.bind("k", "alice", secret_digest("one"))
    assert ids.bind("k", "mallory", secret_digest("mine")) is not None
    assert ids.proves("k", "one")
    assert ids.bind("k", "alice", secret_digest("two")) is None  # a restarted kernel
    assert ids.proves("k", "two") and not ids.proves("k", "one")


def test_one_users_bindings_do_not_push_out_anothers() -> None:
    ids = KernelIds()
    ids.bind("alice-k", "alice", secret_digest("a"))
    for n in range(PER_USER + 50):
        ids.bind(f"m-{n}", "mallory", secret_digest("m"))
    assert ids.proves("alice-k", "a")
    assert len(ids) == PER_USER + 1
    assert ids.binding("m-0") is None and ids.binding(f"m-{PER_USER + 49}") is not None


def test_bindings_are_kept_and_malformed_ones_skipped() -> None:
    ids = KernelIds()
    ids.bind("k", "alice", secret_digest("a"))
    again = KernelIds()
    bad = [["x", "not-hex"], ["y"], "z", ["", "0" * 64]]
    again.restore({**ids.kept(), "bob": bad, "": [["w", "0" * 64]], "carol": "no list"})
    assert again.proves("k", "a") and len(again) == 1


def test_each_users_bindings_are_kept_whatever_another_binds() -> None:
    """Before: the newest 1,024 of all users together were kept; mallory's 1,024 pushed alice's
    out of the next scheduler's."""
    ids = KernelIds()
    ids.bind("alice-k", "alice", secret_digest("a"))
    for n in range(PER_USER):
        ids.bind(f"m-{n}", "mallory", secret_digest("m"))
    again = KernelIds()
    again.restore(ids.kept())
    assert again.proves("alice-k", "a") and len(again) == PER_USER + 1


def test_one_users_owned_ids_do_not_push_out_anothers() -> None:
    """Before: one list of 16,384 owners for everyone; 16,500 of mallory's binds flushed
    alice's."""
    owners = IdOwners()
    owners.remember("alice-k", "alice")
    for n in range(OWNED_PER_USER + 100):
        owners.remember(f"m-{n}", "mallory")
    assert owners.get("alice-k") == "alice"
    assert owners.get("m-0") is None and owners.get(f"m-{OWNED_PER_USER + 99}") == "mallory"
    assert len(owners) == OWNED_PER_USER + 1
    owners.remember("alice-k", "bob")  # an id that changes hands leaves its former user's list
    assert owners.get("alice-k") == "bob" and len(owners) == OWNED_PER_USER + 1
