"""coldsnap.host.profile and coldsnap.host.doctor on this machine, plus their parsers on fixed inputs."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest

from coldsnap.base.paths import settings
from coldsnap.contracts import Capabilities, ColdSnapError, HostProfile
from coldsnap.host.capabilities import REPO_RESULTS, capabilities, qualifications
from coldsnap.host.doctor import (
    CAP_CHECKPOINT_RESTORE,
    CAP_SYS_ADMIN,
    CAP_SYS_RESOURCE,
    Check,
    cgroup_version,
    check_capabilities,
    doctor_json,
    effective_capabilities,
    render_table,
    run_doctor,
)
from coldsnap.host.profile import (
    criu_check,
    criu_version,
    host_profile,
    interpret_criu_check,
    parse_criu_version,
    read_cpuinfo,
    version_tuple,
)


def _expected_criu_version() -> str:
    stamp = settings().criu_prefix / "VERSION"  # written by packaging/criu/provision.sh
    return stamp.read_text().strip() if stamp.exists() else "4.2.1"


# ---- host ---------------------------------------------------------------------------------------------------

def test_host_profile_is_sane_here():
    p = host_profile(criu_version())
    assert isinstance(p, HostProfile)
    assert p.arch == platform.machine()
    assert p.kernel == os.uname().release
    assert p.cpu_model and p.cpu_model != "unknown"
    assert p.cpu_flags == sorted(set(p.cpu_flags))
    if p.arch == "x86_64":
        assert {"fpu", "sse2"} <= set(p.cpu_flags)
    assert p.criu_version == _expected_criu_version()
    if p.gpus:
        assert p.driver_version and p.cuda_version
        assert all(g.memory_mib > 0 and g.uuid.startswith("GPU-") for g in p.gpus)
    else:
        assert p.driver_version is None or isinstance(p.driver_version, str)
    HostProfile.model_validate_json(p.model_dump_json())


def test_read_cpuinfo_x86_and_arm():
    x86 = ("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx512f fpu\n\n"
           "processor\t: 1\nmodel name\t: AMD EPYC\n")
    assert read_cpuinfo(x86) == ("AMD EPYC", ["avx512f", "fpu", "sse2"])
    arm = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n"
    assert read_cpuinfo(arm) == ("implementer 0x41 part 0xd4f", ["asimd", "fp", "sve"])
    assert read_cpuinfo("") == ("unknown", [])


@pytest.mark.root
def test_criu_version_and_check_here():
    assert criu_version() == _expected_criu_version()
    assert version_tuple(criu_version()) >= (4, 2)
    ok, detail = criu_check()
    assert ok, detail
    assert detail == "Looks good."


def test_criu_parsers():
    assert parse_criu_version("Version: 4.2.1\nGitID: v4.2.1\n") == "4.2.1"
    assert parse_criu_version("criu: command not found") is None
    assert version_tuple("4.2.1") == (4, 2, 1) and version_tuple("4.2-rc1") == (4, 2) and version_tuple("x") == ()
    noise = "rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\nLooks good.\n"
    assert interpret_criu_check(0, noise) == (True, "Looks good.")
    vdso = "Error (criu/vdso.c:123): vdso: Unexpected rt vDSO area bounds"
    ok, detail = interpret_criu_check(1, noise.replace("Looks good.", vdso))
    assert not ok and "vDSO" in detail and "RLIMIT" not in detail
    assert interpret_criu_check(1, "Looks good.\n")[0] is False


def test_missing_criu_is_an_environment_error():
    with pytest.raises(ColdSnapError) as e:
        criu_version("/nonexistent/criu")
    assert "not found" in e.value.message
    assert criu_check("/nonexistent/criu")[0] is False


# ---- doctor -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checks():
    return run_doctor()


def _row(checks, name) -> Check:
    return next(c for c in checks if c.name == name)


@pytest.mark.root
def test_doctor_reports_criu_and_check_ok(checks):
    assert _row(checks, "criu version").status == "ok"
    assert _row(checks, "criu version").detail.startswith(_expected_criu_version())
    assert _row(checks, "criu check").status == "ok"


@pytest.mark.root
def test_doctor_pycriu_version_rpc_ok(checks):
    assert _row(checks, "pycriu import").status == "ok"
    row = _row(checks, "pycriu VERSION RPC")
    assert row.status == "ok", row.detail
    assert _expected_criu_version() in row.detail


@pytest.mark.root
def test_doctor_json_ok_here(checks):
    doc = doctor_json(checks)
    assert doc["ok"] is True, [c for c in doc["checks"] if c["status"] == "fail"]
    assert doc["criu"]["version"] == _expected_criu_version() and doc["criu"]["check"] == "ok"
    assert {"name", "status", "detail", "fix"} == set(doc["checks"][0])
    json.dumps(doc)


def test_doctor_rows_are_complete(checks):
    names = [c.name for c in checks]
    for expected in ("criu version", "criu check", "pycriu import", "pycriu VERSION RPC", "tool runc", "tool podman",
                     "tool containerd", "tool dockerd", "tool docker-registry", "tool crun", "cgroup", "CAP_SYS_ADMIN",
                     "CAP_CHECKPOINT_RESTORE", "CAP_SYS_RESOURCE", "kernel", "nvidia gpus", "cuda checkpoint api"):
        assert expected in names
    assert all(c.status in ("ok", "warn", "fail") for c in checks)
    assert all(c.fix for c in checks if c.status != "ok"), "every warning or failure says how to fix it"
    for c in checks:
        if c.name.startswith("tool ") and c.status == "warn" and "not installed" in c.detail:
            assert c.fix == "make setup-containers"
    gpu = _row(checks, "nvidia gpus")
    if gpu.status == "warn":
        assert "no GPU: CPU-only capture" in gpu.detail or "no GPU visible" in gpu.detail


def test_render_table_is_aligned_text():
    rows = [Check("a", "ok", "fine"), Check("longer name", "warn", "hmm", "do x"), Check("b", "fail", "bad", "do y")]
    text = render_table(rows)
    lines = text.splitlines()
    assert lines[0] == "OK    a            fine"
    assert lines[1] == "WARN  longer name  hmm"
    assert lines[2] == "                   fix: do x"
    assert lines[-1] == "NOT OK: 1 failed, 1 warning(s), 3 checks"
    assert doctor_json(rows)["ok"] is False
    assert doctor_json(rows[:2])["ok"] is True


def test_cgroup_version_from_mountinfo():
    v2 = "35 24 0:30 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw\n"
    hybrid = (
        "25 24 0:22 / /sys/fs/cgroup ro shared:5 - tmpfs tmpfs ro,mode=755\n"
        "26 25 0:23 / /sys/fs/cgroup/unified rw shared:6 - cgroup2 cgroup2 rw\n"
        "27 25 0:24 / /sys/fs/cgroup/memory rw shared:7 - cgroup cgroup rw,memory\n"
    )
    v1 = hybrid.replace("26 25 0:23 / /sys/fs/cgroup/unified rw shared:6 - cgroup2 cgroup2 rw\n", "")
    assert cgroup_version(v2) == "v2"
    assert cgroup_version(hybrid) == "hybrid"
    assert cgroup_version(v1) == "v1"
    assert cgroup_version("") == "none"
    assert cgroup_version() in ("v1", "v2", "hybrid", "none")


def test_capabilities_rows():
    assert effective_capabilities("Name:\tx\nCapEff:\t000001fffeffffff\n") == 0x1FFFEFFFFFF
    here = "CapEff:\t000001fffeffffff\n"  # root without CAP_SYS_RESOURCE, as on our VMs
    rows = {c.name: c for c in check_capabilities(effective_capabilities(here))}
    assert rows["CAP_SYS_ADMIN"].status == "ok" and rows["CAP_CHECKPOINT_RESTORE"].status == "ok"
    assert rows["CAP_SYS_RESOURCE"].status == "warn" and "harmless" in rows["CAP_SYS_RESOURCE"].detail
    none = {c.name: c for c in check_capabilities(0)}
    assert none["CAP_SYS_ADMIN"].status == "fail" and none["CAP_CHECKPOINT_RESTORE"].status == "fail"
    only_cr = {c.name: c for c in check_capabilities(1 << CAP_CHECKPOINT_RESTORE | 1 << CAP_SYS_RESOURCE)}
    assert only_cr["CAP_CHECKPOINT_RESTORE"].status == "ok" and only_cr["CAP_SYS_RESOURCE"].status == "ok"
    assert {CAP_SYS_ADMIN, CAP_SYS_RESOURCE, CAP_CHECKPOINT_RESTORE} == {21, 24, 40}


def test_capabilities_document():
    caps = capabilities()
    doc = json.loads(caps.model_dump_json())
    assert Capabilities.model_validate(doc) == caps
    assert doc["kind"] == "coldsnap.capabilities"
    assert doc["request_formats"] == doc["receipt_formats"] == doc["capsule_formats"] == [1]
    assert doc["operations"] == ["capture", "restore", "prepare", "sleep", "wake", "status", "stop"]
    assert doc["engines"] == ["reference", "vllm", "sglang"]
    assert doc["snapshot_drivers"] == ["criu-process", "criu-runc", "criu-template"]
    assert doc["weights_modes"] == ["native", "recovery", "auto"]
    # Every claim comes from a result file of the checkout, and every bench result there makes one.
    assert doc["results"] == str(REPO_RESULTS)
    evidence = [q["evidence"] for q in doc["qualified"]]
    assert evidence and all((REPO_RESULTS.parents[1] / e).is_file() for e in evidence)
    benches = {str(p.relative_to(REPO_RESULTS.parents[1])) for p in REPO_RESULTS.rglob("*.json")
               if json.loads(p.read_text()).get("kind") == "coldsnap.bench"}
    assert benches and benches <= set(evidence)


def test_a_claim_says_what_its_result_file_measured(tmp_path):
    assert qualifications(tmp_path) == []  # no result files, no claims
    (tmp_path / "x.json").write_text(json.dumps({
        "kind": "coldsnap.bench", "engine": "reference", "device": "cpu", "weights_mode": "recovery",
        "vanilla": {"median_s": 12.5}, "restore": {"median_s": 0.25}, "validations": {"restore": "7/8"},
        "fell_back": 1, "physical_limit": {"limit_s": 0.2}, "page_cache": "warm",
        "host": {"cpu_model": "AMD EPYC", "criu": "4.2.1", "gpus": []}}))
    (tmp_path / "y.receipts.json").write_text(json.dumps({"command": "gpu-bench.sh sleepwake", "receipts": [
        {"operation": "sleep", "state": "succeeded"}, {"operation": "wake", "state": "failed"}]}))
    (tmp_path / "z.json").write_text("[not a result]")
    got = {q.evidence: q.claim for q in qualifications(tmp_path)}
    assert set(got) == {str(tmp_path / "x.json"), str(tmp_path / "y.receipts.json")}
    x = got[str(tmp_path / "x.json")]
    assert "0.25 s median vs vanilla 12.5 s" in x and "7/8 restores validated, 1 fell back" in x
    assert "1.25x the same-run physical limit" in x and "AMD EPYC" in x
    assert got[str(tmp_path / "y.receipts.json")] == "sleep 1/1 succeeded, wake 0/1 succeeded (gpu-bench.sh sleepwake)"


def test_paths_exist():
    assert Path(settings().criu).exists()
