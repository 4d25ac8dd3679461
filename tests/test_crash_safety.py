"""Crash safety, for real: `coldsnap capture` and `coldsnap restore` (reference engine on CPU, real CRIU) are
SIGKILLed at each phase — synchronised on their own progress lines and journal, not on sleeps — and then the host
must be as if they had never run, once the next command looked: no process, network namespace, veth or temp file
left, the store valid, a --leave-running workload serving (its engine resumed itself when its capturer died), and
the next capture and restore succeed. Plus a capture onto a full disk (a 40 MiB tmpfs store): exit 12, one line,
a receipt, nothing partial, the --leave-running workload untouched."""

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import CRIU_PREFIX, needs_root_criu

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "coldsnap.cli"]


FOREIGN_VETHS: set[str] = set()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    needs_root_criu()
    root = tmp_path_factory.mktemp("crash")
    env = {**os.environ, "COLDSNAP_HOME": str(root / "home"), "COLDSNAP_RUN": str(root / "run"),
           "COLDSNAP_CRIU_PREFIX": CRIU_PREFIX}
    env.pop("COLDSNAP_STORE", None)
    FOREIGN_VETHS.update(ln for ln in links() if ln.startswith("csh"))  # another ColdSnap's on this host
    yield root, env
    subprocess.run([*CLI, "status"], env=env, capture_output=True, timeout=300)  # recovery, whatever a case left
    for ws in json.loads(_run(env, "status", "--json").stdout or '{"workloads": []}')["workloads"]:
        subprocess.run([*CLI, "stop", ws["name"]], env=env, capture_output=True, timeout=120)


def _run(env, *args, timeout=900, **kw):
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout, **kw)


def journals(root: Path) -> list[dict]:
    ops = root / "run" / "ops"
    out = []
    for p in sorted(ops.glob("*.json")) if ops.is_dir() else []:
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


def kill_when(env, args, seen) -> tuple[subprocess.Popen, str]:
    """Start `coldsnap ARGS`, SIGKILL it once seen(stderr so far) is true; returns it and what it printed."""
    proc = subprocess.Popen([*CLI, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    fd = proc.stderr.fileno()
    text = ""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.01)[0]:
            text += os.read(fd, 1 << 16).decode(errors="replace")
        if seen(text):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return proc, text
        if proc.poll() is not None:
            raise AssertionError(f"coldsnap {' '.join(args)} ended before the kill point: {text[-2000:]}")
    proc.kill()
    raise AssertionError(f"never reached the kill point: {text[-2000:]}")


def journaled_pid(root: Path, kind: str):
    """seen(): true once an operation of this kind has journaled a workload with its PID (it is running)."""
    def seen(_text: str) -> bool:
        return any(j["kind"] == kind and any(t.get("kind") == "workload" and t.get("pid") for t in j["things"])
                   for j in journals(root))
    return seen


def line(fragment: str):
    return lambda text: fragment in text


def netns_list() -> set[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()}


def links() -> set[str]:
    r = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True)
    return {ln.split(":")[1].strip().split("@")[0] for ln in r.stdout.splitlines()}


def serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def assert_host_clean(root: Path, env, keep: set[str] = frozenset()):
    """After the next command looked: only the workloads in keep exist, and nothing else of ours does."""
    status = json.loads(_run(env, "status", "--json").stdout)
    names = {w["name"] for w in status["workloads"]}
    assert names == set(keep), status
    assert journals(root) == [], journals(root)
    ours = {n for n in netns_list() if n.startswith("coldsnap-crash")}
    assert ours == {f"coldsnap-{k}" for k in keep}, ours
    for w in status["workloads"]:
        assert w["state"] == "active" and serving(w["url"]), w
    kept_veths = {json.loads((root / "run" / "workloads" / k / "state.json").read_text())["network"]["host_veth"]
                  for k in keep}
    assert {ln for ln in links() if ln.startswith("csh")} - FOREIGN_VETHS <= kept_veths  # no veth of ours left
    capture_work = root / "run" / "capture"
    assert not capture_work.exists() or list(capture_work.iterdir()) == []
    tmp = root / "home" / "store" / "tmp"
    assert not tmp.exists() or [p for p in tmp.iterdir() if not p.name.endswith(".lock")] == []
    staged = root / "home" / "staged"
    assert not staged.exists() or [p.name for p in staged.iterdir() if ".tmp" in p.name] == []
    # the store is valid: every indexed capsule loads and verifies
    for row in json.loads(_run(env, "ls", "--json").stdout)["capsules"]:
        assert _run(env, "restore", "--capsule", row["digest"], "--prepare-only").returncode == 0, row
    return status


CAPTURE = ["capture", "--engine-opt", "compile=false"]


