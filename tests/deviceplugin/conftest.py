"""The device plugin tests' kubelet stand-in, serving in a fresh directory per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.deviceplugin.kubelet_standin import KubeletStandIn


@pytest.fixture
async def kubelet(sock_dir: str) -> AsyncIterator[KubeletStandIn]:
    directory = Path(sock_dir) / "device-plugins"
    directory.mkdir()
    k = KubeletStandIn(directory)
    await k.server.start()
    yield k
    await k.server.stop(grace=None)
