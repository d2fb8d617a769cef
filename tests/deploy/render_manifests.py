"""Generate deploy/kubernetes's manifests and deploy/prometheus's rules from the chart, through
the same Helm library the chart's tests use (tests/deploy/helm_sdk.py), so that the plain
manifests and rules cannot drift from the chart.

    python tests/deploy/render_manifests.py          # rewrite them
    python tests/deploy/render_manifests.py --check  # exit 1 when a committed one differs

The values are deploy/kubernetes/values.yaml, the namespace ``gpushare``. One file per chart
template; Helm's own labels (managed-by Helm, helm.sh/chart) are replaced, since kubectl, not Helm,
manages these objects. namespace.yaml and the kustomizations are written by hand
(tests/deploy/test_kubernetes_manifests.py checks that they list these files).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.deploy.helm_sdk import ROOT, run_helm

CHART = ROOT / "deploy" / "helm" / "jupyter-gpushare"
KUBE = ROOT / "deploy" / "kubernetes"
VALUES = KUBE / "values.yaml"
NAMESPACE, RELEASE = "gpushare", "gpushare"
#: Objects of the Prometheus operator's CRDs, and the dashboard for Grafana's sidecar: applied
#: from deploy/kubernetes/monitoring (a kustomization of its own), not with the base.
MONITORING = ("servicemonitor.yaml", "prometheusrule.yaml", "dashboard-configmap.yaml")
#: The alerts for Prometheus without the operator (a systemd install): the chart's, with the
#: `up` series of deploy/prometheus/prometheus.yml's scrape job.
PLAIN_RULES = ROOT / "deploy" / "prometheus" / "gpushare-rules.yml"
PLAIN_JOB = "gpushare"
PLAIN_HEADER = """\
# GENERATED from deploy/helm/jupyter-gpushare/templates/prometheusrule.yaml (the chart's defaults,
# prometheusRule.upSelector: job="gpushare") by tests/deploy/render_manifests.py.
# Prometheus rule_files entry for a scheduler scraped as prometheus.yml beside this file shows.
"""
HEADER = """\
# GENERATED from deploy/helm/jupyter-gpushare/templates/{name} with deploy/kubernetes/values.yaml
# by tests/deploy/render_manifests.py: edit the chart or the values, then run it again.
"""


def render() -> dict[Path, str]:
    """Path -> its text, as the committed files should be."""
    values = yaml.safe_load(VALUES.read_text())
    jobs = [
        {"values": values, "namespace": NAMESPACE, "release": RELEASE},
        {"values": {"prometheusRule": {"upSelector": f'job="{PLAIN_JOB}"'}}},
    ]
    results = run_helm(CHART, {"renders": jobs})["renders"]
    for result in results:
        if "error" in result:
            raise RuntimeError(f"helm install: {result['error']}")
    out = {
        KUBE / ("monitoring" if name in MONITORING else "") / name: text
        for name, text in _split(results[0]["manifest"]).items()
    }
    [rule] = [o for o in results[1]["created"] if o["kind"] == "PrometheusRule"]
    groups = yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False, width=100)
    out[PLAIN_RULES] = PLAIN_HEADER + groups
    return out


def _split(manifest: str) -> dict[str, str]:
    """Helm's manifest as one text per chart template."""
    files: dict[str, list[str]] = {}
    for part in re.split(r"^---\n", manifest, flags=re.M):
        match = re.match(r"# Source: jupyter-gpushare/templates/(\S+)\n", part)
        if not match or not part[match.end() :].strip():
            continue
        body = part[match.end() :]
        body = body.replace(
            "app.kubernetes.io/managed-by: Helm", "app.kubernetes.io/managed-by: kubectl"
        )
        body = re.sub(r"^\s*helm\.sh/chart: .*\n", "", body, flags=re.M)
        files.setdefault(match.group(1), []).append(body.rstrip("\n") + "\n")
    return {name: HEADER.format(name=name) + "---\n".join(docs) for name, docs in files.items()}


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for path, text in sorted(render().items()):
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not check:
            path.write_text(text)
    for name in stale:
        print(f"{'stale' if check else 'written'}: {name}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
