"""Resume proofs: a secret given with each GRANT that a reconnecting holder must send back, and
what the scheduler keeps on disk to check it after a restart.

After a scheduler restart the shims reconnect and say what they held (``resume = 1``: "I held
the device") and since when (``since_ms``). Believed on their word, such claims let another user
take the grant or jump the queue during the recovery window. So:

* each GRANT carries ``resume_secret``: an HMAC of the client id, the client's uid and the
  grant's own random number, under a key that the scheduler keeps in a private directory (0700,
  the files 0600) beside its socket (a hold taken back at a restart keeps its number: the shim's
  secret stays good for the next restart);
* the scheduler keeps its clients as they are (:class:`KeptState`: who holds which grant, who
  waits since when, which user each id belongs to, which kernel ids are bound to which secret's
  digest) in ``state.json`` in that directory, updated
  as they change and when it stops;
* the next scheduler reads (and removes) that file at start: a holding claim is believed only with
  the secret of the grant its id held then (an older grant's secret proves nothing), a claimed
  wait is cut to what was kept, and the ids keep their
  owners. A kept state older than :data:`KEPT_FOR` seconds is ignored: it proves nothing.

The file is bounded in bytes by its writer, per user: each user's entries (its clients first,
then its bindings, newest first) take at most :data:`PER_USER_BYTES`, and the whole at most
:data:`MAX_STATE_BYTES`; when the users together would pass it, each keeps an equal share of it
(a user below that share keeps everything), so one user's many or long ids never push another
user's entries out. The reader reads it whole or not at all: a file over :data:`MAX_STATE_BYTES`
or not well formed is refused whole, and the scheduler says so in its log.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "KEPT_FOR",
    "MAX_STATE_BYTES",
    "PER_USER_BYTES",
    "RESUME_SECRET_LENGTH",
    "KeptClient",
    "KeptState",
    "ResumeKey",
]

#: The secret's length in hex characters (128 bits).
RESUME_SECRET_LENGTH = 32
_KEY_BYTES = 32
#: Seconds a kept state proves anything after it was written: a scheduler down for longer has
#: no holder left to take back (the shims give up reconnecting well before).
KEPT_FOR = 600.0
#: What one user's entries may take of ``state.json`` (1,024 bindings of Jupyter's 36-character
#: kernel ids and a hundred clients fit; ids of 256 astral-plane characters, a few dozen).
PER_USER_BYTES = 256 << 10
#: What ``state.json`` may take in all: 64 users at their full share.
MAX_STATE_BYTES = 16 << 20
_FRAME_BYTES = 1024  # the top level's own bytes, reserved


class ResumeKey:
    """The key resume secrets are derived from."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def generate(cls) -> ResumeKey:
        return cls(secrets.token_bytes(_KEY_BYTES))

    @classmethod
    def load_or_create(cls, directory: str) -> ResumeKey:
        """The key in ``directory``/resume.key, made (0700 directory, 0600 file) when missing or
        not private to this user; blocking. A key that cannot be kept only costs the proofs of
        this restart: the shims' holding claims are then treated as waiting ones."""
        uid = os.getuid()
        path = os.path.join(directory, "resume.key")
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
        _private_file(directory, "resume.key")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            pass
        else:
            with os.fdopen(fd, "rb") as f:
                fst = os.fstat(f.fileno())
                raw = f.read(_KEY_BYTES + 1)
            private = stat.S_ISREG(fst.st_mode) and fst.st_uid == uid and not fst.st_mode & 0o077
            if private and len(raw) == _KEY_BYTES:
                return cls(raw)
            os.unlink(path)
        key = cls.generate()
        tmp = f"{path}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key._key)
        os.rename(tmp, path)
        return key

    def secret(self, client_id: str, uid: int, grant: str) -> str:
        """The resume secret of the grant numbered ``grant`` to ``client_id`` run by ``uid``."""
        text = f"{client_id}\0{uid}\0{grant}"
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()[:RESUME_SECRET_LENGTH]

    def verify(self, client_id: str, uid: int, grant: str, secret: str) -> bool:
        return bool(grant) and hmac.compare_digest(self.secret(client_id, uid, grant), secret)


