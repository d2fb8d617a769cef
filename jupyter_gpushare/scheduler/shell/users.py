"""Users, groups, quotas and who is an admin: the node scheduler's operator config file.

One TOML file (``GPUShareScheduler.users_config``, ``gpushare scheduler --users-config PATH``)::

    [defaults]                  # everyone the file does not name
    quota = "16GiB"             # ceiling of each kernel's memory quota; "none": no ceiling
    weight = 1.0                # fair-share weight of each kernel (GPU time)

    [admins]                    # may see every kernel in full and act on any
    users = ["ops"]
    groups = ["gpuadmins"]      # a system group, or a [groups.NAME] below
    uids = [1001]

    [users.alice]
    quota = "40GiB"
    weight = 2.0

    [groups.students]           # a system group (grp), and/or the hub users listed in members
    members = ["bob", "carol"]
    quota = "8GiB"
    weight = 0.5

Each setting is resolved on its own: the user's section, else the user's groups, else
``[defaults]``, else nothing (no ceiling; the weight the kernel asks for). A user in several
groups that set it gets the most generous: the largest quota ("none" beats any size) and the
largest weight. The file is validated completely when it is loaded (:func:`load_users_config`);
every problem is reported with the file and the key, never later as a traceback.

Identities (:class:`Identity`) come from the scheduler (``SO_PEERCRED``, or a verified token for
peers of a shared uid: :mod:`jupyter_gpushare.identity`); :meth:`UsersConfig.limits` and
:meth:`UsersConfig.is_admin` answer for an identity's user name and groups. Group membership is
read from the system (``getgrouplist``) only when the file names system groups: on a node with a
slow directory service a file without them costs no lookup at all.
"""

from __future__ import annotations

import grp
import math
import os
import pwd
import stat
import sys
from dataclasses import dataclass, field
from typing import Any

from ...units import format_size, parse_memory_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "Identity",
    "Limits",
    "Settings",
    "UsersConfig",
    "UsersConfigError",
    "load_users_config",
    "parse_users_config",
    "system_groups",
]

NO_QUOTA = 0  # a quota of 0 means "none", as everywhere in gpushare


