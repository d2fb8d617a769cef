"""check_sandbox.py --bisect: which part of the unit's sandbox stops the driver's checkpoint.
The plan and its reading (deploy/systemd/sandbox_bisect.py, pure) against made-up outcomes, the
capabilities the unit grants, and the whole run against the stand-in driver with a unit whose
filter also denies connect (the stand-in's checkpoint commands travel over a Unix socket): the
bisect must name the filter, then that one call, and see the unit with it added pass."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
UNIT = SYSTEMD / "gpushare-scheduler.service"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SYSTEMD / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bisect = _load("sandbox_bisect")
check = _load("check_sandbox")


def context() -> object:
    data = json.loads(check.SYSCALLS.read_text())
    allowed = check.allowed_syscalls(check.unit_service(UNIT), data["groups"])
    return bisect.Context(bisect.denied_groups(data["groups"], allowed, set(data["x86_64"])))


def test_the_groups_tried_are_those_the_unit_denies_and_only_their_denied_calls() -> None:
    data = json.loads(check.SYSCALLS.read_text())
    allowed = check.allowed_syscalls(check.unit_service(UNIT), data["groups"])
    denied = context().denied  # type: ignore[attr-defined]
    # The debugging calls a checkpoint might make, the identity changes the unit takes away.
    assert {"ptrace", "pidfd_getfd", "perf_event_open"} <= set(denied["@debug"])
    assert "setresuid" in denied["@setuid"] and "add_key" in denied["@keyring"]
    # Supergroups are never tried whole; groups the unit allows (@resources) are not tried.
    assert "@system-service" not in denied and "@known" not in denied
    assert "@resources" not in denied and "@network-io" not in denied
    tried = {call for calls in denied.values() for call in calls}
    assert not tried & allowed, sorted(tried & allowed)
    # Every call the filter denies is tried through some group (x86_64's numbered ones).
    assert tried == set(data["x86_64"]) - allowed


def test_the_first_round_tries_each_part_alone_and_left_out_and_each_capability() -> None:
    ctx = context()
    first = bisect.plan_next(ctx, {})
    names = [p.name for p in first]
    assert len(names) == len(set(names))
    by = {p.name: p for p in first}
    parts = set(bisect.COMPONENTS)
    assert by["unit"].components == parts and by["none"].components == set()
    for c in parts:
        assert by[f"only:{c}"].components == {c}
        assert by[f"without:{c}"].components == parts - {c}
    spec = by["without:seccomp"].spec()
    assert spec == {"name": "without:seccomp", "uid": True, "keep_caps": [], "drop_caps": [],
                    "no_new_privs": True, "seccomp": False, "allow": [], "target": "own",
                    "checker_dumpable": True}  # fmt: skip
    assert by["without:caps"].spec()["keep_caps"] is None  # every capability kept
    for cap in bisect.CANDIDATE_CAPS:
        keep, but = by[f"other:keep:{cap}"].spec(), by[f"other:all-but:{cap}"].spec()
        assert (keep["keep_caps"], keep["target"], keep["seccomp"]) == ([cap], "other", False)
        assert (but["keep_caps"], but["drop_caps"]) == (None, [cap])
    assert by["legacy"].spec()["checker_dumpable"] is False
    assert by["legacy:target"].spec()["target"] == "legacy"
    assert by["detached:keep:CAP_SYS_PTRACE"].spec()["keep_caps"] == ["CAP_SYS_PTRACE"]
    # The drop-in's case: the whole unit plus CAP_SYS_PTRACE, another user's non-descendant.
    drop_in = by["ptrace-drop-in"].spec()
    assert (drop_in["target"], drop_in["keep_caps"]) == ("other-detached", ["CAP_SYS_PTRACE"])
    assert drop_in["seccomp"] and drop_in["uid"] and drop_in["no_new_privs"]


def run_plan(ctx: object, verdicts: dict[str, bool]) -> dict[str, bool | None]:
    """Play the plan to its end, each probe's outcome from ``verdicts`` (missing: refused)."""
    passed: dict[str, bool | None] = {}
    for _ in range(10):
        batch = bisect.plan_next(ctx, passed)
        if not batch:
            return passed
        passed |= {p.name: verdicts.get(p.name, False) for p in batch}
    raise AssertionError("the plan never ends")


