"""The JSON log formatter (scheduler/shell/logs.py) takes its fields from the log call, not from the
printed text: a value cannot add or replace a field; and the scheduler's metrics carry no
``_created`` series."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from jupyter_gpushare.scheduler.shell.logs import JsonFormatter


def fmt(msg: str, *args: object) -> dict:
    rec = logging.LogRecord("GPUShareScheduler", logging.INFO, "", 0, msg, args, None)
    return dict(json.loads(JsonFormatter().format(rec)))


def test_a_value_cannot_forge_a_field() -> None:
    doc = fmt("join client=%s user=%s uid=%d label=%s", "k1", "bob reason=forged uid=0", 1000,
              "x client=k9")  # fmt: skip
    assert doc["event"] == "join"
    assert doc["user"] == "bob reason=forged uid=0" and doc["uid"] == 1000
    assert doc["client"] == "k1" and doc["label"] == "x client=k9"
    assert "reason" not in doc
    # The printed message is unchanged.
    assert (
        doc["message"] == "join client=k1 user=bob reason=forged uid=0 uid=1000 label=x client=k9"
    )


def test_fields_written_in_the_format_string_and_composed_fragments() -> None:
    doc = fmt("%s client=%s %s ms=%.1f step=evict (on release)", "evicted", "k2",
              "bytes=1048576 (1.00 MiB)", 2.25)  # fmt: skip
    assert doc["event"] == "evicted" and doc["client"] == "k2" and doc["bytes"] == 1048576
    assert doc["ms"] == 2.25 and doc["step"] == "evict"
    assert fmt("100%% done x=%d", 3)["x"] == 3


def test_metrics_have_no_created_series() -> None:
    from prometheus_client import generate_latest

    from jupyter_gpushare.scheduler.shell.metrics import SchedulerMetrics

    metrics = SchedulerMetrics()
    metrics.set_gpus([SimpleNamespace(uuid="GPU-a", index=0, name="GPU")])
    metrics.granted("GPU-a", 0.5)
    metrics.gpu_time("alice", 1.0)
    text = generate_latest(metrics.registry).decode()
    assert "gpushare_grants_total{" in text and "gpushare_wait_seconds_count{" in text
    assert "_created" not in text
