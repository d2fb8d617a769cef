"""The scheduler's status document as the text ``gpushare status`` prints: one table per device,
with why each waiter waits. Pure formatting (no I/O), shared by the command line and its tests."""

from __future__ import annotations

from typing import Any

from .protocol import printable
from .units import format_size

__all__ = ["explanations", "format_status"]


def _size(value: Any) -> str:
    try:
        return format_size(int(value or 0))
    except (TypeError, ValueError):
        return "?"


def _seconds(value: Any) -> str:
    try:
        return f"{float(value or 0):.1f}s"
    except (TypeError, ValueError):
        return "?"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def format_status(doc: dict[str, Any]) -> str:
    """The status document as a human-readable table."""
    lines = [f"gpushare scheduler {doc.get('version', '?')} on {doc.get('socket', '?')}"]
    nvml = doc.get("nvml", True)
    if nvml is not True:
        lines.append(f"NVML: {nvml}")
    devices = doc.get("devices") or []
    if not devices:
        lines.append("No devices known yet (they appear when NVML finds them or a shim connects).")
        return _printable_lines(lines)
    for dev in devices:
        lines.append("")
        index = dev.get("index")
        gpu = f"GPU {index}: " if isinstance(index, int) else ""  # nvidia-smi's numbering
        lines.append(f"{gpu}{dev.get('uuid', '?')}  {dev.get('name', '')}".rstrip())
        quantum = dev.get("quantum_ms")
        quantum_text = f"{quantum / 1000:.1f}s" if isinstance(quantum, (int, float)) else "?"
        lines.append(
            f"  pool {_size(dev.get('pool_bytes'))} of {_size(dev.get('total_bytes'))}"
            f"  resident {_size(dev.get('resident_bytes'))}"
            f"  mode {dev.get('mode', '?')}  quantum {quantum_text}"
        )
        holders = ", ".join(dev.get("holders") or []) or "-"
        queue = ", ".join(dev.get("queue") or []) or "-"
        if "others" in dev:
            # A filtered view (docs/protocol.md, "Who sees what"): other users by name only.
            holders = ", ".join(dev.get("holder_users") or []) or "-"
            queue = ", ".join(dev.get("queue_users") or []) or "-"
        lines.append(f"  holder: {holders}   queue: {queue}")
        for other in dev.get("others") or []:
            n = int(other.get("clients") or 0)
            lines.append(
                f"  user {other.get('user', '?')}: {n} client{'s' if n != 1 else ''}"
                f" ({other.get('running', 0)} running, {other.get('waiting', 0)} waiting),"
                f" resident {_size(other.get('resident_bytes'))},"
                f" GPU time {_seconds(other.get('gpu_seconds'))}"
            )
        clients = dev.get("clients") or []
        if dev.get("clients_truncated"):
            lines.append(f"  ({dev['clients_truncated']} clients; too many to list)")
        if not clients:
            lines.append("  none of your clients" if "others" in dev else "  no clients")
            continue
        rows = [
            [
                "CLIENT",
                "USER",
                "PID",
                "STATE",
                "RESIDENT",
                "EVICTED",
                "QUOTA",
                "GPU TIME",
                "WAIT",
                "LABEL",
            ]
        ]
        for c in clients:
            used = int(c.get("used_bytes") or 0)
            evicted = int(c.get("evicted_bytes") or 0)
            state = str(c.get("state", "?"))
            if c.get("queue_position") is not None:
                state += f" #{c['queue_position']}"
            quota = int(c.get("quota_bytes") or 0)
            rows.append(
                [
                    str(c.get("id", "?")),
                    str(c.get("user", "")),
                    str(c.get("pid", "")),
                    state,
                    format_size(max(used - evicted, 0)),
                    format_size(evicted),
                    format_size(quota) if quota else "none",
                    _seconds(c.get("gpu_seconds")),
                    _seconds(c.get("wait_seconds")),
                    str(c.get("label", "")),
                ]
            )
        lines.extend(_table(rows))
        lines.extend(explanations(clients))
    return _printable_lines(lines)


def _printable_lines(lines: list[str]) -> str:
    """The lines for a terminal: ids, labels and names come from other users' processes, so
    their escape sequences and newlines are shown escaped, never acted on."""
    return "\n".join(printable(line) for line in lines)


def explanations(clients: list[dict[str, Any]]) -> list[str]:
    """Why each waiter waits, and holders whose revoke goes unanswered (docs/reliability.md)."""
    out = []
    for c in clients:
        wait = c.get("wait")
        if isinstance(wait, dict) and wait.get("text"):
            out.append(f"  {c.get('id', '?')}: {wait['text']}")
        revoking = c.get("revoking_seconds")
        if isinstance(revoking, (int, float)) and revoking >= 1.0:
            out.append(
                f"  {c.get('id', '?')}: asked to release {revoking:.0f}s ago, its GPU work still "
                f"runs (gpushare evict, or interrupt the kernel)"
            )
    return out