class UsersConfigError(ValueError):
    """The users config file cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Settings:
    """What one section sets; ``None``: not set there (the next level decides)."""

    quota: int | None = None  # bytes; 0 = explicitly no ceiling
    weight: float | None = None


@dataclass(frozen=True)
class Limits:
    """What applies to a user: a quota ceiling (0 = none) and a weight (None = the kernel's own)."""

    quota: int = NO_QUOTA
    weight: float | None = None

    def effective_quota(self, requested: int) -> int:
        """The quota a kernel that asks for ``requested`` (0 = none) gets: at most the ceiling."""
        if self.quota == NO_QUOTA:
            return requested
        return self.quota if requested == NO_QUOTA else min(requested, self.quota)

    def effective_weight(self, requested: float) -> float:
        """The configured weight, scaled down by a kernel that asks for less than 1.

        A kernel may lower its own priority (``GPUSHARE_WEIGHT=0.5`` for a background job) but
        never raise it above what the operator gave its user.
        """
        if self.weight is None:
            return requested
        return self.weight * min(requested, 1.0) if requested > 0 else self.weight


@dataclass(frozen=True)
class Identity:
    """Who a peer is, as the scheduler established it."""

    user: str
    uid: int
    groups: frozenset[str] = frozenset()
    admin: bool = False
    token: bool = False  # established by a verified token (a shared uid), not by the uid alone

    def describe(self) -> str:
        how = "token" if self.token else "uid"
        return f"{self.user} (uid {self.uid}, by {how}{', admin' if self.admin else ''})"


@dataclass(frozen=True)
class UsersConfig:
    """A loaded, validated users config (an empty one when no file is configured)."""

    path: str = ""
    defaults: Settings = Settings()
    users: dict[str, Settings] = field(default_factory=dict)
    groups: dict[str, Settings] = field(default_factory=dict)
    members: dict[str, frozenset[str]] = field(default_factory=dict)  # group -> listed users
    admin_users: frozenset[str] = frozenset()
    admin_groups: frozenset[str] = frozenset()
    admin_uids: frozenset[int] = frozenset()

    @property
    def needs_system_groups(self) -> bool:
        """Whether any group the file names is a system group (membership read via NSS)."""
        listed = {g for g, m in self.members.items() if m}
        return any(g not in listed for g in (*self.groups, *self.admin_groups))

    def listed_groups(self, user: str) -> frozenset[str]:
        """The groups whose ``members`` list names ``user``."""
        return frozenset(g for g, m in self.members.items() if user in m)

    def limits(self, user: str, groups: frozenset[str]) -> Limits:
        """The quota ceiling and weight of ``user`` (a member of ``groups``)."""
        own = self.users.get(user, Settings())
        mine = [self.groups[g] for g in sorted(groups) if g in self.groups]
        quota = own.quota
        if quota is None:
            quotas = [s.quota for s in mine if s.quota is not None]
            if quotas:
                quota = NO_QUOTA if NO_QUOTA in quotas else max(quotas)
        if quota is None:
            quota = self.defaults.quota
        weight = own.weight
        if weight is None:
            weights = [s.weight for s in mine if s.weight is not None]
            weight = max(weights) if weights else self.defaults.weight
        return Limits(NO_QUOTA if quota is None else quota, weight)

    def is_admin(self, user: str, uid: int | None, groups: frozenset[str]) -> bool:
        return (
            user in self.admin_users
            or (uid is not None and uid in self.admin_uids)
            or bool(groups & self.admin_groups)
        )


# --------------------------------------------------------------------------------------------
# Loading and validation

_TOP = {"defaults", "admins", "users", "groups"}
_SETTINGS = {"quota", "weight"}
_ADMINS = {"users", "groups", "uids"}


def _where(path: str, key: str) -> str:
    return f"{path or 'users config'}: {key}"


def _settings(path: str, key: str, table: Any, extra: frozenset[str] = frozenset()) -> Settings:
    if not isinstance(table, dict):
        raise UsersConfigError(f"{_where(path, key)}: must be a table ([{key}])")
    unknown = sorted(set(table) - _SETTINGS - extra)
    if unknown:
        allowed = ", ".join(sorted(_SETTINGS | extra))
        raise UsersConfigError(
            f"{_where(path, key)}: unknown key(s) {', '.join(unknown)} (allowed: {allowed})"
        )
    quota: int | None = None
    if "quota" in table:
        raw = table["quota"]
        if isinstance(raw, str) and raw.strip().lower() in ("none", "unlimited"):
            quota = NO_QUOTA
        elif isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise UsersConfigError(
                f'{_where(path, key + ".quota")}: a size such as "8GiB" or "none", got {raw!r}'
            )
        else:
            try:
                quota = parse_memory_size(raw)
            except ValueError as exc:
                raise UsersConfigError(f"{_where(path, key + '.quota')}: {exc}") from None
            if quota <= 0:
                raise UsersConfigError(
                    f'{_where(path, key + ".quota")}: must be positive ("none" for no ceiling)'
                )
            if quota >= 1 << 64:
                raise UsersConfigError(f"{_where(path, key + '.quota')}: {raw!r} is too large")
    weight: float | None = None
    if "weight" in table:
        raw = table["weight"]
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise UsersConfigError(f"{_where(path, key + '.weight')}: a number, got {raw!r}")
        weight = float(raw)
        if not (weight > 0 and math.isfinite(weight)):
            raise UsersConfigError(
                f"{_where(path, key + '.weight')}: must be a positive number, got {raw!r}"
            )
    return Settings(quota, weight)


def _names(path: str, key: str, raw: Any) -> frozenset[str]:
    if not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
        raise UsersConfigError(f"{_where(path, key)}: a list of names, got {raw!r}")
    return frozenset(raw)


def _system_group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def parse_users_config(doc: dict[str, Any], path: str = "") -> UsersConfig:
    """Validate a parsed TOML document (blocking: checks system groups exist)."""
    unknown = sorted(set(doc) - _TOP)
    if unknown:
        raise UsersConfigError(
            f"{_where(path, ', '.join(unknown))}: unknown section(s) "
            f"(allowed: {', '.join(sorted(_TOP))})"
        )
    defaults = _settings(path, "defaults", doc.get("defaults", {}))
    users: dict[str, Settings] = {}
    raw_users = doc.get("users", {})
    if not isinstance(raw_users, dict):
        raise UsersConfigError(f"{_where(path, 'users')}: must be a table of [users.NAME]")
    for name, table in raw_users.items():
        users[name] = _settings(path, f"users.{name}", table)
    groups: dict[str, Settings] = {}
    members: dict[str, frozenset[str]] = {}
    raw_groups = doc.get("groups", {})
    if not isinstance(raw_groups, dict):
        raise UsersConfigError(f"{_where(path, 'groups')}: must be a table of [groups.NAME]")
    for name, table in raw_groups.items():
        groups[name] = _settings(path, f"groups.{name}", table, frozenset({"members"}))
        if "members" in table:
            members[name] = _names(path, f"groups.{name}.members", table["members"])
        elif not _system_group_exists(name):
            raise UsersConfigError(
                f"{_where(path, f'groups.{name}')}: no system group {name!r} and no members "
                "list (list the hub users in members, or create the group)"
            )
    admins = doc.get("admins", {})
    if not isinstance(admins, dict):
        raise UsersConfigError(f"{_where(path, 'admins')}: must be a table ([admins])")
    unknown = sorted(set(admins) - _ADMINS)
    if unknown:
        raise UsersConfigError(
            f"{_where(path, 'admins')}: unknown key(s) {', '.join(unknown)} "
            f"(allowed: {', '.join(sorted(_ADMINS))})"
        )
    admin_users = _names(path, "admins.users", admins.get("users", []))
    admin_groups = _names(path, "admins.groups", admins.get("groups", []))
    for name in sorted(admin_groups):
        if name not in members and not _system_group_exists(name):
            raise UsersConfigError(
                f"{_where(path, 'admins.groups')}: unknown group {name!r} (neither a system "
                "group nor a [groups.NAME] with members)"
            )
    uids = admins.get("uids", [])
    if not isinstance(uids, list) or not all(
        isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in uids
    ):
        raise UsersConfigError(f"{_where(path, 'admins.uids')}: a list of uids, got {uids!r}")
    return UsersConfig(
        path=path,
        defaults=defaults,
        users=users,
        groups=groups,
        members=members,
        admin_users=admin_users,
        admin_groups=admin_groups,
        admin_uids=frozenset(uids),
    )


def load_users_config(path: str) -> UsersConfig:
    """Read and validate the file at ``path`` (blocking); '' gives the empty config."""
    if not path:
        return UsersConfig()
    text = _read_config_text(path)
    if not text.strip():
        # Most often a file caught half-written by an editor or a deployment: taking it would
        # silently lift every ceiling. An operator who means "no ceilings" says so in a comment.
        raise UsersConfigError(
            f"users config {path} is empty: refusing it (a file with only a comment, or "
            "users_config = '', means no ceilings)"
        )
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsersConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_users_config(doc, path)


#: A users config larger than this is refused (it is a few lines per user or group).
MAX_USERS_CONFIG_BYTES = 4 << 20


def _read_config_text(path: str) -> str:
    """The file's text: a regular file (a FIFO or a device would block the reader), bounded,
    UTF-8 (TOML's encoding); UsersConfigError otherwise."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; a regular file ignores it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UsersConfigError(f"users config {path} does not exist") from None
    except OSError as exc:
        raise UsersConfigError(f"cannot read the users config {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsersConfigError(f"users config {path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_USERS_CONFIG_BYTES + 1)
    except OSError as exc:
        raise UsersConfigError(f"cannot read the users config {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_USERS_CONFIG_BYTES:
        raise UsersConfigError(f"users config {path} is larger than {MAX_USERS_CONFIG_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsersConfigError(
            f"{path}: not UTF-8 (byte {exc.start}): TOML files are UTF-8"
        ) from None


def describe_limits(limits: Limits) -> str:
    quota = format_size(limits.quota) if limits.quota else "none"
    weight = "the kernel's" if limits.weight is None else f"{limits.weight:g}"
    return f"quota ceiling {quota}, weight {weight}"


# --------------------------------------------------------------------------------------------
# System lookups (blocking: the scheduler runs them in an executor)


def user_name(uid: int) -> str:
    """The passwd name of ``uid``, or the uid in decimal when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def system_groups(user: str, gid: int | None = None) -> frozenset[str]:
    """The system groups of ``user`` (its passwd group, ``gid`` and supplementary groups)."""
    base = gid
    if base is None or base < 0:
        try:
            base = pwd.getpwnam(user).pw_gid
        except KeyError:
            return frozenset()  # not a system user (a hub user): no system groups
    try:
        gids = os.getgrouplist(user, base)
    except OSError:
        gids = [base]
    names = set()
    for g in gids:
        try:
            names.add(grp.getgrgid(g).gr_name)
        except KeyError:
            continue
    return frozenset(names)


def resolve_uids(entries: list[int | str]) -> frozenset[int]:
    """``token_uids`` as uids: numbers stay, names are looked up (a clear error if unknown)."""
    out = set()
    for entry in entries:
        if isinstance(entry, int):
            out.add(entry)
            continue
        text = entry.strip()
        if text.isdigit():
            out.add(int(text))
            continue
        try:
            out.add(pwd.getpwnam(text).pw_uid)
        except KeyError:
            raise UsersConfigError(f"token_uids: no user {text!r} on this system") from None
    return frozenset(out)
