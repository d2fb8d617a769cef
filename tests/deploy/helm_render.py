"""Lint and render a Helm chart with the real Helm (v4's Go library, as the helm-sdkpy wheel ships
it: a shared library with a C interface, called here through cffi), in a process of its own.

    python tests/deploy/helm_render.py LIBHELM.so < jobs.json > results.json

jobs.json: {"chart": PATH, "lint": true, "package": DIR, "renders": [{"values": {...},
"kube_version": "1.30.0", "namespace": "jhub", "release": "gpushare"}, ...]}. Each render is a real
`helm install` with client-side apply against a stand-in API server (below) that answers discovery
for the given Kubernetes version, says every object is new, and keeps what Helm creates; the release
is kept in memory (HELM_DRIVER=memory). The answer: {"lint": {...}, "renders": [{"manifest": TEXT,
"created": [OBJECTS], "hooks": [TEXT]}], "package": {"path": ARCHIVE}}, or {"error": TEXT} for the
render (or package) that failed.

A process of its own because the library starts the Go runtime (threads, signal handlers), which
the test process should not have to live with.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

# The API groups the chart's kinds live in: (plural, kind, namespaced) per group/version.
RESOURCES: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [("configmaps", "ConfigMap", True), ("services", "Service", True),
           ("serviceaccounts", "ServiceAccount", True), ("secrets", "Secret", True),
           ("namespaces", "Namespace", False), ("pods", "Pod", True)],
    "apps/v1": [("daemonsets", "DaemonSet", True), ("deployments", "Deployment", True)],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True)],
    "rbac.authorization.k8s.io/v1": [("roles", "Role", True),
                                     ("rolebindings", "RoleBinding", True)],
    "monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor", True),
                                 ("prometheusrules", "PrometheusRule", True)],
}  # fmt: skip

CDEF = """
typedef unsigned long long helm_sdkpy_handle;
char* helm_sdkpy_last_error(void);
char* helm_sdkpy_version_string(void);
int helm_sdkpy_config_create(char* namespace, char* kubeconfig, char* kubecontext,
                             char* options_json, helm_sdkpy_handle* handle_out);
void helm_sdkpy_config_destroy(helm_sdkpy_handle handle);
int helm_sdkpy_lint(helm_sdkpy_handle handle, char* chart_path, char** result_json);
int helm_sdkpy_package(helm_sdkpy_handle handle, char* chart_path, char* dest_dir,
                       char** result_path);
int helm_sdkpy_install(helm_sdkpy_handle handle, char* release_name, char* chart_path,
                       char* values_json, char* version, char* options_json, char** result_json);
"""


class StandInAPI(BaseHTTPRequestHandler):
    """Enough of a kube-apiserver for `helm install`: /version, discovery, 404 for every GET of
    an object (nothing exists yet), and POSTs kept in ``server.created``."""

    server: Any

    def _send(self, code: int, doc: Any) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass

    def _resource_list(self, group_version: str) -> dict[str, Any]:
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": [
                {"name": plural, "singularName": kind.lower(), "namespaced": namespaced,
                 "kind": kind, "verbs": ["create", "delete", "get", "list", "patch", "update"]}
                for plural, kind, namespaced in RESOURCES[group_version]
            ],
        }  # fmt: skip

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        major, minor = self.server.kube_version.split(".")[:2]
        if path == "/version":
            return self._send(200, {"major": major, "minor": minor,
                                    "gitVersion": f"v{self.server.kube_version}",
                                    "platform": "linux/amd64"})  # fmt: skip
        if path == "/api":
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"],
                                    "serverAddressByClientCIDRs": []})  # fmt: skip
        if path == "/apis":
            groups = []
            for gv in RESOURCES:
                if "/" in gv:
                    group, version = gv.split("/")
                    ref = {"groupVersion": gv, "version": version}
                    groups.append({"name": group, "versions": [ref], "preferredVersion": ref})
            return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
        if path == "/api/v1":
            return self._send(200, self._resource_list("v1"))
        if path.startswith("/apis/") and path[len("/apis/") :] in RESOURCES:
            return self._send(200, self._resource_list(path[len("/apis/") :]))
        missing = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                   "reason": "NotFound", "code": 404, "message": "not found"}  # fmt: skip
        return self._send(404, missing)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        obj = json.loads(self.rfile.read(length) or b"{}")
        self.server.created.append(json.loads(json.dumps(obj)))
        obj.setdefault("metadata", {}).update(uid="stand-in", resourceVersion="1")
        return self._send(201, obj)


def kubeconfig(port: int) -> str:
    return f"""apiVersion: v1
