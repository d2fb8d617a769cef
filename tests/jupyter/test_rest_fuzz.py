"""The REST API fuzzed from its OpenAPI description (docs/rest-api.yaml) with schemathesis.

Against a real jupyter-server with the extension and its embedded scheduler, two fake kernels
joined (one holds the GPU, one waits). Every operation but the websocket gets generated requests,
valid ones (conforming to the description) and invalid ones, on unknown kernel ids and on the
known ones: no answer may be a 5xx, every answer must conform to the description (status code,
content type, body schema), invalid input must be refused with a 4xx, and afterwards the
scheduler's state is still consistent and it still works. Bounded: a few dozen examples per
operation and mode, derandomized (the same requests every run), well under a minute.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from server_helpers import *  # noqa: F403
from server_helpers import FakeShim, GiB, clients_of, fetch_json, started

from jupyter_gpushare.protocol import MsgType

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

SPEC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "rest-api.yaml")
EXAMPLES = int(os.environ.get("GPUSHARE_FUZZ_EXAMPLES", "25"))


def fuzz_operation(
    op: Any, mode: Any, base_url: str, headers: dict[str, str], **over: Any
) -> collections.Counter[int]:
    """Run one operation's generated cases (blocking: called in a thread while the server runs
    on the test's loop). Returns how many answers had each status code."""
    codes: collections.Counter[int] = collections.Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode, **over))
    def run(case: Any) -> None:
        if mode is GenerationMode.POSITIVE:
            # Valid requests are authenticated (the generated token values are not the server's).
            (case.query or {}).pop("token", None)
            case.headers = {**(case.headers or {}), **headers}
        response = case.call(base_url=base_url, headers=headers, timeout=30)
        codes[response.status_code] += 1
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} body={case.body!r}: "
            f"{response.status_code} {response.text[:500]}"
        )
        case.validate_response(response, headers=headers)

    run()
    return codes


async def test_rest_api_fuzzed_from_its_openapi_description(
    jp_serverapp: Any, jp_fetch: Any, jp_http_port: int, jp_base_url: str, jp_auth_header: Any
) -> None:
    ext = await started(jp_serverapp)
    path = ext.backend.socket_path
    holder = await FakeShim.join(path, "k-holder", used=700 * 1024 * 1024)
    waiter = await FakeShim.join(path, "k-waiter", used=700 * 1024 * 1024)
    for shim in (holder, waiter):
        await shim.send(
            MsgType.REQUEST,
            used_bytes=700 << 20,
            managed_bytes=700 << 20,
            pinned_bytes=0,
            evicted_bytes=0,
        )
        if shim is holder:
            await holder.expect(MsgType.GRANT)

    schema = schemathesis.openapi.from_path(SPEC)
    base_url = f"http://localhost:{jp_http_port}{jp_base_url.rstrip('/')}"
    headers = dict(jp_auth_header)
    loop = asyncio.get_running_loop()
    codes: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if not op.path.endswith("/events")]  # the websocket
    assert {op.label for op in operations} == {
        "GET /gpushare/api/status",
        "GET /gpushare/api/history",
        "POST /gpushare/api/kernels/{kernel_id}/release",
        "POST /gpushare/api/kernels/{kernel_id}/evict",
        "PUT /gpushare/api/kernels/{kernel_id}/quota",
        "POST /gpushare/api/kernels/{kernel_id}/hint",
    }
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            codes[f"{op.label} {mode.value}"] += await loop.run_in_executor(
                None, fuzz_operation, op, mode, base_url, headers
            )
            if "{kernel_id}" in op.path and mode is GenerationMode.POSITIVE:
                # The known kernels too, or only the 404 path would be explored.
                for kid in ("k-holder", "k-waiter"):
                    known = {"path_parameters": {"kernel_id": kid}}
                    codes[f"{op.label} {mode.value} known"] += await loop.run_in_executor(
                        None,
                        functools.partial(fuzz_operation, op, mode, base_url, headers, **known),
                    )
    print(dict(codes))
    # Both the refusals and the successes were explored.
    assert codes["GET /gpushare/api/status positive"][200] > 0, codes
    assert codes["GET /gpushare/api/history positive"][200] > 0, codes
    for action in ("release", "evict", "quota", "hint"):
        method = "PUT" if action == "quota" else "POST"
        assert codes[f"{method} /gpushare/api/kernels/{{kernel_id}}/{action} positive known"][200]
        assert codes[f"{method} /gpushare/api/kernels/{{kernel_id}}/{action} positive"][404]

    # The scheduler's state is consistent, and it still works.
    doc = await fetch_json(jp_fetch, "gpushare", "api", "status")
    clients = clients_of(doc)
    assert set(clients) == {"k-holder", "k-waiter"}, clients
    (dev,) = doc["devices"]
    assert len(dev["holders"]) <= 1 and set(dev["holders"]) | set(dev["queue"]) <= set(clients)
    for c in clients.values():
        assert c["used_bytes"] == 700 << 20
        assert 0 <= c["quota_bytes"] < 1 << 64
    reply = await fetch_json(
        jp_fetch, "gpushare", "api", "kernels", "k-holder", "quota", method="PUT",
        body='{"quota": "2GiB"}',
    )  # fmt: skip
    assert reply["quota"] == 2 * GiB
    # The history followed both kernels, and the GPU, with at least one point each.
    history = await fetch_json(jp_fetch, "gpushare", "api", "history")
    assert set(history["kernels"]) == {"k-holder", "k-waiter"}, history
    assert history["kernels"]["k-waiter"]["points"][-1][1:3] == [700 << 20, 0]
    assert len(history["devices"]) == 1 and history["window_seconds"] == 3600
    await holder.close()
    await waiter.close()
