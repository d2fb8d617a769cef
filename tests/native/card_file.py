"""Reads the stand-in driver's card file (``GPUSHARE_FAKE_CARD_FILE``, native/tests/fake_card.c):
the one card and host every stand-in of a test accounts in.

``read_card(path)`` returns a :class:`Card`: per physical device its total, the bytes every
process holds now, the most it ever held (``peak``) and how many allocations it refused; per
process (by pid) its bytes on each device and their peak, and the host bytes it has pinned; for
the host, the bytes pinned now, their peak, refusals and the limit (``GPUSHARE_FAKE_HOST_LIMIT``).

The figures are the file's: a process killed since the stand-ins last looked still counts until
one of them looks again (its next allocation, cuMemGetInfo, or an NVML query). ``Process.alive``
says whether the process is still there (as the stand-in decides it: /proc, not a zombie, same
start time), and ``Card.live_used`` sums only those.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GSCARD01"
VERSION = 1
# magic; version, ndev, nslots, slot_size, slots_at, unused; host limit, used, peak, refused
_HEADER = struct.Struct("=8s6I4Q")
_DEVICE = struct.Struct("=4Q")  # total, used, peak, refused
_DEVICES_AT = 64


@dataclass(frozen=True)
class Device:
    total: int  # as the process that made the file saw GPUSHARE_FAKE_DEVICE_TOTAL
    used: int  # every process's bytes on it now
    peak: int  # the most it ever held
    refused: int  # allocations (or managed migrations) it had no room for


@dataclass(frozen=True)
class Process:
    pid: int
    start: int  # start time, clock ticks after boot (field 22 of /proc/PID/stat)
    host: int  # host bytes pinned now
    host_peak: int
    device: tuple[int, ...]  # bytes on each physical device now
    device_peak: tuple[int, ...]

    @property
    def alive(self) -> bool:
        return process_start(self.pid) in (self.start, None)


@dataclass(frozen=True)
class Card:
    devices: tuple[Device, ...]
    processes: dict[int, Process]
    host_limit: int  # 0: none
    host_used: int
    host_peak: int
    host_refused: int

    def used_by(self, pid: int, device: int = 0) -> int:
        """What process ``pid`` holds on ``device`` (0 when it holds nothing or is not there)."""
        proc = self.processes.get(pid)
        return proc.device[device] if proc else 0

    def live_used(self, device: int = 0) -> int:
        """The bytes on ``device`` of the processes that are still there."""
        return sum(p.device[device] for p in self.processes.values() if p.alive)


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` as the stand-in reads it; 0 when it is gone or a zombie, None
    when it is there but cannot be read."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return 0
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X", "x"):
        return 0
    return int(fields[19])  # field 22; fields[0] is field 3


def read_card(path: str | Path) -> Card:
    """The card file at ``path``; AssertionError when it is not one (a test's mistake)."""
    data = Path(path).read_bytes()
    assert len(data) >= _HEADER.size, f"{path}: {len(data)} bytes, not a card file"
    magic, version, ndev, nslots, slot_size, slots_at, _, *host = _HEADER.unpack_from(data)
    assert magic == MAGIC and version == VERSION, f"{path}: not a card file ({magic!r} {version})"
    devices = tuple(
        Device(*_DEVICE.unpack_from(data, _DEVICES_AT + d * _DEVICE.size)) for d in range(ndev)
    )
    slot = struct.Struct(f"=iIQQQ{ndev}Q{ndev}Q")
    assert slot.size == slot_size, f"{path}: slots of {slot_size} bytes, {slot.size} expected"
    processes: dict[int, Process] = {}
    for i in range(nslots):
        pid, _, start, host_now, host_high, *rest = slot.unpack_from(data, slots_at + i * slot_size)
        if pid:
            processes[pid] = Process(
                pid, start, host_now, host_high, tuple(rest[:ndev]), tuple(rest[ndev:])
            )
    limit, used, peak, refused = host
    return Card(devices, processes, limit, used, peak, refused)
