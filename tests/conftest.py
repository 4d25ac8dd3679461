"""Shared fixtures. Tests that need root services start and stop them themselves."""

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

CRIU_PREFIX = os.environ.get("COLDSNAP_CRIU_PREFIX", "/var/lib/coldsnap/criu")


@pytest.fixture
def coldsnap_home(tmp_path, monkeypatch):
    """A private ColdSnap home/store/run for one test (the CRIU prefix stays the provisioned one)."""
    home = tmp_path / "home"
    monkeypatch.setenv("COLDSNAP_HOME", str(home))
    monkeypatch.setenv("COLDSNAP_RUN", str(tmp_path / "run"))
    monkeypatch.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
    monkeypatch.delenv("COLDSNAP_STORE", raising=False)
    return home


@pytest.fixture(scope="session", autouse=True)
def no_workload_outlives_the_suite(tmp_path_factory):
    """A test that fails midway can leave its workload behind (network namespace and engine), and the next run
    trips over them: the network namespaces this run made and left are emptied and removed at its end, with a
    warning that names them. Another suite may be running on this host beside this one, with workloads of its own:
    this run's are those whose processes write their log under its temporary directory, or that a journal or a
    workload's state there names."""
    if os.geteuid() != 0 or not os.path.isdir("/run/netns"):
        yield
        return
    before = set(_coldsnap_netns())
    yield
    from pyroute2 import netns

    from coldsnap.flows.recovery import kill_network_namespace

    base = tmp_path_factory.getbasetemp()
    left = [n for n in sorted(set(_coldsnap_netns()) - before) if _made_by_this_run(base, n)]
    for name in left:
        kill_network_namespace(name)
        netns.remove(name)
    if left:
        import warnings

        warnings.warn(f"removed network namespaces this run left behind: {', '.join(left)}", stacklevel=1)


def _made_by_this_run(base: Path, name: str) -> bool:
    from coldsnap.base.procfs import in_network_namespace
    from coldsnap.net import netns_inode

    try:
        pids = in_network_namespace(netns_inode(name))
    except OSError:
        pids = []
    for pid in pids:
        for fd in ("0", "1", "2"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{base}/"):
                    return True
            except OSError:
                continue
    for path in base.rglob("*.json"):  # a failed test's directory stays, with its journals and workload states
        if path.parent.name == "ops" or path.name == "state.json":
            try:
                if f'"{name}"' in path.read_text(errors="replace"):
                    return True
            except OSError:
                continue
    return False


def _coldsnap_netns() -> list[str]:
    return [n for n in os.listdir("/run/netns") if n.startswith("coldsnap-")] if os.path.isdir("/run/netns") else []


def kill_and_reap(*pids) -> None:
    """SIGKILL each pid given (None skipped) and reap it when it is our child; gone already is fine."""
    import signal

    for pid in pids:
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def needs_root_criu():
    if os.geteuid() != 0:
        pytest.skip("needs root: CRIU and namespaces")
    if not os.access(os.path.join(CRIU_PREFIX, "bin", "criu"), os.X_OK):
        pytest.skip(f"CRIU not provisioned at {CRIU_PREFIX}: run `make setup`")
    if shutil.which("nsenter") is None or shutil.which("unshare") is None:
        pytest.skip("util-linux nsenter/unshare missing")


def coldsnap_cli(tmp_path, *args: str, timeout: float = 1200):
    """`python -m coldsnap.cli ARGS` under a private home and run dir in tmp_path (as a user runs it, in a process
    of its own); the CompletedProcess, text mode."""
    import subprocess

    env = {**os.environ, "COLDSNAP_HOME": str(tmp_path / "home"), "COLDSNAP_RUN": str(tmp_path / "run"),
           "COLDSNAP_CRIU_PREFIX": CRIU_PREFIX}
    env.pop("COLDSNAP_STORE", None)
    return subprocess.run([sys.executable, "-m", "coldsnap.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_bench(tmp_path, name: str, *args: str) -> dict:
    """`coldsnap bench ARGS --out OUT --json` on CPU under a private home (compile off: the suite times nothing);
    its result, checked to be what it printed, with a chart beside it."""
    import json

    out = tmp_path / "out"
    r = coldsnap_cli(tmp_path, "bench", *args, "--engine-opt", "compile=false", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((out / f"{name}.json").read_text())
    assert data == json.loads(r.stdout) and (out / f"{name}.png").stat().st_size > 0
    return data