kind: Config
clusters: [{{name: stand-in, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: stand-in, user: {{token: stand-in}}}}]
contexts: [{{name: stand-in, context: {{cluster: stand-in, user: stand-in}}}}]
current-context: stand-in
"""


def main() -> None:
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    lib = ffi.dlopen(sys.argv[1])
    jobs = json.load(sys.stdin)
    chart = jobs["chart"].encode()
    out: dict[str, Any] = {"helm": ffi.string(lib.helm_sdkpy_version_string()).decode()}

    def error() -> str:
        return str(ffi.string(lib.helm_sdkpy_last_error()).decode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "kubeconfig")
        with open(config_path, "w") as f:
            f.write(kubeconfig(server.server_address[1]))
        if jobs.get("lint"):
            handle = ffi.new("helm_sdkpy_handle*")
            assert lib.helm_sdkpy_config_create(b"default", b"", b"", b"{}", handle) == 0, error()
            result = ffi.new("char**")
            if lib.helm_sdkpy_lint(handle[0], chart, result) != 0:
                out["lint"] = {"error": error()}
            else:
                out["lint"] = json.loads(ffi.string(result[0]))
            lib.helm_sdkpy_config_destroy(handle[0])
        if jobs.get("package"):  # `helm package CHART -d DIR`: the archive's path
            handle = ffi.new("helm_sdkpy_handle*")
            assert lib.helm_sdkpy_config_create(b"default", b"", b"", b"{}", handle) == 0, error()
            result = ffi.new("char**")
            if lib.helm_sdkpy_package(handle[0], chart, jobs["package"].encode(), result) != 0:
                out["package"] = {"error": error()}
            else:
                out["package"] = {"path": ffi.string(result[0]).decode()}
            lib.helm_sdkpy_config_destroy(handle[0])
        out["renders"] = []
        for job in jobs.get("renders", []):
            server.kube_version = job.get("kube_version", "1.34.0")  # type: ignore[attr-defined]
            server.created = []  # type: ignore[attr-defined]
            handle = ffi.new("helm_sdkpy_handle*")
            namespace = job.get("namespace", "default").encode()
            rc = lib.helm_sdkpy_config_create(namespace, config_path.encode(), b"", b"{}", handle)
            assert rc == 0, error()
            options = {"wait": False, "timeout_seconds": 60, "disable_openapi_validation": True}
            result = ffi.new("char**")
            rc = lib.helm_sdkpy_install(
                handle[0], job.get("release", "gpushare").encode(), chart,
                json.dumps(job.get("values", {})).encode(), b"", json.dumps(options).encode(),
                result,
            )  # fmt: skip
            if rc != 0:
                out["renders"].append({"error": error()})
            else:
                release = json.loads(ffi.string(result[0]))
                out["renders"].append(
                    {"manifest": release["manifest"], "created": server.created,  # type: ignore[attr-defined]
                     "status": release["info"]["status"],
                     "hooks": [h["manifest"] for h in release.get("hooks") or []]}
                )  # fmt: skip
            lib.helm_sdkpy_config_destroy(handle[0])
    server.shutdown()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    # The release record stays in this process (no Secret). The Go runtime reads the environment
    # the process started with, not os.environ: start again with it set.
    if os.environ.get("HELM_DRIVER") != "memory":
        env = {**os.environ, "HELM_DRIVER": "memory"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    main()