def _private_file(directory: str, name: str) -> str:
    """``directory``/``name`` if ``directory`` is this user's private directory."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{directory} is not a private directory of this user")
    return os.path.join(directory, name)


@dataclass(frozen=True)
class KeptClient:
    """One client as the scheduler kept it: the id its shim asked for, its uid and user, the
    number of the grant it holds ('': none) and since when (Unix time) it held or waited."""

    requested_id: str
    client_id: str
    uid: int
    user: str
    grant: str = ""
    since: float | None = None


@dataclass
class KeptState:
    """The scheduler's clients, kept on disk for the next scheduler on this socket."""

    saved: float
    clients: list[KeptClient] = field(default_factory=list)
    #: Kernel ids bound to a secret's digest, each user's newest first: user -> [[id, sha256]]
    #: (.kernel_ids.KernelIds.kept).
    bound: dict[str, list[list[str]]] = field(default_factory=dict)

    FILE = "state.json"

    def to_json(self) -> str:
        """The state as JSON of at most MAX_STATE_BYTES bytes, each user's share bounded on its
        own (module doc): what does not fit is the newest-last of that user's entries."""
        entries: dict[str, list[tuple[str, str]]] = {}  # user -> (section, entry's JSON)
        for c in self.clients:
            entries.setdefault(c.user, []).append(("clients", json.dumps(c.__dict__)))
        for user, bound in self.bound.items():
            mine = entries.setdefault(user, [])
            mine.extend(("bound", json.dumps(entry)) for entry in bound)
        costs = {user: _user_costs(user, mine) for user, mine in entries.items()}
        shares = fair_shares(
            {user: min(sum(c), PER_USER_BYTES) for user, c in costs.items()},
            MAX_STATE_BYTES - _FRAME_BYTES,
        )
        users: dict[str, str] = {}
        for user, mine in entries.items():
            if shares[user] < costs[user][0]:
                continue  # not even its own frame fits its share (tens of thousands of users)
            kept: dict[str, list[str]] = {"clients": [], "bound": []}
            spent = costs[user][0]  # the user's own frame
            for (section, text), cost in zip(mine, costs[user][1:], strict=True):
                if spent + cost > shares[user]:
                    break
                spent += cost
                kept[section].append(text)
            sections = ",".join(f'"{name}":[{",".join(texts)}]' for name, texts in kept.items())
            users[json.dumps(user)] = "{" + sections + "}"
        body = ",".join(f"{user}:{text}" for user, text in users.items())
        return f'{{"saved":{json.dumps(self.saved)},"users":{{{body}}}}}'

    def save(self, directory: str) -> None:
        """Write it atomically (0600); blocking."""
        path = _private_file(directory, self.FILE)
        tmp = f"{path}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())
        os.rename(tmp, path)

    @classmethod
    def take(cls, directory: str, now: float | None = None) -> KeptState | str | None:
        """The state the last scheduler kept, removed from the disk (it proves claims for one
        restart only); None when there is none, it is not private, or it is older than
        KEPT_FOR; why, when it is refused whole (over MAX_STATE_BYTES, or not well formed).
        Blocking."""
        now = time.time() if now is None else now
        try:
            path = _private_file(directory, cls.FILE)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            fst = os.fstat(f.fileno())
            raw = f.read(MAX_STATE_BYTES + 1)
        with contextlib.suppress(OSError):
            os.unlink(path)
        if not stat.S_ISREG(fst.st_mode) or fst.st_uid != os.getuid() or fst.st_mode & 0o077:
            return None
        if len(raw) > MAX_STATE_BYTES:
            return f"{path} is over {MAX_STATE_BYTES} bytes: none of it is read"
        try:
            state = cls.from_json(raw)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{path} is not a kept state ({type(exc).__name__}: {exc}): none of it is read"
        if not 0 <= now - state.saved <= KEPT_FOR:
            return None
        return state

    @classmethod
    def from_json(cls, raw: bytes | str) -> KeptState:
        """What :meth:`to_json` wrote; raises ValueError, KeyError, TypeError when malformed."""
        data: dict[str, Any] = json.loads(raw)
        clients, bound = [], {}
        if "users" not in data:  # written before per-user entries: an upgrade's one restart
            for entry in data.get("bound") or []:  # [id, user, digest], oldest first
                if isinstance(entry, list) and len(entry) == 3:
                    bound.setdefault(str(entry[1]), []).insert(0, [entry[0], entry[2]])
            data["users"] = {}
            clients = [KeptClient(**c) for c in data["clients"]]
        for user, mine in dict(data["users"]).items():
            clients.extend(KeptClient(**c) for c in mine.get("clients") or [])
            bound[str(user)] = list(mine.get("bound") or [])
        return cls(float(data["saved"]), clients, bound)

    def find(self, requested_id: str, uid: int) -> KeptClient | None:
        for c in self.clients:
            if c.requested_id == requested_id and c.uid == uid:
                return c
        return None


def _user_costs(user: str, entries: list[tuple[str, str]]) -> list[int]:
    """Bytes of one user's part of the file: its own frame (its name and the sections'), then
    each entry's (with its comma)."""
    frame = len(json.dumps(user)) + len('{"clients":[],"bound":[]},') + 1
    return [frame, *(len(text) + 1 for _, text in entries)]


def fair_shares(wants: dict[str, int], budget: int) -> dict[str, int]:
    """Bytes each user may take of ``budget``: all it wants when everyone fits, else an equal
    share, and what a user below its share leaves goes to those above it (max-min fairness)."""
    shares: dict[str, int] = {}
    left, users = budget, sorted(wants, key=wants.__getitem__)
    for n, user in enumerate(users):
        share = left // (len(users) - n)
        shares[user] = min(wants[user], share)
        left -= shares[user]
    return shares
