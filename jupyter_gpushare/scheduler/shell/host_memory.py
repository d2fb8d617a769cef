"""The node's host budget for gpushare (``c.GPUShareScheduler.host_budget``): how much host memory
the shims' staging and evicted memory may take together (docs/architecture.md, "Host memory is a
budget"). The policy accounts it (:mod:`..core.host_budget`); this module only measures the node.

``auto`` = min(MemAvailable at start, the scheduler's cgroup memory limit if one is set) less the
reserve (``host_reserve``, default max(4 GiB, 20% of the RAM)). The reserve is for what grows
after the start and is nobody's staging: the kernels' own host memory (Python objects, data
loaders, the pinned buffers frameworks keep), page cache the kernel needs to make progress, and
new kernels' start-up. The cgroup is the scheduler's own: on a node where the scheduler runs in a
container with a limit, that limit is what the node gives it, and on one without, the host's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...units import format_size, parse_size

__all__ = ["HostBudget", "cgroup_limit", "mem_info", "resolve_budget"]

GiB = 1 << 30
#: The reserve's floor and share of the RAM ("auto").
RESERVE_FLOOR = 4 * GiB
RESERVE_SHARE = 0.20  # 0.10 left 4.5 GiB on an H200 node (test_gpu_card, 2026-12-02)


@dataclass(frozen=True)
class HostBudget:
    """The budget and what it was made of (the start-up log and the status say it)."""

    budget: int  # bytes; 0: host memory is not accounted
    how: str  # one line for the log and the status


def mem_info(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """/proc/meminfo's fields in bytes (empty when it cannot be read)."""
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_limit(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), or None when there is none (``max``, or v1's huge number)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _id, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # v2: the unified hierarchy
            value = _read_int(root / rel / "memory.max")
        elif "memory" in controllers.split(","):
            value = _read_int(root / "memory" / rel / "memory.limit_in_bytes")
            if value is None:  # mounted at the root, as in a container's namespace
                value = _read_int(root / "memory" / "memory.limit_in_bytes")
        else:
            continue
        if value is not None and value < 1 << 60:  # v1 says "no limit" with a huge number
            limits.append(value)
    return min(limits) if limits else None


def resolve_budget(
    budget: int | str,
    reserve: int | str,
    meminfo: dict[str, int] | None = None,
    limit: int | None = None,
    held: int = 0,
) -> HostBudget:
    """The host budget from the traits: a size (0: off), or "auto" from ``meminfo``
    (/proc/meminfo) and ``limit`` (the cgroup's), ``held`` being what gpushare holds already
    (counted as available: it is the budget's own)."""
    if budget != "auto":
        size = parse_size(budget)
        return HostBudget(size, f"{format_size(size)} (set)" if size else "off")
    info = mem_info() if meminfo is None else meminfo
    total, available = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    if not total or not available:
        return HostBudget(0, "off (the node's memory could not be read)")
    keep = (
        max(RESERVE_FLOOR, int(total * RESERVE_SHARE)) if reserve == "auto" else parse_size(reserve)
    )
    base = available + held
    source = f"MemAvailable {format_size(available)}"
    if limit is not None and limit < base:
        base, source = limit, f"cgroup limit {format_size(limit)}"
    size = max(1, base - keep)  # never 0, which would turn the accounting off
    how = f"{format_size(size)} (auto: {source}, less a reserve of {format_size(keep)})"
    return HostBudget(size, how)
