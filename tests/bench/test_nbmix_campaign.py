"""bench.nbmix's record and its rows in the report; the training scenario's figures."""

from __future__ import annotations

import json
import statistics
import types

import pytest

from bench import nbmix
from bench.report_nbmix import nbmix_section
from bench.train_beside import figures, users


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("nbmix")
    argv = [str(out), "--seeds", "2", "--users", "8", "--horizon", "1200",
            "--capacity-seeds", "1", "--train-duration", "60", "--train-seeds", "1"]  # fmt: skip
    assert nbmix.main(argv) == 0
    return json.loads((out / "nbmix.json").read_text())


def test_the_record_has_every_variant_and_the_new_rules_beat_the_old(record):
    rows = {r["variant"]: r for r in record["rows"]}
    assert set(rows) == set(nbmix.VARIANTS)
    assert all(len(r["slowdown_p95"]) == 2 for r in rows.values())
    assert record["meta"]["git_commit"]
    # the memory-free floor is below everything; the new rules below the old on the same costs
    assert rows["fits"]["slowdown_p95_mean"] < rows["after"]["slowdown_p95_mean"]
    assert rows["after"]["slowdown_p95_mean"] < rows["before"]["slowdown_p95_mean"]
    scenarios = {t["scenario"] for t in record["training_beside"]}
    assert {"gpushare", "fair", "no pool"} <= scenarios


def test_the_report_shows_the_rows_and_the_targets(record):
    rep = types.SimpleNamespace(recs={"nbmix": record}, summary=[])
    text = nbmix_section(rep)
    assert "## 8. Memory that does not fit" in text
    assert "8 users: p95" in text and "no pool" in text
    (row, *_) = [s for s in rep.summary if s[0].startswith("nbmix, 8 users")]
    assert row[1] == "p95 slowdown ≤ 2x" and row[3].split(";")[0] in ("yes", "**no**")
    # mean ± the standard deviation over the seeds (not the 95% half-width), hints beside it
    rows = {r["variant"]: r for r in record["rows"]}
    for variant in ("after", "after-hints-5s"):
        r = rows[variant]
        shown = f"{r['slowdown_p95_mean']:.2f} ± {statistics.stdev(r['slowdown_p95']):.2f}x"
        assert shown in text, (shown, text)
        assert shown in row[2], (shown, row)
    assert "with cell hints 5 s ahead" in row[2] and "one false hint per true one" in row[2]
    assert row[3].split("; with hints: ")[1] in ("yes", "**no**"), row
    assert "the same with cell hints 5 s before every cell" in text
    empty = types.SimpleNamespace(recs={}, summary=[])
    assert "No result yet" in nbmix_section(empty) and empty.summary == []


def test_training_figures_from_a_run():
    run = {
        "cells": [
            {"user": "trainer", "arrival": 0.5, "end": 48.5, "solo": 36.0, "ok": True},
            *(
                {"user": "u0", "arrival": 10.0 + i, "end": 10.6 + i, "solo": 0.3, "ok": True}
                for i in range(20)
            ),
            {"user": "u1", "arrival": 2.0, "end": 9.0, "solo": 0.3, "ok": True},  # warm-up
        ]
    }
    f = figures(run)
    assert f["short_cells"] == 20 and f["short_p95_x"] == pytest.approx(2.0)
    assert f["trainer_throughput"] == pytest.approx(0.75)
    u = users(60.0)
    assert [x.working_set >> 30 for x in u] == [24, 8, 8, 8]
    assert all(c["gpu"] == 0.3 for x in u[1:] for c in x.cells)
