"""The last hour, per kernel, per user and per GPU: bounded ring buffers fed by status documents.

The scheduler records its status document (docs/protocol.md) here whenever its state changes
(its status listener); the sidebar draws sparklines from :meth:`History.view` (REST
``GET gpushare/api/history``, docs/rest-api.yaml). Pure: the caller passes the time with every
call, there is no clock, no I/O and no thread here, so tests feed it documents and times.

Bounds: a series keeps at most ``window / resolution + 1`` points (one hour at 5 s: 721), a
point closer than ``resolution`` to the previous one replaces it (bursts of events cost nothing),
points older than ``window`` are dropped, a series with no point left is forgotten, and at most
``max_series`` kernels are followed (the least recently seen go first).

A kernel's point is ``[t, resident_bytes, evicted_bytes, gpu_seconds, wait_seconds, state]``, a
user's ``[t, resident_bytes, evicted_bytes, gpu_seconds, wait_seconds, kernels]`` (sums over the
user's kernels at that moment), a GPU's ``[t, utilization_percent or None, resident_bytes,
pool_bytes, holders, waiting]``; ``t`` is what the caller passed (Unix seconds).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["History"]

Point = list[Any]


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


@dataclass
class _Series:
    points: deque[Point]
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, point: Point, resolution: float) -> None:
        if self.points and point[0] - self.points[-1][0] < resolution:
            self.points[-1] = point
        else:
            self.points.append(point)

    def trim(self, oldest: float) -> None:
        while self.points and self.points[0][0] < oldest:
            self.points.popleft()


@dataclass
class History:
    window: float = 3600.0
    resolution: float = 5.0
    max_series: int = 1000
    kernels: OrderedDict[str, _Series] = field(default_factory=OrderedDict)
    users: dict[str, _Series] = field(default_factory=dict)
    devices: dict[str, _Series] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.window <= 0 or self.resolution <= 0:
            raise ValueError("window and resolution must be positive")
        self._maxlen = int(self.window / self.resolution) + 1

    def _series(self, table: dict[str, _Series], key: str) -> _Series:
        series = table.get(key)
        if series is None:
            series = table[key] = _Series(deque(maxlen=self._maxlen))
        return series

    def record(self, now: float, doc: dict[str, Any]) -> None:
        """Take a status document (unfiltered: every client) as it was at ``now``."""
        per_user: dict[str, list[float]] = {}
        for dev in doc.get("devices", []) or []:
            clients = [c for c in dev.get("clients", []) or [] if isinstance(c, dict)]
            uuid = str(dev.get("uuid", ""))
            util = dev.get("utilization_percent")
            self._series(self.devices, uuid).add(
                [
                    now,
                    util if isinstance(util, (int, float)) else None,
                    int(_num(dev.get("resident_bytes"))),
                    int(_num(dev.get("pool_bytes"))),
                    len(dev.get("holders", []) or []),
                    len(dev.get("queue", []) or []),
                ],
                self.resolution,
            )
            for c in clients:
                cid = str(c.get("id", ""))
                used, evicted = _num(c.get("used_bytes")), _num(c.get("evicted_bytes"))
                resident = max(used - evicted, 0.0)
                gpu, wait = _num(c.get("gpu_seconds")), _num(c.get("wait_seconds"))
                series = self._series(self.kernels, cid)
                self.kernels.move_to_end(cid)
                series.meta = {"user": str(c.get("user", "")), "device": uuid}
                series.meta["label"] = str(c.get("label") or "")
                point = [now, int(resident), int(evicted), round(gpu, 3), round(wait, 3)]
                series.add([*point, str(c.get("state", ""))], self.resolution)
                sums = per_user.setdefault(str(c.get("user", "")), [0.0] * 5)
                for i, value in enumerate((resident, evicted, gpu, wait, 1.0)):
                    sums[i] += value
        for user, (resident, evicted, gpu, wait, count) in per_user.items():
            point = [now, int(resident), int(evicted), round(gpu, 3), round(wait, 3), int(count)]
            self._series(self.users, user).add(point, self.resolution)
        while len(self.kernels) > self.max_series:
            self.kernels.popitem(last=False)
        self._expire(now)

    def _expire(self, now: float) -> None:
        oldest = now - self.window
        for table in (self.kernels, self.users, self.devices):
            for key in [k for k, s in table.items() if (s.trim(oldest) or not s.points)]:
                del table[key]

    def view(
        self,
        now: float,
        kernels: Iterable[str] | None = None,
        users: Iterable[str] | None = None,
        max_points: int = 120,
    ) -> dict[str, Any]:
        """The history as JSON: the kernels and users named (None: all), every GPU, each series
        thinned to at most ``max_points`` (evenly, keeping the newest point)."""
        self._expire(now)
        want_k = None if kernels is None else set(kernels)
        want_u = None if users is None else set(users)

        def thin(points: deque[Point]) -> list[Point]:
            pts = list(points)
            if max_points < 1 or len(pts) <= max_points:
                return pts
            step = len(pts) / max_points
            picked = [pts[int(i * step)] for i in range(max_points - 1)]
            return [*picked, pts[-1]]

        return {
            "now": now,
            "window_seconds": self.window,
            "resolution_seconds": self.resolution,
            "kernels": {
                k: {**s.meta, "points": thin(s.points)}
                for k, s in self.kernels.items()
                if want_k is None or k in want_k
            },
            "users": {
                u: {"points": thin(s.points)}
                for u, s in self.users.items()
                if want_u is None or u in want_u
            },
            "devices": {d: {"points": thin(s.points)} for d, s in self.devices.items()},
        }
