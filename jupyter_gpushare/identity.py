"""User identity tokens for peers that share one uid (JupyterHub, Kubernetes).

Under JupyterHub's local-process spawners, and on Kubernetes where every user pod runs as uid
1000, many users reach the node scheduler with the same uid, so ``SO_PEERCRED`` alone cannot
tell them apart. The operator keeps one secret key on the node (readable by the scheduler and
the hub only); the hub gives each single-user server::

    GPUSHARE_USER=alice
    GPUSHARE_USER_TOKEN=user_token(key, "alice")

Kernels inherit both; the shim sends them in ``HELLO`` and control peers (``gpushare status``,
the server extension) on every control message (docs/protocol.md). The scheduler recomputes the
token for peers whose uid is one of its ``token_uids`` and refuses those whose token is missing
or wrong. A token proves nothing beyond "the hub vouched for this user name": it does not expire,
so rotating the key (``gpushare keygen --force``) is how tokens are revoked.

    >>> key = bytes(32)
    >>> token = user_token(key, "alice")
    >>> verify_token(key, "alice", token), verify_token(key, "bob", token)
    (True, False)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pwd
import stat
from collections.abc import Collection

__all__ = [
    "ENV_TOKEN",
    "ENV_USER",
    "MIN_KEY_BYTES",
    "KeyFileError",
    "generate_key",
    "load_key",
    "token_name_refusal",
    "user_environment",
    "user_token",
    "verify_token",
]

#: Environment variables a single-user server (and the kernels it starts) carries.
ENV_USER = "GPUSHARE_USER"
ENV_TOKEN = "GPUSHARE_USER_TOKEN"

#: A key shorter than this is refused: HMAC-SHA256 wants at least 128 bits of secret.
MIN_KEY_BYTES = 16
#: What ``generate_key`` writes (256 bits).
KEY_BYTES = 32
#: Domain separation: a token for gpushare is useless as an HMAC of the same key anywhere else.
_DOMAIN = b"jupyter-gpushare user token v1\x00"


class KeyFileError(ValueError):
    """The key file is missing, empty, too short or readable by others."""


def user_token(key: bytes, user: str) -> str:
    """The token that proves ``user`` to a scheduler holding ``key`` (hex HMAC-SHA256)."""
    if not user:
        raise ValueError("user_token: the user name is empty")
    return hmac.new(key, _DOMAIN + user.encode("utf-8"), hashlib.sha256).hexdigest()


def user_environment(key: bytes, user: str) -> dict[str, str]:
    """The environment variables that identify ``user`` to the scheduler (for a spawner)."""
    return {ENV_USER: user, ENV_TOKEN: user_token(key, user)}


def verify_token(key: bytes, user: str, token: str) -> bool:
    """Whether ``token`` is ``user``'s token under ``key`` (constant-time comparison)."""
    if not user or not token or not key:
        return False
    expected = user_token(key, user)
    return hmac.compare_digest(expected.encode("ascii"), token.strip().lower().encode("utf-8"))


def token_name_refusal(user: str, token_uids: Collection[int]) -> str | None:
    """Why a token may not vouch for ``user`` on this node, or None.

    Token users (a hub's, proven by a token on a uid many users share) and local accounts (known
    by their uid) are two namespaces that meet in one user name: a hub user named like a local
    account would own that account's kernels, its users-config ceilings and admin rights. A name
    that is a local account's is refused for a token, unless that account's uid is itself one of
    the ``token_uids`` (the shared uid's own name, which never speaks by uid). Blocking (NSS):
    call it off an event loop.
    """
    try:
        uid = pwd.getpwnam(user).pw_uid
    except (KeyError, ValueError):
        return None
    if uid in token_uids:
        return None
    return (
        f"the token's user {user!r} is also this node's account of uid {uid}: a token may not "
        "speak for a local account (rename the hub user)"
    )


def load_key(path: str) -> bytes:
    """Read the key file; raise :class:`KeyFileError` with a clear message when it is unusable.

    The file holds the key as text (hex, as ``generate_key`` writes it) or raw bytes. It must not
    be readable by its group or by others: whoever reads it can vouch for any user.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KeyFileError(
            f"user key file {path} does not exist (create it with `gpushare keygen {path}`)"
        ) from None
    except OSError as exc:
        raise KeyFileError(f"cannot open the user key file {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"user key file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"user key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: it must be "
                f"readable by its owner only (chmod 600 {path})"
            )
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    text = raw.strip()
    if not text:
        raise KeyFileError(f"user key file {path} is empty (create it with `gpushare keygen`)")
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = raw  # not hex: the raw bytes are the key
    if len(key) < MIN_KEY_BYTES:
        raise KeyFileError(
            f"user key file {path} holds {len(key)} bytes of key; at least {MIN_KEY_BYTES} are "
            "needed (create a new one with `gpushare keygen --force`)"
        )
    return key


def generate_key(path: str, *, force: bool = False) -> None:
    """Write a new random key (hex, mode 0600) to ``path``; refuse to replace one unless ``force``.

    The file is created with mode 0600 from the start (never world-readable for a moment) and
    renamed into place, so a reader sees the old key or the new one, never half of one.
    """
    if os.path.lexists(path) and not force:
        raise FileExistsError(f"{path} exists; use --force to replace the key (old tokens die)")
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is filtered by the umask; be exact
        os.write(fd, os.urandom(KEY_BYTES).hex().encode("ascii") + b"\n")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
