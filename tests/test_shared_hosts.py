"""Shared hosts, for real (reference engine, real CRIU): restores that do not care which PIDs the host uses, 20
restore/stop cycles in a row, 4 restores of one capsule at once (each its own name, network namespace and
addresses), a restore refused because its workload runs (touching nothing of it), and two captures of one name
under two homes at once, each pinning its own weights.

Each case runs on the CPU (here and in CI) and on a GPU (cuda: the reference workload in recovery mode, on the GPU
machine: packaging/device/shared-hosts.sh; elsewhere it skips, saying why)."""

import concurrent.futures
import json
import os
import subprocess
import sys
import urllib.request

import pytest
from conftest import CRIU_PREFIX, needs_root_criu

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "coldsnap.cli"]
# cuda: COLDSNAP_TEST_CUDA_SIZE, engine options (default a 2.4 GiB workload; the 15 GiB one: layers=6 hidden=6144
# heads=48 kv_mib=4096)
CUDA_SIZE = os.environ.get("COLDSNAP_TEST_CUDA_SIZE", "layers=4 hidden=2048 heads=16 kv_mib=1024").split()
CAPTURE = {"cpu": ["capture", "--engine-opt", "compile=false"],
           "cuda": ["capture", "--device", "cuda", "--weights-mode", "recovery",
                    *(a for opt in CUDA_SIZE for a in ("--engine-opt", opt))]}


def needs_device(device: str) -> None:
    if device == "cuda":
        from coldsnap.gpu.cuda_checkpoint import CudaCheckpointAPI

        api = CudaCheckpointAPI()
        if not api.available():
            pytest.skip(f"no NVIDIA GPU with the CUDA checkpoint API here ({api.unavailable_reason()}); "
                        f"runs on the GPU machine: packaging/device/shared-hosts.sh")


def home_env(root):
    env = {**os.environ, "COLDSNAP_HOME": str(root / "home"), "COLDSNAP_RUN": str(root / "run"),
           "COLDSNAP_CRIU_PREFIX": CRIU_PREFIX}
    env.pop("COLDSNAP_STORE", None)
    return env


def cli(env, *args, timeout=900):
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


def serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def netns() -> set[str]:
    return set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()  # what `ip netns list` lists


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def host(request, tmp_path_factory):
    needs_root_criu()
    needs_device(request.param)
    root = tmp_path_factory.mktemp("shared")
    env = home_env(root)
    r = cli(env, *CAPTURE[request.param], "--name", "shared-src", "--json")
    assert r.returncode == 0, r.stderr
    capsule = json.loads(r.stdout)["result"]["capsule"]
    yield env, capsule, json.loads(r.stdout)
    for w in json.loads(cli(env, "status", "--json").stdout)["workloads"]:
        cli(env, "stop", w["name"])


def restored(env, capsule, *extra) -> dict:
    r = cli(env, "restore", "--capsule", capsule, "--no-fallback", "--json", *extra)
    assert r.returncode == 0, r.stderr
    receipt = json.loads(r.stdout)
    assert receipt["state"] == "succeeded", receipt
    return receipt


def test_a_restore_does_not_care_which_host_pids_are_taken(host):
    env, capsule, captured = host
    # hold, in the host PID namespace, the PIDs the captured tree had (its root's and a few after it)
    taken = []
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(captured["result"]["pid"] - 1))
    for _ in range(4):
        taken.append(subprocess.Popen(["sleep", "300"]))
    held = captured["result"]["pid"]
    assert any(p.pid == held for p in taken) or os.path.exists(f"/proc/{held}")
    try:
        receipt = restored(env, capsule)
        assert cli(env, "stop", receipt["result"]["workload"]).returncode == 0
    finally:
        for p in taken:
            p.kill()
            p.wait()


def test_twenty_restore_stop_cycles(host):
    env, capsule, _ = host
    before = netns()
    for i in range(20):
        receipt = restored(env, capsule)
        stop = cli(env, "stop", receipt["result"]["workload"])
        assert stop.returncode == 0, f"cycle {i + 1}: {stop.stderr}"
    assert netns() == before  # nothing left behind


def test_four_restores_of_one_capsule_at_once(host):
    env, capsule, captured = host
    names = [f"shared-r{i}" for i in range(1, 5)]
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        receipts = list(pool.map(lambda n: restored(env, capsule, "--name", n), names))
    try:
        results = [r["result"] for r in receipts]
        assert [r["workload"] for r in results] == names
        assert len({r["url"] for r in results}) == 4  # an address of its own each
        assert all(r["validated_text"] == captured["result"]["validated_text"] for r in results)
        assert all(serving(r["url"]) for r in results)
        status = {w["name"]: w for w in json.loads(cli(env, "status", "--json").stdout)["workloads"]}
        assert set(names) <= set(status) and all(status[n]["state"] == "active" for n in names)
    finally:
        for n in names:
            assert cli(env, "stop", n).returncode == 0
    assert not any(ns.startswith("coldsnap-shared-r") for ns in netns())


def test_a_capsule_restores_while_a_replica_of_it_serves(host):
    env, capsule, captured = host
    serving_one = restored(env, capsule, "--name", "shared-serving")["result"]
    try:
        second = restored(env, capsule, "--name", "shared-second")["result"]
        try:
            assert second["validated_text"] == captured["result"]["validated_text"]
            assert second["url"] != serving_one["url"]
            assert serving(serving_one["url"]) and serving(second["url"])  # the first served throughout
        finally:
            assert cli(env, "stop", "shared-second").returncode == 0
        assert serving(serving_one["url"])  # stopping one replica leaves the other
    finally:
        assert cli(env, "stop", "shared-serving").returncode == 0