@pytest.mark.parametrize("leave_running", [False, True], ids=["stopped", "leave-running"])
@pytest.mark.parametrize("phase", ["cold-start", "dump", "pack"])
def test_a_capture_killed_at_any_phase_leaves_nothing_or_a_serving_workload(home, phase, leave_running):
    root, env = home
    name = f"crash-{phase}-{int(leave_running)}"
    args = [*CAPTURE, "--name", name, *(["--leave-running"] if leave_running else [])]
    point = {"cold-start": journaled_pid(root, "capture"), "dump": line("dumping with CRIU"),
             "pack": line("packing the capsule")}[phase]
    kill_when(env, args, point)
    kept = leave_running and phase != "cold-start"  # a workload that was serving before the capture touched it
    if kept and phase == "dump":
        # the engine resumes itself: its capturer let its lease go by dying, before any command looked
        url = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and url is None:
            url = next((f"http://{t['host']}:{t['port']}" for j in journals(root) for t in j["things"]
                        if t.get("kind") == "released"), None)
            time.sleep(0.05)
        assert url and _eventually(lambda: serving(url), 60), "the released engine did not resume itself"
    assert_host_clean(root, env, keep={name} if kept else set())
    if kept:
        assert _run(env, "stop", name).returncode == 0
        assert_host_clean(root, env)


def _eventually(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


@pytest.fixture(scope="module")
def capsule(home):
    root, env = home
    r = _run(env, *CAPTURE, "--name", "crash-src", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["result"]["capsule"]


@pytest.mark.parametrize("phase", ["staging", "criu", "validation"])
def test_a_restore_killed_before_its_validation_leaves_nothing_running(home, capsule, phase):
    root, env = home
    staged = root / "home" / "staged" / capsule.split(":")[1]
    if phase == "staging":
        subprocess.run(["rm", "-rf", str(staged)])

        def point(_text):
            return any(j["kind"] == "stage" for j in journals(root))
    else:
        point = {"criu": line("restoring with CRIU"), "validation": journaled_pid(root, "restore")}[phase]
    kill_when(env, ["restore", "--capsule", capsule, "--no-fallback"], point)
    assert_host_clean(root, env)


def test_after_the_kills_the_next_capture_and_restore_succeed(home, capsule):
    root, env = home
    r = _run(env, "restore", "--capsule", capsule, "--no-fallback", "--json")
    assert r.returncode == 0, r.stderr
    receipt = json.loads(r.stdout)
    assert receipt["state"] == "succeeded"
    assert _run(env, "stop", receipt["result"]["workload"]).returncode == 0
    assert_host_clean(root, env)


def test_a_capture_onto_a_full_disk_is_an_environment_error_and_leaves_the_workload_serving(home, tmp_path):
    root, env = home
    store = tmp_path / "small-store"
    store.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m,mode=0700", "tmpfs", str(store)], check=True)
    try:
        r = _run({**env, "COLDSNAP_STORE": str(store)}, *CAPTURE, "--name", "crash-full", "--leave-running",
                 "--engine-opt", "layers=4", "--engine-opt", "hidden=512")
        assert r.returncode == 12, r.stderr
        err = r.stderr.strip().splitlines()[-1]
        assert err.startswith("coldsnap: error: environment: no space left") and str(store) in err and "MiB" in err
        receipts = sorted((root / "home" / "receipts").glob("capture-*.json"), key=os.path.getmtime)
        receipt = json.loads(receipts[-1].read_text())
        assert receipt["state"] == "failed" and receipt["error"]["code"] == "environment"
        df = os.statvfs(store)
        used = (df.f_blocks - df.f_bfree) * df.f_frsize
        assert used < 1 << 20, f"{used} bytes left in the full store"  # nothing partial stays
        status = json.loads(_run(env, "status", "--json").stdout)
        mine = [w for w in status["workloads"] if w["name"] == "crash-full"]
        assert mine and serving(mine[0]["url"])
    finally:
        _run(env, "stop", "crash-full")
        subprocess.run(["umount", str(store)])
    assert_host_clean(root, env)


def test_an_engine_that_dies_during_a_capture_is_named_as_the_cause(home):
    """The engine killed once it is validated: the capture fails as workload-failed (exit 9), says the engine died
    and what its log last said (the log goes with the workload's directory), and leaves nothing behind."""
    root, env = home
    proc = subprocess.Popen([*CLI, *CAPTURE, "--name", "crash-dies"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    pid = None
    while pid is None and time.monotonic() < deadline and proc.poll() is None:
        validated = [j for j in journals(root) if j["kind"] == "capture"
                     and any(t.get("kind") == "validated" for t in j["things"])]
        pid = next((t["pid"] for j in validated for t in j["things"] if t.get("kind") == "workload"), None)
        time.sleep(0.005)
    assert pid, "the capture never validated its engine"
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 9, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("coldsnap: error: workload-failed: ") and "; the engine died" in last, last
    assert "unshare:" not in last  # the launcher's complaint about the kill is not the engine's last words
    assert_host_clean(root, env)
