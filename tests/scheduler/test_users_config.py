"""The users config file: validation errors, precedence, admins, group membership."""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

import pytest

from jupyter_gpushare.scheduler.shell.users import (
    Limits,
    UsersConfigError,
    load_users_config,
    parse_users_config,
    resolve_uids,
    system_groups,
)

GiB = 1 << 30
MY_GROUP = grp.getgrgid(os.getgid()).gr_name


def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "users.toml"
    path.write_text(text)
    return load_users_config(str(path))


FULL = f"""
[defaults]
quota = "8GiB"
weight = 1.0

[admins]
users = ["ops"]
groups = ["gpuadmins"]
uids = [1234]

[users.alice]
quota = "40GiB"
weight = 2

[users.dave]
weight = 0.25

[groups.students]
members = ["bob", "carol", "dave"]
quota = "4GiB"
weight = 0.5

[groups.staff]
members = ["carol"]
quota = "none"

[groups.gpuadmins]
members = ["erin"]

[groups.{MY_GROUP}]
weight = 3
"""


def test_precedence(tmp_path: Path) -> None:
    cfg = load(tmp_path, FULL)
    lim = lambda user: cfg.limits(user, cfg.listed_groups(user))  # noqa: E731
    assert lim("nobody-listed") == Limits(8 * GiB, 1.0)  # defaults
    assert lim("alice") == Limits(40 * GiB, 2.0)  # the user's own section
    assert lim("bob") == Limits(4 * GiB, 0.5)  # the group
    # Several groups: the most generous ("none" beats any size; the larger weight).
    assert lim("carol") == Limits(0, 0.5)
    # Settings resolve one by one: dave's own weight, his group's quota.
    assert lim("dave") == Limits(4 * GiB, 0.25)
    # A system group in the file, membership from the system.
    assert cfg.limits("x", frozenset({MY_GROUP})) == Limits(8 * GiB, 3.0)
    assert cfg.needs_system_groups


def test_admins(tmp_path: Path) -> None:
    cfg = load(tmp_path, FULL)
    assert cfg.is_admin("ops", None, frozenset())
    assert cfg.is_admin("erin", None, cfg.listed_groups("erin"))  # group with members
    assert cfg.is_admin("someone", 1234, frozenset())  # by uid
    assert not cfg.is_admin("someone", None, frozenset())
    assert not cfg.is_admin("alice", 1000, cfg.listed_groups("alice"))


def test_effective_quota_and_weight() -> None:
    assert Limits(0).effective_quota(0) == 0 and Limits(0).effective_quota(5) == 5
    assert Limits(8).effective_quota(0) == 8 and Limits(8).effective_quota(5) == 5
    assert Limits(8).effective_quota(9) == 8
    assert Limits(0, None).effective_weight(7.0) == 7.0  # nothing configured: the kernel's own
    assert Limits(0, 2.0).effective_weight(1.0) == 2.0
    assert Limits(0, 2.0).effective_weight(0.5) == 1.0  # a kernel may lower its weight
    assert Limits(0, 2.0).effective_weight(10.0) == 2.0  # never raise it


def test_empty_and_missing(tmp_path: Path) -> None:
    cfg = load_users_config("")
    assert cfg.limits("anyone", frozenset()) == Limits(0, None)
    assert not cfg.needs_system_groups
    with pytest.raises(UsersConfigError, match="does not exist"):
        load_users_config(str(tmp_path / "nope.toml"))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[defaults\n", "not valid TOML"),
        ("[quotas]\n", r"unknown section\(s\).*allowed: admins, defaults, groups, users"),
        ('[defaults]\nquota = "lots"\n', r"defaults\.quota: .*lots"),
        ("[defaults]\nquota = 0\n", r"defaults\.quota: must be positive"),
        ("[defaults]\nquota = true\n", r"defaults\.quota: a size"),
        ('[users.alice]\nquota = "-1GiB"\n', r"users\.alice\.quota"),
        ("[users.alice]\nweight = -1\n", r"users\.alice\.weight: must be a positive number"),
        ("[users.alice]\nweight = 0\n", r"users\.alice\.weight: must be a positive number"),
        ('[users.alice]\nweight = "2"\n', r"users\.alice\.weight: a number"),
        ("[users.alice]\nweight = nan\n", r"users\.alice\.weight: must be a positive number"),
        ("[users.alice]\nquotta = 1\n", r"users\.alice: unknown key\(s\) quotta"),
        ("[users.alice]\nmembers = []\n", r"users\.alice: unknown key\(s\) members"),
        ("[users]\nalice = 3\n", r"users\.alice: must be a table"),
        ("[groups.no-such-group-zz]\nquota = '1GiB'\n", "no system group 'no-such-group-zz'"),
        ("[groups.g]\nmembers = 'bob'\n", r"groups\.g\.members: a list of names"),
        ("[admins]\ngroups = ['no-such-group-zz']\n", "unknown group 'no-such-group-zz'"),
        ("[admins]\nuids = [-1]\n", r"admins\.uids: a list of uids"),
        ("[admins]\nusers = 'ops'\n", r"admins\.users: a list of names"),
        ("[admins]\nroot = true\n", r"admins: unknown key\(s\) root"),
    ],
)
def test_validation_errors(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(UsersConfigError, match=error) as exc:
        load(tmp_path, text)
    assert str(tmp_path / "users.toml") in str(exc.value)  # every error names the file


def test_system_lookups() -> None:
    me = pwd.getpwuid(os.getuid()).pw_name
    assert MY_GROUP in system_groups(me, os.getgid())
    assert system_groups("no-such-user-zz") == frozenset()
    assert resolve_uids([5, "6", me]) == {5, 6, os.getuid()}
    with pytest.raises(UsersConfigError, match="no user 'no-such-user-zz'"):
        resolve_uids(["no-such-user-zz"])


def test_parse_without_a_file() -> None:
    cfg = parse_users_config({"users": {"a": {"quota": 1 << 30}}})
    assert cfg.limits("a", frozenset()).quota == 1 << 30