def test_a_restore_of_a_running_workload_is_refused_and_touches_nothing(host):
    env, capsule, _ = host
    first = restored(env, capsule)["result"]
    try:
        before = netns()
        r = cli(env, "restore", "--capsule", capsule, "--json")
        assert r.returncode == 6 and "is running" in r.stderr, r.stderr
        assert json.loads(r.stdout)["state"] == "failed"
        assert netns() == before and serving(first["url"])  # its network and the workload are untouched
    finally:
        cli(env, "stop", first["workload"])


def host_veths() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def engine_processes() -> set[int]:
    """PIDs of reference engines (restored or cold) on this host."""
    out = set()
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if b"coldsnap_reference.server" in f.read():
                    out.add(int(d))
        except (OSError, ValueError):
            continue
    return out


def exactly_one_won(env, runs, name: str, refused_with: tuple[str, ...]) -> dict:
    """Of two same-name runs, one succeeded and the other exited 6 with one line naming why, leaving nothing: the
    winner's receipt."""
    codes = sorted(r.returncode for r in runs)
    assert codes == [0, 6], [(r.returncode, r.stderr[-400:]) for r in runs]
    loser = next(r for r in runs if r.returncode == 6)
    errors = [line for line in loser.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and any(why in errors[0] for why in refused_with), loser.stderr
    assert json.loads(loser.stdout)["state"] == "failed"
    listed = [w for w in json.loads(cli(env, "status", "--json").stdout)["workloads"] if w["name"] == name]
    assert len(listed) == 1, listed
    return json.loads(next(r for r in runs if r.returncode == 0).stdout)


def test_two_restores_of_one_name_at_once_exactly_one_wins(host):
    env, capsule, _ = host
    before = (netns(), host_veths(), engine_processes())
    for i in range(10):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda _: cli(env, "restore", "--capsule", capsule, "--name", "shared-race",
                                               "--json"), range(2)))
        won = exactly_one_won(env, runs, "shared-race", ("is running", "is being made"))
        assert won["state"] == "succeeded" and serving(won["result"]["url"]), f"round {i + 1}"
        assert cli(env, "stop", "shared-race").returncode == 0
        assert (netns(), host_veths(), engine_processes()) == before, f"round {i + 1}: something was left"


def test_two_leave_running_captures_of_one_name_at_once_exactly_one_wins(host, request):
    env, _, _ = host
    device = request.node.callspec.params["host"]
    before = (netns(), host_veths(), engine_processes())
    for i in range(2):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda _: cli(env, *CAPTURE[device], "--name", "shared-cap", "--leave-running",
                                               "--json"), range(2)))
        won = exactly_one_won(env, runs, "shared-cap", ("is running", "is being made"))
        assert won["result"]["left_running"] and serving(
            next(w for w in json.loads(cli(env, "status", "--json").stdout)["workloads"]
                 if w["name"] == "shared-cap")["url"]), f"round {i + 1}"
        assert cli(env, "stop", "shared-cap").returncode == 0
        assert (netns(), host_veths(), engine_processes()) == before, f"round {i + 1}: something was left"


HOG = """
import sys, time, torch
need = int(sys.argv[1])
free, _ = torch.cuda.mem_get_info()
held = torch.empty(max(free - need // 2, 0), dtype=torch.uint8, device="cuda")
print("held", held.numel(), flush=True)
time.sleep(600)
"""


def test_a_restore_without_room_on_its_gpu_is_refused_and_makes_nothing(host):
    env, capsule, _ = host
    profile = json.loads(cli(env, "inspect", capsule).stdout)["profile"]
    if not profile["gpu_memory"]:
        pytest.skip("the captured workload held no GPU memory (a CPU workload): no GPU room to run out of")
    gpu, need = next(iter(profile["gpu_memory"].items()))
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(need)], env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu},
                           stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().startswith("held"), "the memory hog did not start"
        before = netns()
        r = cli(env, "restore", "--capsule", capsule, "--name", "shared-noroom", "--json")
        assert r.returncode == 6 and "GiB free" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # one line
        assert json.loads(r.stdout)["state"] == "failed"
        assert netns() == before  # nothing half-made
        names = {w["name"] for w in json.loads(cli(env, "status", "--json").stdout)["workloads"]}
        assert "shared-noroom" not in names
    finally:
        hog.kill()
        hog.wait()


def test_two_captures_of_one_name_under_two_homes_at_once(tmp_path):
    needs_root_criu()
    homes = [tmp_path / "a", tmp_path / "b"]

    def capture(root):
        return cli(home_env(root), *CAPTURE["cpu"], "--name", "same-name", "--json")

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(capture, homes))
    assert all(r.returncode == 0 for r in results), [r.stderr[-500:] for r in results]
    for root, r in zip(homes, results):
        digest = json.loads(r.stdout)["result"]["capsule"]
        profile = json.loads(cli(home_env(root), "inspect", digest).stdout)["profile"]
        weights = profile["model"]["weights"][0]["path"]
        assert weights.startswith(str(root / "home")), weights  # its own weights, not the other job's
        r2 = cli(home_env(root), "restore", "--capsule", digest, "--no-fallback", "--json")
        assert r2.returncode == 0 and json.loads(r2.stdout)["state"] == "succeeded", r2.stderr
        cli(home_env(root), "stop", json.loads(r2.stdout)["result"]["workload"])
