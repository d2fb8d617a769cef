"""The fixed-quantum baseline's idle timer: what a sampler of GPU utilisation sees.

Pure arithmetic on a holder's grant time and the policy's clock (``now``), for
``PolicyConfig(policy="fixed-quantum")`` (:meth:`.policy.Policy._admit_fixed`): the timer checks
every ``interval`` seconds from the grant, and learns of a finished cell between one and two
intervals late, never at once (Jupyter's cell-end signal is not used).
"""

from __future__ import annotations

from .policy_state import ClientState

__all__ = ["found_idle", "next_idle_check"]


def _checks_done(c: ClientState, now: float, interval: float) -> int:
    # The epsilon: at the instant next_deadline() named, the division may fall short of k.
    return int((now - c.run_start) / interval + 1e-9)


def next_idle_check(c: ClientState, now: float, interval: float) -> float:
    """When the timer checks the holder ``c`` next."""
    return c.run_start + (_checks_done(c, now, interval) + 1) * interval


def found_idle(c: ClientState, now: float, interval: float) -> bool:
    """The timer's verdict: at its last check, the holder had been idle the whole interval."""
    k = _checks_done(c, now, interval)
    if k < 1 or not c.idle:
        return False
    return c.idle_since <= c.run_start + (k - 1) * interval
