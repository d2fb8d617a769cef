"""Generate deploy/kubernetes's manifests from the chart, through the same Helm library the chart's
tests use (tests/deploy/helm_sdk.py), so that the plain manifests cannot drift from the chart.

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
HEADER = """\
# GENERATED from deploy/helm/jupyter-gpushare/templates/{name} with deploy/kubernetes/values.yaml
# by tests/deploy/render_manifests.py: edit the chart or the values, then run it again.
"""


def render() -> dict[str, str]:
    """File name -> its text, as the committed files should be."""
    values = yaml.safe_load(VALUES.read_text())
    job = {"values": values, "namespace": NAMESPACE, "release": RELEASE}
    [result] = run_helm(CHART, {"renders": [job]})["renders"]
    if "error" in result:
        raise RuntimeError(f"helm install: {result['error']}")
    files: dict[str, list[str]] = {}
    for part in re.split(r"^---\n", result["manifest"], flags=re.M):
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
    for name, text in sorted(render().items()):
        path = KUBE / ("monitoring" if name in MONITORING else "") / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not check:
            path.write_text(text)
    for name in stale:
        print(f"{'stale' if check else 'written'}: {name} in deploy/kubernetes")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
