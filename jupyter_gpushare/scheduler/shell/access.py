"""Access: who a peer is and what it may do, quota ceilings included.

Who a peer is comes from the kernel-verified uid (``SO_PEERCRED``), or, for the ``token_uids``
that many users share (JupyterHub, Kubernetes), from the user a valid token proves
(:mod:`jupyter_gpushare.identity`) -- never from what a peer merely says. What it may do: act on
its own user's clients (release, evict, set_quota, kernel_state); admins act on everything. The
users config's quota is a ceiling on every kernel of a user; only an admin may lift it.

The user-name and group look-ups go through an executor (NSS may block); everything else is a
plain decision on the state loaded by :meth:`Access.load`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from ...identity import load_key, verify_token
from ...units import format_size
from .transport import PeerCred
from .users import (
    Identity,
    Limits,
    UsersConfig,
    UsersConfigError,
    load_users_config,
    resolve_uids,
    system_groups,
    user_name,
)

__all__ = ["Access", "AccessFiles"]


@dataclass(frozen=True)
class AccessFiles:
    """What access is loaded from: the users config, the token uids and the user key."""

    users: UsersConfig
    key: bytes | None
    token_uids: frozenset[int]

    @classmethod
    def read(cls, users_config: str, token_uids: Iterable[int | str], key_file: str) -> AccessFiles:
        """Read and check them (blocking; raises UsersConfigError or KeyFileError)."""
        users = load_users_config(users_config)
        uids = resolve_uids(list(token_uids))
        key = None
        if key_file:
            key = load_key(key_file)
        elif uids:
            raise UsersConfigError(
                "token_uids is set but user_key_file is not: tokens cannot be checked "
                "(create a key with `gpushare keygen PATH`)"
            )
        return cls(users, key, uids)


@dataclass
class Access:
    """The scheduler's access rules under its current users config, key and admin uids."""

    own_uid: int
    admin_uids: frozenset[int] = frozenset()
    files: AccessFiles = field(
        default_factory=lambda: AccessFiles(UsersConfig(), None, frozenset())
    )
    _user_names: dict[int, str] = field(default_factory=dict)
    _groups: dict[tuple[str, int], frozenset[str]] = field(default_factory=dict)

    @property
    def users(self) -> UsersConfig:
        return self.files.users

    @property
    def token_uids(self) -> frozenset[int]:
        return self.files.token_uids

    def load(self, files: AccessFiles) -> None:
        self.files = files
        self._groups.clear()

    # -- who ---------------------------------------------------------------------------------

    def is_admin(self, uid: int) -> bool:
        """Whether a peer of ``uid`` is an admin by its uid alone (root, the scheduler's own uid,
        ``admin_uids`` and the users config's ``admins.uids``; never one of ``token_uids``)."""
        if uid < 0 or uid in self.token_uids:
            return False
        return (
            uid == 0
            or uid == self.own_uid
            or uid in self.admin_uids
            or uid in self.users.admin_uids
        )

    async def _user_name(self, uid: int) -> str:
        name = self._user_names.get(uid)
        if name is None:
            loop = asyncio.get_running_loop()
            name = await loop.run_in_executor(None, user_name, uid)
            self._user_names[uid] = name
        return name

    async def _groups_of(self, user: str, gid: int) -> frozenset[str]:
        """``user``'s groups: those whose ``members`` list names it in the users config, and
        (only when the config names system groups) its system groups, looked up off the loop."""
        groups = self.users.listed_groups(user)
        if not self.users.needs_system_groups:
            return groups
        key = (user, gid)
        found = self._groups.get(key)
        if found is None:
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(None, system_groups, user, gid)
            self._groups[key] = found
        return groups | found

    async def identify(self, peer: PeerCred, claimed: str, token: str) -> Identity | str:
        """The peer's identity, or why it is refused.

        Peers of ``token_uids`` are who their valid token says; everyone else is their uid's
        user, whatever ``user`` they send (docs/protocol.md, "Transport and identity").
        """
        if peer.uid in self.token_uids:
            if self.files.key is None:
                return (
                    f"uid {peer.uid} is one of the scheduler's token_uids, but the scheduler has "
                    "no user key (user_key_file) to check tokens with"
                )
            if not claimed or not token:
                return (
                    f"uid {peer.uid} is shared by many users: send a user and its token "
                    "(GPUSHARE_USER and GPUSHARE_USER_TOKEN, set by the hub)"
                )
            if not verify_token(self.files.key, claimed, token):
                return f"the token for user {claimed!r} is not valid on this node"
            return await self.identity(claimed, peer, token=True)
        if peer.uid < 0:
            return "the peer's credentials are unknown (no SO_PEERCRED)"
        return await self.identity(await self._user_name(peer.uid), peer, token=False)

    async def identity(self, user: str, peer: PeerCred, token: bool) -> Identity:
        """``user``'s identity with its groups and admin status under the current users config.

        A token identity's system groups are those of the user name (a hub user who is also a
        system user), not of the shared uid's gid; it is never an admin by uid.
        """
        groups = await self._groups_of(user, -1 if token else peer.gid)
        uid = None if token else peer.uid
        admin = (uid is not None and self.is_admin(uid)) or self.users.is_admin(user, uid, groups)
        return Identity(user, peer.uid, groups, admin, token)

    # -- what it may do ----------------------------------------------------------------------

    def authorize(self, peer_uid: int, client_uid: int) -> bool:
        """May a peer of ``peer_uid`` act on a client of ``client_uid``, by uids alone?

        The uid-only rule, for callers that have no identities; the scheduler itself decides
        with :meth:`may_act`, which also covers users sharing a uid (``token_uids``)."""
        if peer_uid < 0:
            return False
        return peer_uid == client_uid or self.is_admin(peer_uid)

    @staticmethod
    def may_act(who: Identity, owner: Identity | None) -> bool:
        """May ``who`` release, evict, re-quota or mark a client that ``owner`` runs?"""
        return who.admin or (owner is not None and owner.user == who.user)

    def may_terminate(
        self, who: Identity | None, peer_uid: int, owner_uid: int, kernel_users: Iterable[str]
    ) -> bool:
        """May a control peer have a process of ``owner_uid`` terminate_client'ed by MPS?

        By uid: the process's owner or an admin. On a uid that many users share (token_uids),
        the uid says nothing about the user, so the process must be a kernel of the asking
        user's identity (``kernel_users``: the users of the shims of that pid), or the asker an
        admin: else one hub user could end another's kernel.
        """
        if who is not None and who.admin:
            return True
        if peer_uid in self.token_uids:
            return who is not None and who.user in set(kernel_users)
        return self.authorize(peer_uid, owner_uid)

    def limits_for(self, ident: Identity) -> Limits:
        return self.users.limits(ident.user, ident.groups)

    def quota_refusal(self, who: Identity, owner: Identity | None, quota: int) -> str | None:
        """Why ``who`` may not give a client of ``owner`` this quota (over its ceiling), or None.

        The users config's quota is a ceiling on every kernel of the user; only an admin may
        set a quota above it (or none at all where there is a ceiling).
        """
        if who.admin or owner is None:
            return None
        ceiling = self.limits_for(owner).quota
        if ceiling == 0 or (quota != 0 and quota <= ceiling):
            return None
        asked = format_size(quota) if quota else "no quota"
        return (
            f"set_quota: {asked} is over the ceiling of {format_size(ceiling)} that the "
            f"operator set for user {owner.user} (users config); ask for at most "
            f"{format_size(ceiling)}, or ask an admin"
        )

    def effective_quota(self, owner: Identity, requested: int, by_admin: bool = False) -> int:
        """The quota a client of ``owner`` gets when it (or an admin) asks for ``requested``."""
        return requested if by_admin else self.limits_for(owner).effective_quota(requested)