def test_a_filter_to_blame_is_narrowed_to_a_group_then_a_call_then_checked_with_it_added() -> None:
    ctx = context()
    ok = {"none": True, "only:uid": True, "only:caps": True, "only:no_new_privs": True,
          "without:seccomp": True, "unit+@debug": True, "unit+@privileged": True,
          "unit+pidfd_getfd": True, "proposal:own": True}  # fmt: skip
    passed = run_plan(ctx, ok)
    assert {f"unit+{g}" for g in ctx.denied} <= set(passed)  # type: ignore[attr-defined]
    # The calls of the smallest group that helped, one at a time; not those of @privileged.
    assert {f"unit+{c}" for c in ctx.denied["@debug"]} <= set(passed)  # type: ignore[attr-defined]
    assert "unit+bpf" not in passed
    verdict = bisect.interpret(ctx, passed)
    assert verdict["culprits"] == ["seccomp"]
    assert verdict["syscall_groups_that_helped"] == ["@debug", "@privileged"]
    assert verdict["syscalls_needed"] == ["pidfd_getfd"]
    assert verdict["proposal_tested"] == {"proposal:own": True}
    assert verdict["unit_lines"] == ["SystemCallFilter=pidfd_getfd"]


def test_no_filter_probes_when_the_filter_is_not_to_blame() -> None:
    ctx = context()
    passed = run_plan(ctx, {"unit": True, "none": True, "without:seccomp": True})
    assert not [n for n in passed if n.startswith(("unit+", "proposal:"))]
    verdict = bisect.interpret(ctx, passed)
    assert verdict["own_user_checkpoint_under_unit"] is True and verdict["culprits"] == []
    assert verdict["unit_lines"] == [] and verdict["syscalls_needed"] == []


def test_capabilities_for_another_users_program_necessary_ones_granted_together() -> None:
    ctx = context()
    ok = {"unit": True, "none": True, "other:all-caps": True, "proposal:other": True}
    # Leaving out either of two capabilities fails: both are needed, and tried together.
    ok |= {f"other:all-but:{c}": True for c in bisect.CANDIDATE_CAPS
           if c not in ("CAP_SYS_PTRACE", "CAP_DAC_OVERRIDE")}  # fmt: skip
    passed = run_plan(ctx, ok)
    verdict = bisect.interpret(ctx, passed)
    other = verdict["other_user"]
    assert other["necessary"] == ["CAP_SYS_PTRACE", "CAP_DAC_OVERRIDE"]
    assert other["sufficient"] == [] and other["needed"] == other["necessary"]
    assert verdict["proposal_tested"] == {"proposal:other": True}
    # Not the unit's own business (the agents checkpoint other users' kernels): the drop-in's.
    assert verdict["unit_lines"] == []
    assert verdict["drop_in_lines"] == [
        "CapabilityBoundingSet=CAP_SYS_PTRACE CAP_DAC_OVERRIDE",
        "AmbientCapabilities=CAP_SYS_PTRACE CAP_DAC_OVERRIDE",
    ]
    # One capability alone enough: that one is granted.
    passed = run_plan(ctx, {"unit": True, "other:keep:CAP_SYS_PTRACE": True})
    assert bisect.interpret(ctx, passed)["other_user"]["needed"] == ["CAP_SYS_PTRACE"]


def test_capabilities_to_blame_for_the_own_users_program_are_kept_one_at_a_time() -> None:
    ctx = context()
    ok = {"none": True, "without:caps": True, "unit+keep:CAP_CHECKPOINT_RESTORE": True,
          "proposal:own": True}  # fmt: skip
    passed = run_plan(ctx, ok)
    assert {f"unit+keep:{c}" for c in bisect.CANDIDATE_CAPS} <= set(passed)
    assert not [n for n in passed if n.startswith("unit+@")]  # the filter is not to blame
    assert bisect.plan_next(ctx, {k: v for k, v in passed.items() if k != "proposal:own"}) == [
        bisect.probe("proposal:own", bisect.UNIT, keep_caps=("CAP_CHECKPOINT_RESTORE",))
    ]
    verdict = bisect.interpret(ctx, passed)
    assert verdict["culprits"] == ["caps"] and verdict["proposal_tested"] == {"proposal:own": True}
    assert verdict["unit_lines"] == ["CapabilityBoundingSet=CAP_CHECKPOINT_RESTORE",
                                     "AmbientCapabilities=CAP_CHECKPOINT_RESTORE"]  # fmt: skip


