"""docs/rest-api.yaml's component schemas as plain JSON Schema, for tests that check what the
REST API answers (tests/jupyter/test_server_api.py, tests/hub/test_hub_e2e.py)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["openapi_schema"]


def openapi_schema(name: str) -> dict[str, Any]:
    """A component schema of docs/rest-api.yaml as plain JSON Schema (``nullable`` → null)."""
    import yaml

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "rest-api.yaml")) as f:
        spec = yaml.safe_load(f)
    assert spec["openapi"].startswith("3.0")
    components = spec["components"]["schemas"]

    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(n) for n in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            return convert(components[node["$ref"].rsplit("/", 1)[-1]])
        out = {k: convert(v) for k, v in node.items() if k != "nullable"}
        if node.get("nullable"):
            return {"anyOf": [out, {"type": "null"}]}
        return out

    return convert(components[name])  # type: ignore[no-any-return]
