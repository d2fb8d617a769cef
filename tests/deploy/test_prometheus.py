"""Monitoring without Kubernetes, checked with Prometheus' own promtool (Debian's `prometheus`
package; .ci/run installs it when it runs as root): the scrape example and the plain rules file
(deploy/prometheus/, the rules rendered from the chart by tests/deploy/render_manifests.py), a
promtool unit test of every alert (tests/deploy/gpushare-rules.test.yml), and the scheduler's
real /metrics text through `promtool check metrics`, whose only complaint is the camelCase
`modelName` label that dcgm-exporter uses and the scheduler keeps for joins."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
RULES = PROM / "gpushare-rules.yml"
UNIT_TESTS = Path(__file__).with_name("gpushare-rules.test.yml")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool is not installed (Debian's `prometheus` package provides it; .ci/run "
            "installs it when run as root)"
        )
    return path


def run(promtool: str, *args: str, cwd: Path = ROOT, stdin: str | None = None) -> str:
    out = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120,
                         cwd=cwd, input=stdin)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def alerts() -> dict[str, dict]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"]}


def test_plain_rules_and_scrape_example_pass_promtool(promtool: str) -> None:
    assert "SUCCESS: 4 rules found" in run(promtool, "check", "rules", str(RULES))
    out = run(promtool, "check", "config", "prometheus.yml", cwd=PROM)
    assert "SUCCESS: 1 rule files found" in out


def test_the_scrape_example_gives_the_labels_the_rules_use() -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert config["rule_files"] == [RULES.name]
    [job] = config["scrape_configs"]
    for name in ("GPUShareSchedulerDown", "GPUShareSchedulersAbsent"):
        assert f'job="{job["job_name"]}"' in alerts()[name]["expr"]
    # The dashboard's and the alerts' `node`: set from the target's host.
    [relabel] = job["relabel_configs"]
    assert relabel["target_label"] == "node" and relabel["source_labels"] == ["__address__"]
    host = re.fullmatch(relabel["regex"], job["static_configs"][0]["targets"][0])
    assert host is not None and host.expand(relabel["replacement"].replace("$1", r"\1"))
    assert "node" in alerts()["GPUShareWaitersStarving"]["expr"]


def test_every_alert_has_a_promtool_unit_test(promtool: str) -> None:
    doc = yaml.safe_load(UNIT_TESTS.read_text())
    cases = [c for t in doc["tests"] for c in t["alert_rule_test"]]
    for name in alerts():
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"{name}: no case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{name}: no case where it stays quiet"
    assert "SUCCESS" in run(promtool, "test", "rules", str(UNIT_TESTS))


def test_scheduler_metrics_pass_promtool_but_for_dcgm_exporters_modelName(promtool: str) -> None:
    from prometheus_client import generate_latest

    from jupyter_gpushare.scheduler.shell.metrics import SchedulerMetrics

    metrics = SchedulerMetrics()
    metrics.set_gpus([SimpleNamespace(uuid="GPU-a", index=0, name="NVIDIA H100 80GB HBM3")])
    metrics.granted("GPU-a", 0.5)
    metrics.released("GPU-a", True, 1 << 20)
    metrics.moved("GPU-a", "restore", 1 << 20)
    metrics.gpu_time("alice", 2.0)
    text = generate_latest(metrics.registry).decode()
    assert 'modelName="NVIDIA H100 80GB HBM3"' in text
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    complaints = (check.stdout + check.stderr).strip().splitlines()
    assert complaints and all("'camelCase'" in line for line in complaints), complaints
    # The same text with modelName renamed has nothing to complain about.
    run(promtool, "check", "metrics", stdin=text.replace("modelName=", "model_name="))