def test_a_failure_of_the_old_target_alone_is_put_down_to_the_check() -> None:
    ctx = context()
    passed = run_plan(ctx, {"unit": True, "none": True, "legacy:checker": True})
    verdict = bisect.interpret(ctx, passed)
    assert verdict["legacy_target_as_at_2bfe97e"] is False
    assert any("2bfe97e was the check's own" in f and "(target)" in f
               for f in verdict["findings"]), verdict["findings"]  # fmt: skip
    # Everything refused, even with no sandbox: not the sandbox.
    verdict = bisect.interpret(ctx, run_plan(ctx, {}))
    assert verdict["culprits"] == [] and verdict["findings"] == [
        "the checkpoint fails even with no sandbox: not the sandbox's doing"
    ]


def test_capability_names_and_what_the_unit_grants() -> None:
    assert bisect.capability_numbers("CAP_SYS_PTRACE CAP_CHECKPOINT_RESTORE") == {19, 40}
    assert bisect.capability_numbers(["CAP_SYS_ADMIN", "CAP_DAC_OVERRIDE"]) == {21, 1}
    with pytest.raises(ValueError, match="CAP_NOPE"):
        bisect.capability_numbers("CAP_NOPE")
    assert check.unit_capabilities(check.unit_service(UNIT)) == set()
    svc = {"CapabilityBoundingSet": ["CAP_SYS_PTRACE CAP_KILL"],
           "AmbientCapabilities": ["CAP_SYS_PTRACE", "CAP_SYS_ADMIN"]}  # fmt: skip
    assert check.unit_capabilities(svc) == {19}  # ambient within the bounding set
    assert check.unit_capabilities({"AmbientCapabilities": ["CAP_KILL", ""]}) == set()


@pytest.mark.skipif(os.uname().machine != "x86_64" or os.geteuid() != 0,
                    reason="--bisect changes uid and capabilities: root, x86_64")  # fmt: skip
def test_the_bisect_finds_the_one_call_a_stricter_filter_takes_from_the_stand_in(
    native_build: object, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # The probes run as other uids: the stand-in's sockets go where every user may write.
    ckpt = Path(tempfile.mkdtemp(prefix="gpushare-bisect-"))
    ckpt.chmod(0o1777)
    request.addfinalizer(lambda: shutil.rmtree(ckpt, ignore_errors=True))
    fake = native_build.fake_dir  # type: ignore[attr-defined]
    env = {**os.environ, "LD_LIBRARY_PATH": str(fake), "GPUSHARE_FAKE_CHECKPOINT_DIR": str(ckpt)}
    stricter = tmp_path / UNIT.name
    deny_connect = "SystemCallFilter=~connect\nSystemCallErrorNumber="
    stricter.write_text(UNIT.read_text().replace("SystemCallErrorNumber=", deny_connect))
    argv = [sys.executable, str(SYSTEMD / "check_sandbox.py"), "--bisect", "--jobs=4",
            "--budget=400", f"--unit-file={stricter}"]  # fmt: skip
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    probes = {name: p["ok"] for name, p in report["probes"].items()}
    assert probes["unit"] is False and probes["none"] is True, report["probes"]["unit"]
    assert probes["without:seccomp"] is True and probes["unit+@network-io"] is True
    verdict = report["verdict"]
    assert verdict["culprits"] == ["seccomp"], verdict
    assert verdict["syscalls_needed"] == ["connect"]
    assert verdict["proposal_tested"] == {"proposal:own": True}
    # The stand-in lets only the same uid (or root) in: another user's program stays refused.
    assert verdict["other_user"]["under_unit"] is False
    assert report["probes"]["unit"]["error"].startswith("cuCheckpointProcessLock returned")


@pytest.mark.skipif(os.geteuid() != 0, reason="the programs change uid: root")
def test_the_check_program_is_dumpable_as_a_kernel_is_and_the_one_of_2bfe97e_was_not(
    native_build: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that changed uid without exec is not dumpable: its /proc/PID/fd belongs to root
    and only CAP_SYS_PTRACE may inspect it. The check's program must be inspectable by its own
    user, as a kernel started by exec is; the legacy one (the bisect's probe) must not."""
    monkeypatch.setenv("LD_LIBRARY_PATH", str(native_build.fake_dir))  # type: ignore[attr-defined]
    owners = {}
    for kind in ("own", "legacy"):
        tgt, pid, said = check.spawn_target(kind, 65534, mib=1)
        try:
            assert pid, said
            owners[kind] = os.stat(f"/proc/{pid}/fd").st_uid
        finally:
            tgt.kill()
            tgt.wait()
    assert owners == {"own": 65534, "legacy": 0}
