"""Kernel ids bound to a secret (docs/protocol.md, "Kernel ids"; A16c and A19d in
docs/reliability.md).

A Jupyter kernel's id is world-readable (``ps`` shows ``kernel-<id>.json``), so an id alone
proves nothing: whoever said ``HELLO`` with it first got it, and the kernel's own server then
released and reported busy/idle for another user's client, or for none. So the provisioner makes a
random secret for each kernel it starts, gives it to the kernel in its environment
(``GPUSHARE_KERNEL_SECRET``: ``/proc/<pid>/environ`` is readable by the kernel's owner only) and,
before the kernel starts, binds the id to the secret's SHA-256 (the ``bind_kernel`` control
action, from the owner's server, so under the owner's identity). The shim sends the secret in its
``HELLO`` (``kernel_secret``); the scheduler keeps the digest only and compares digests with
:func:`hmac.compare_digest`.

* A ``HELLO`` for a bound id (or ``<id>/<n>``, the same kernel on another GPU) without the right
  secret never gets the id: it gets ``<id>#<pid>``, whoever it is.
* A ``HELLO`` with the right secret gets the id; a client that holds it without having proven the
  binding (it connected before the binding was made) loses it: its connection is closed, and its
  shim reconnects as ``<id>#<pid>``. The same happens at the binding itself.
* A binding is refused when the id is bound to another user's kernel; its own user may bind it
  again (a restarted kernel keeps its id and gets a new secret).
* A binding is also refused while a live client of another user holds the id, or while the id
  is another user's (:class:`IdOwners`): a ``bind_kernel`` names any id, ``pid-<pid>`` of
  every plain shimmed program included (``ps`` shows both), and must not take it from its user.
* A kernel whose id is not bound (its provisioner could not reach the scheduler) binds it by
  its first ``HELLO``: the secret that HELLO gives becomes the binding, under the same rules as
  a ``bind_kernel`` from the kernel's user (never an id another user holds or owns), so the
  provisioner's later ``bind_kernel`` with the same digest finds it its own.
* Each user keeps at most :data:`PER_USER` bindings (the oldest of that user's go first), so
  nobody can push another user's bindings out; each user's are kept across a scheduler
  restart with the rest of the kept state (.resume bounds each user's share of the file in
  bytes, so another user's entries never push them out either).

An id that no provisioner bound (a client started without it) is first come, first served, as
before; the last user whose client had it keeps it (:class:`IdOwners`, .shims), each user's
owned ids bounded on their own.
"""

from __future__ import annotations

import hashlib
import hmac
import string
from dataclasses import dataclass

__all__ = [
    "ENV_KERNEL_SECRET",
    "OWNED_PER_USER",
    "PER_USER",
    "Binding",
    "IdOwners",
    "KernelIds",
    "bound_id",
    "secret_digest",
]

#: Where the provisioner gives a kernel its secret (native/src/client/conn.c reads it).
ENV_KERNEL_SECRET = "GPUSHARE_KERNEL_SECRET"

#: Bindings each user keeps (a node starts far fewer kernels between two restarts of a server).
PER_USER = 1024
#: Ids each user is remembered as the owner of after its clients leave (the newest).
OWNED_PER_USER = 4096
#: The longest secret a HELLO may send (the provisioner's are 64 hex characters).
MAX_SECRET = 128
_DIGEST_LEN = 64  # SHA-256, hex


@dataclass(frozen=True)
class Binding:
    """A bound id: the user who bound it and the SHA-256 (hex) of its kernel's secret."""

    user: str
    digest: str


