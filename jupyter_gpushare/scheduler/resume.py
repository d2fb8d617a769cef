"""Resume proofs: a secret given with each GRANT that a reconnecting holder must send back.

After a scheduler restart the shims reconnect and say what they held (``resume = 1``: "I held
the device"). Believed on its word, such a claim let another user connect first during the
recovery window and take the grant. Each GRANT therefore carries ``resume_secret``: an HMAC of
the client id and the client's uid under a key that the scheduler keeps in a private directory
(0700, the file 0600) beside its socket, so the *next* scheduler process, which did not issue
it, can check it. A holding claim without the right secret is treated as a waiting one.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat

__all__ = ["RESUME_SECRET_LENGTH", "ResumeKey"]

#: The secret's length in hex characters (128 bits).
RESUME_SECRET_LENGTH = 32
_KEY_BYTES = 32


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
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
            raise PermissionError(f"{directory} is not a private directory of this user")
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

    def secret(self, client_id: str, uid: int) -> str:
        """The resume secret of ``client_id`` run by ``uid``."""
        mac = hmac.new(self._key, f"{client_id}\0{uid}".encode(), hashlib.sha256)
        return mac.hexdigest()[:RESUME_SECRET_LENGTH]

    def verify(self, client_id: str, uid: int, secret: str) -> bool:
        return hmac.compare_digest(self.secret(client_id, uid), secret)
