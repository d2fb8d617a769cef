"""Kubernetes Events about the node, posted by the device plugin where an operator looks
(`kubectl describe node NODE`, `kubectl get events`): why the node advertises no GPU memory, a GPU
marked unhealthy after an XID error, a pod refused because the kubelet split its units over GPUs.

A few lines of HTTP (the core/v1 Event API, in-cluster credentials: the service account's
projected token and CA), not a Kubernetes client library. The event's object is the Node, named
as the kubelet names it in its own node events (``uid`` = the node's name), so that `kubectl
describe node` lists it; the event itself lives in the plugin's namespace, where the chart's Role
lets it create events and nothing else. Without an API server (not in a cluster) or a node name,
events are off and :meth:`NodeEvents.warn` only logs.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import ssl
import urllib.request

__all__ = ["COMPONENT", "NodeEvents"]

COMPONENT = "gpushare-device-plugin"


class NodeEvents:
    """Posts Warning events about ``node`` to ``api_url`` in ``namespace``."""

    def __init__(
        self,
        log: logging.Logger | logging.LoggerAdapter,  # type: ignore[type-arg]
        api_url: str,
        node: str,
        namespace: str,
        token_file: str = "",
        ca_file: str = "",
    ) -> None:
        self.log = log
        self.api_url = api_url.rstrip("/")
        self.node = node
        self.namespace = namespace
        self.token_file = token_file
        self.ca_file = ca_file
        self.posted: list[dict[str, object]] = []  # what the API server accepted

    @classmethod
    def in_cluster(
        cls,
        log: logging.Logger | logging.LoggerAdapter,  # type: ignore[type-arg]
        node: str,
        api_url: str = "",
        account_dir: str = "/var/run/secrets/kubernetes.io/serviceaccount",
    ) -> NodeEvents:
        """From the pod's environment: KUBERNETES_SERVICE_HOST/PORT (unless ``api_url``) and the
        service account's token, CA and namespace under ``account_dir``."""
        if not api_url and os.environ.get("KUBERNETES_SERVICE_HOST"):
            host = os.environ["KUBERNETES_SERVICE_HOST"]
            host = f"[{host}]" if ":" in host else host
            api_url = f"https://{host}:{os.environ.get('KUBERNETES_SERVICE_PORT', '443')}"
        namespace = "default"
        try:
            with open(os.path.join(account_dir, "namespace")) as f:
                namespace = f.read().strip() or namespace
        except OSError:
            pass
        return cls(
            log,
            api_url,
            node,
            namespace,
            token_file=os.path.join(account_dir, "token"),
            ca_file=os.path.join(account_dir, "ca.crt"),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.api_url and self.node)

    def event(self, reason: str, message: str) -> dict[str, object]:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{self.node}.gpushare.", "namespace": self.namespace},
            # uid = the name, as in the kubelet's node events: `kubectl describe node` finds it.
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self.node,
                "uid": self.node,
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning",
            "source": {"component": COMPONENT, "host": self.node},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }

    def _post(self, body: dict[str, object]) -> None:
        url = f"{self.api_url}/api/v1/namespaces/{self.namespace}/events"
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token_file and os.path.exists(self.token_file):
            with open(self.token_file) as f:  # read each time: projected tokens rotate
                headers["Authorization"] = f"Bearer {f.read().strip()}"
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if url.startswith("https:"):
            cafile = self.ca_file if self.ca_file and os.path.exists(self.ca_file) else None
            handlers.append(
                urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=cafile))
            )
        # No proxy from the environment: the API server is the cluster's own.
        opener = urllib.request.build_opener(*handlers)
        request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
        with opener.open(request, timeout=10) as response:
            response.read()

    async def warn(self, reason: str, message: str) -> bool:
        """Log ``message`` as a warning and post it as a Warning event (True when the API server
        took it; a failure to post is logged, never raised)."""
        self.log.warning("gpushare device plugin: %s: %s", reason, message)
        if not self.enabled:
            return False
        body = self.event(reason, message)
        try:
            await asyncio.to_thread(self._post, body)
        except Exception as exc:  # the event is a courtesy: the log line above stays
            self.log.warning("gpushare device plugin: cannot post the event %s: %s", reason, exc)
            return False
        self.posted.append(body)
        return True
