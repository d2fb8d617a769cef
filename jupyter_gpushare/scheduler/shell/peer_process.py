"""The process behind a shim's connection, held as a pidfd (issue 22, item 6).

``revoke_signal`` used to ``kill()`` the pid that ``SO_PEERCRED`` recorded at connect: when that
process had gone (the socket passed to a child, or the kernel ended) and its pid was reused, a
bystander's process got the signal, from a root scheduler any user's. A pidfd names one process
for its whole life: taken when the HELLO arrives, and only for a process that could have made
the connection (its real uid is the peer's, it started before the HELLO came), it can never
signal another process; a process that is gone is not signalled at all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from .transport import PeerCred

__all__ = ["PeerProcess"]

_TICKS = os.sysconf("SC_CLK_TCK")


def _start_and_uid(pid: int) -> tuple[float, int]:
    """When process ``pid`` started (seconds since boot) and its real uid, from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start = int(fields[19]) / _TICKS  # field 22, counted after the command's ")"
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Uid:"):
                return start, int(line.split()[1])
    raise OSError(f"no Uid line for pid {pid}")


class PeerProcess:
    """A pidfd of a connection's peer process, or nothing (:attr:`why` says why)."""

    def __init__(self, peer: PeerCred) -> None:
        self.pid = peer.pid
        self.fd: int | None = None
        self.why = ""
        arrived = time.clock_gettime(time.CLOCK_BOOTTIME)
        if peer.pid <= 0 or peer.uid < 0:
            self.why = "its pid is unknown"
            return
        try:
            fd = os.pidfd_open(peer.pid)
        except (OSError, AttributeError) as exc:
            self.why = f"no pidfd for pid {peer.pid}: {exc}"
            return
        try:
            start, uid = _start_and_uid(peer.pid)
            with contextlib.suppress(PermissionError):  # EPERM: alive, another user's
                signal.pidfd_send_signal(fd, 0)  # the same process after the reads: still alive
        except (OSError, ValueError, IndexError) as exc:
            os.close(fd)
            self.why = f"pid {peer.pid} is gone ({exc})"
            return
        if uid != peer.uid:
            self.why = f"pid {peer.pid} now runs as uid {uid}, not the peer's {peer.uid}"
        elif start > arrived + 1 / _TICKS:
            self.why = f"pid {peer.pid} started after the connection's HELLO (a reused pid)"
        else:
            self.fd = fd
            return
        os.close(fd)

    def signal(self, signum: int) -> str:
        """Send ``signum`` to that process and no other: '' when sent, else why not."""
        if self.fd is None:
            return self.why
        try:
            signal.pidfd_send_signal(self.fd, signum)
        except ProcessLookupError:
            return f"pid {self.pid} has exited (its pid is never signalled again)"
        except PermissionError:
            return (
                f"EPERM: this scheduler (uid {os.geteuid()}) may not signal pid {self.pid} of "
                "another user (only a root scheduler, or one of the holder's own uid, can)"
            )
        except OSError as exc:
            return str(exc)
        return ""

    def __del__(self) -> None:  # a HELLO refused after the pidfd was taken
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
            self.why = "its connection closed"