def secret_digest(secret: str) -> str:
    """What the scheduler keeps of a kernel secret (and what ``bind_kernel`` sends)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


def valid_digest(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) == _DIGEST_LEN
        and all(c in string.hexdigits for c in value)
    )


def bound_id(client_id: str) -> str:
    """The id whose binding covers ``client_id``: ``<id>/<n>`` is the kernel ``<id>`` on its
    n-th GPU (docs/protocol.md, "Several devices")."""
    base, sep, ordinal = client_id.rpartition("/")
    return base if sep and base and ordinal.isdigit() else client_id


class KernelIds:
    """The scheduler's bound ids: id -> :class:`Binding`."""

    def __init__(self) -> None:
        self._bound: dict[str, Binding] = {}  # oldest first
        self._by_user: dict[str, dict[str, None]] = {}  # user -> its ids, oldest first

    def __len__(self) -> int:
        return len(self._bound)

    def binding(self, client_id: str) -> Binding | None:
        return self._bound.get(bound_id(client_id))

    def proves(self, client_id: str, secret: str) -> bool:
        """Does ``secret`` (a HELLO's ``kernel_secret``) prove the binding of ``client_id``?"""
        binding = self.binding(client_id)
        if binding is None or not secret or len(secret) > MAX_SECRET:
            return False
        return hmac.compare_digest(secret_digest(secret), binding.digest)

    def bind(self, client_id: str, user: str, digest: str) -> str | None:
        """Bind ``client_id`` to ``digest`` for ``user``; a refusal's text, or None."""
        current = self._bound.get(client_id)
        if current is not None and current.user != user:
            return f"the id {client_id!r} is bound to another user's kernel"
        self._drop(client_id)
        self._bound[client_id] = Binding(user, digest.lower())
        mine = self._by_user.setdefault(user, {})
        mine[client_id] = None
        while len(mine) > PER_USER:
            self._drop(next(iter(mine)))
        return None

    def _drop(self, client_id: str) -> None:
        binding = self._bound.pop(client_id, None)
        if binding is None:
            return
        mine = self._by_user.get(binding.user, {})
        mine.pop(client_id, None)
        if not mine:
            self._by_user.pop(binding.user, None)

    def kept(self) -> dict[str, list[list[str]]]:
        """Each user's bindings, newest first, for the next scheduler: user -> [[id, digest]]
        (.resume.KeptState bounds each user's share of the file on its own)."""
        return {
            user: [[cid, self._bound[cid].digest] for cid in reversed(mine)]
            for user, mine in self._by_user.items()
        }

    def restore(self, kept: object) -> None:
        """Take back what :meth:`kept` gave (read from disk: malformed entries are skipped)."""
        for user, entries in kept.items() if isinstance(kept, dict) else []:
            if not isinstance(user, str) or not user or not isinstance(entries, list):
                continue
            for entry in reversed(entries[:PER_USER]):  # oldest first: the newest stay newest
                if (
                    isinstance(entry, list)
                    and len(entry) == 2
                    and all(isinstance(v, str) and v for v in entry)
                    and valid_digest(entry[1])
                ):
                    self.bind(entry[0], user, entry[1])


class IdOwners:
    """Client id -> the user whose client last had it, bounded per user: each user's newest
    :data:`OWNED_PER_USER`, so that nobody's many ids (binds, HELLOs, placements) push out
    another user's."""

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}
        self._by_user: dict[str, dict[str, None]] = {}  # user -> its ids, oldest first

    def __len__(self) -> int:
        return len(self._owner)

    def get(self, client_id: str) -> str | None:
        return self._owner.get(client_id)

    def remember(self, client_id: str, user: str) -> None:
        former = self._owner.pop(client_id, None)
        if former is not None:
            self._forget_of(former, client_id)
        self._owner[client_id] = user
        mine = self._by_user.setdefault(user, {})
        mine[client_id] = None
        while len(mine) > OWNED_PER_USER:
            oldest = next(iter(mine))
            del mine[oldest]
            self._owner.pop(oldest, None)

    def _forget_of(self, user: str, client_id: str) -> None:
        mine = self._by_user.get(user)
        if mine is not None:
            mine.pop(client_id, None)
            if not mine:
                del self._by_user[user]
