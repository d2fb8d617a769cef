"""The test tiers: a fast one that README.md's test command runs (`pytest`), and a slow one that
CI runs after it (`pytest -m slow`), both spread over the machine's cores by pytest-xdist.

**slow** marks what needs real servers, real users, browsers, the hub, package builds, or a long
scenario of the native engine (each test here took 10 s or more on a loaded 2-core machine). The
modules and tests are listed in SLOW below, one place, with the reason; a module may also say
``pytestmark = pytest.mark.slow`` itself. pyproject's addopts deselects the tier by default
(``-m 'not gpu and not slow and not mutation'``); ``pytest -m slow`` runs it, ``pytest -m 'not gpu
and not mutation'`` runs both; ``pytest -m mutation`` runs the 20-minute mutation check.

**xdist**: when pytest-xdist is installed (the [test] extra) and the command line does not say
``-n``, the run uses ``-n auto --dist loadgroup``: one worker per core, tests that share a place
outside their own temporary directories (``xdist_group``, GROUPS below) on one worker. Every
worker builds the native artefacts into its own temporary directory (tests/conftest.py's
``native_build``), so workers share no build. A GPU run (``-m gpu``) stays in one process: the
GPU tests measure the device and must not share it; so does ``--pdb``, and a run without
pytest-xdist (the GPU machines carry no such wheel).
"""

from __future__ import annotations

import os

import pytest

#: Node id prefixes of the slow tier (a directory, a module, or one test), by reason.
SLOW: tuple[str, ...] = (
    # Browsers, real JupyterLab and Notebook servers, jlpm and jest (tests/ui).
    "tests/ui/",
    # A real JupyterHub with its proxy from npm.
    "tests/hub/test_hub_e2e.py",
    # Package builds: the README's first command twice (as root and a new user), the sdist and
    # the wheel, a build without Node.js, a conda recipe's build.
    "tests/packaging/test_readme_first_command.py",
    "tests/packaging/test_packaging.py",
    "tests/packaging/test_first_hour_errors.py::test_a_build_without_node_says_so_in_one_line",
    "tests/packaging/test_no_damage.py",
    "tests/packaging/test_docs_site.py",  # the documentation site, built by Sphinx
    # Real Jupyter servers with real kernels.
    "tests/jupyter/test_server_",
    "tests/jupyter/test_rest_fuzz.py",
    "tests/jupyter/test_short_first_e2e.py",
    "tests/jupyter/test_backend_evict_wait.py",
    "tests/reliability/test_server_crash.py",
    "tests/reliability/test_server_adopt.py",
    # Real users (useradd), hostile ones included.
    "tests/reliability/test_hostile_",
    "tests/reliability/test_deep_idle_service_account.py",
    "tests/reliability/test_revoke_signal_pidfd.py",
    "tests/reliability/test_socket_race.py",
    "tests/reliability/test_token_namespace.py",
    # Long scenarios: a soak, a long holder, restarts, property searches of the policy.
    "tests/reliability/test_soak.py",
    "tests/reliability/test_long_holder.py",
    "tests/reliability/test_scheduler_restart.py",
    "tests/reliability/test_holder_killed.py",
    "tests/reliability/test_resume_properties.py",
    "tests/policy/test_policy_properties.py",
    "tests/policy/test_policy_keep_free_properties.py",
    "tests/policy/test_policy_ahead_properties.py",
    "tests/scheduler/test_protocol_fuzz.py::test_encode_decode_round_trip",
    "tests/scheduler/test_contracts.py::test_size_syntax_agrees_on_generated_sizes",
    # The native engine's long scenarios (memory moved to the host and back, several processes
    # taking turns, restarts) and the whole-source call graph (its first test pays 2-3 minutes).
    "tests/native/test_layering.py",
    "tests/native/test_memory_engine.py",
    "tests/native/test_two_device_memory.py",
    "tests/native/test_async_copies.py",
    "tests/native/test_sharing.py",
    "tests/native/test_gating.py",
    "tests/native/test_verify_moves.py",
    "tests/native/test_capture.py",
    "tests/native/test_deep_idle.py",
    "tests/native/test_quit_signals.py",
    "tests/native/test_memory_past_room.py",
    "tests/native/test_cold_eviction.py",
    "tests/native/test_ipc.py",
    "tests/native/test_two_devices.py",
    "tests/native/test_pool_accounting.py",
    "tests/native/test_deferred_backing.py",
    "tests/native/test_card_sharing.py",  # several processes past one stand-in card
    "tests/native/test_card_room.py",
    "tests/native/test_host_budget.py",
    "tests/native/test_staging_allowance.py",
    # The device plugin's allocation socket with a shim built for it (about 2 minutes each).
    "tests/deviceplugin/test_allocation_ceiling.py",
    # The benchmarks' stand-in campaigns (a scheduler, shims and replays in real time).
    "tests/bench/test_campaign_standin.py",
    "tests/bench/test_nbmix_replay_standin.py",
    "tests/bench/test_capacity.py",
    "tests/bench/test_ordering_standin.py",
    "tests/bench/test_cold_eviction_standin.py",
    "tests/bench/test_nbmix_replay_form.py",
)

#: Tests that share something outside their temporary directories run on one worker, in turn.
GROUPS: dict[str, tuple[str, ...]] = {
    # labextension/ (jlpm install, node_modules) and the built sidebar under jupyter_gpushare/.
    "source-tree": (
        "tests/ui/",
        "tests/packaging/test_packaging.py",
        "tests/packaging/test_no_damage.py",
        "tests/packaging/test_first_hour_errors.py",
    ),
    # .cache/chp (configurable-http-proxy installed by npm) and the hub's ports.
    "hub": ("tests/hub/",),
    # .cache/helm-sdkpy, fetched once.
    "helm": ("tests/deploy/test_helm_chart.py",),
}


#: Slow tests seen failing every run whose cause is not yet found: expected to fail (not strictly:
#: each one's fix removes its line here) so that the rest of the slow tier keeps running in CI.
#: Each is owed and named in the issue notes. Empty since the three of 2026-12-02 were mended.
KNOWN_FAILING: dict[str, str] = {}


def is_slow(nodeid: str) -> bool:
    return nodeid.startswith(SLOW)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouped = config.pluginmanager.hasplugin("xdist")  # which knows the xdist_group mark
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
        if item.nodeid in KNOWN_FAILING:
            item.add_marker(pytest.mark.xfail(reason=KNOWN_FAILING[item.nodeid], strict=False))
        for group, prefixes in GROUPS.items() if grouped else ():
            if item.nodeid.startswith(prefixes):
                item.add_marker(pytest.mark.xdist_group(group))


def _selects_gpu(markexpr: str) -> bool:
    return "gpu" in markexpr.replace("not gpu", "")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """``-n auto --dist loadgroup`` unless told otherwise (see the module's docstring). Runs
    before pytest-xdist's own hook of the same name, which reads these options."""
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    option = config.option
    if option.numprocesses is not None or option.dist != "no" or option.tx:
        return  # the command line chose
    if _selects_gpu(option.markexpr or "") or config.getoption("usepdb", False):
        return
    option.numprocesses = "auto"
    option.dist = "loadgroup"
