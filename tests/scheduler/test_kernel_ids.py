"""The scheduler's kernel-id bindings (scheduler/shell/kernel_ids.py): what proves an id, who may
bind it, and that one user's bindings cannot push another's out."""

from __future__ import annotations

from jupyter_gpushare.scheduler.shell.kernel_ids import (
    PER_USER,
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
    again.restore([*ids.kept(), ["x", "bob", "not-hex"], ["y"], "z", ["", "bob", "0" * 64]])
    assert again.proves("k", "a") and len(again) == 1
