"""The per-uid log budget (issue 22, A11) says when it starts dropping lines, and --debug keeps
them: a GPU run of 32 notebook kernels of one uid at DEBUG lost every grant past the first 300
info lines of the minute, and the log never said so before the test ended."""

from __future__ import annotations

import logging

import pytest

from jupyter_gpushare.scheduler.shell.transport import LogLimiter


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def clock() -> list[float]:
    """The limiter's clock, set by the test (no wall-clock race)."""
    return [1000.0]


def _logger(level: int) -> tuple[logging.Logger, _Records]:
    log = logging.getLogger(f"test_log_limiter.{level}")
    log.handlers.clear()
    log.propagate = False
    log.setLevel(level)
    records = _Records()
    log.addHandler(records)
    return log, records


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
def test_lines_past_the_budget_are_announced_counted_and_kept_at_debug(
    clock: list[float], level: int
) -> None:
    log, records = _logger(level)
    limiter = LogLimiter(log, burst=2, period=60.0, info_burst=3, clock=lambda: clock[0])
    for i in range(5):
        limiter.info(7, "grant client=k%d", i)
    clock[0] += 10.0
    limiter.warning(7, "bad frame %d", 1)  # warnings have a budget of their own
    infos = records.at(logging.INFO)
    # The first three, then one line saying the rest of the minute is counted, not logged.
    assert infos[:3] == ["grant client=k0", "grant client=k1", "grant client=k2"]
    assert infos[3:] == [
        "uid 7: more than 3 info lines about it in 60 s: the rest are counted, not logged, "
        "until 60 s from now (--debug logs them as debug lines)"
    ]
    assert records.at(logging.WARNING) == ["bad frame 1"]
    # At DEBUG the two past the budget are there, as debug lines; at INFO nothing more is.
    debug = records.at(logging.DEBUG)
    assert debug == (["grant client=k3", "grant client=k4"] if level == logging.DEBUG else [])
    # The next period starts with the count of what was held back, then logs again.
    clock[0] += 60.0
    limiter.info(7, "grant client=k%d", 5)
    assert records.at(logging.INFO)[4:] == [
        "uid 7: 2 more info line(s) about it were not logged",
        "grant client=k5",
    ]


def test_each_uid_has_its_own_budget_and_its_own_notice(clock: list[float]) -> None:
    log, records = _logger(logging.INFO)
    limiter = LogLimiter(log, burst=1, period=60.0, info_burst=1, clock=lambda: clock[0])
    for uid in (1, 1, 1, 2):
        limiter.info(uid, "line of %d", uid)
    assert records.at(logging.INFO) == [
        "line of 1",
        "uid 1: more than 1 info lines about it in 60 s: the rest are counted, not logged, "
        "until 60 s from now (--debug logs them as debug lines)",
        "line of 2",
    ]
