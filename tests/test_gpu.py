"""coldsnap.gpu: the process-tree walk and the CUDA checkpoint binding.

The procfs parts run here on real processes; the CUDA calls run against a stand-in libcuda here and against the
real driver on a GPU machine (tests marked `gpu`, skipped with the reason when the API is unavailable).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.gpu import nvml
from coldsnap.gpu.cuda_checkpoint import (
    CUcheckpointRestoreArgs,
    CudaCheckpointAPI,
    error_name,
    format_cuda_error,
    parse_gpu_uuid,
)
from coldsnap.gpu.tree import (
    NO_CUDA,
    checkpoint_tree,
    cuda_pids,
    describe_foreign,
    foreign_nvidia_mappings,
    maps_nvidia,
    process_tree,
    read_cmdline,
    read_maps,
    restore_tree,
)

# ---- a real process tree ------------------------------------------------------------------------------------

TREE_SCRIPT = textwrap.dedent(
    """
    import json, subprocess, sys, threading, time
    a = subprocess.Popen(["sleep", "300"])
    box = {}
    def from_thread():  # a child forked by a non-main thread is listed under that thread's task
        box["p"] = subprocess.Popen(["sleep", "301"])
        box["p"].wait()
    threading.Thread(target=from_thread, daemon=True).start()
    sh = subprocess.Popen(["sh", "-c", "sleep 302 & wait"])
    while "p" not in box:
        time.sleep(0.01)
    print(json.dumps({"a": a.pid, "t": box["p"].pid, "sh": sh.pid}), flush=True)
    time.sleep(300)
    """
)


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def tree():
    root = subprocess.Popen([sys.executable, "-c", TREE_SCRIPT], stdout=subprocess.PIPE, text=True)
    info = json.loads(root.stdout.readline())
    pids = [root.pid]
    try:
        deadline = time.monotonic() + 10
        while len(pids) < 5 and time.monotonic() < deadline:  # wait for sh to fork its sleep
            pids = process_tree(root.pid)
            time.sleep(0.02)
        info["root"] = root.pid
        info["all"] = pids
        yield info
    finally:
        _kill(reversed(process_tree(root.pid)))
        root.wait()


def test_process_tree_finds_every_descendant_parents_first(tree):
    pids = process_tree(tree["root"])
    assert pids[0] == tree["root"]
    assert len(pids) == 5
    assert {tree["a"], tree["t"], tree["sh"]} <= set(pids)
    grandchild = (set(pids) - {tree["root"], tree["a"], tree["t"], tree["sh"]}).pop()
    assert pids.index(tree["sh"]) < pids.index(grandchild)
    assert read_cmdline(grandchild) == "sleep 302"


def test_process_tree_of_a_vanished_pid_is_just_that_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    assert process_tree(p.pid) == [p.pid]


def test_cuda_pids_keeps_tree_order_and_uses_the_predicate(tree):
    wanted = {tree["t"], tree["root"]}
    assert cuda_pids(tree["root"], is_cuda=lambda p: p in wanted, interval_s=0) == [tree["root"], tree["t"]]


def test_cuda_pids_rescans_until_two_scans_agree(tree):
    scans = []

    def is_cuda(pid):
        if pid == tree["root"]:
            scans.append(1)
        # a CUDA client appears during the first scans (a worker initialising CUDA), then the set settles
        return pid == tree["root"] or (pid == tree["a"] and len(scans) >= 2)

    assert cuda_pids(tree["root"], is_cuda=is_cuda, interval_s=0) == [tree["root"], tree["a"]]
    assert len(scans) == 3


def test_cuda_pids_refuses_a_set_that_never_settles(tree):
    flip = iter(range(1000))
    with pytest.raises(ColdSnapError) as e:
        cuda_pids(tree["root"], is_cuda=lambda p: p == tree["root"] and next(flip) % 2 == 0, max_scans=4, interval_s=0)
    assert e.value.code is ErrorCode.GPU_FAILED
    assert "kept changing" in e.value.message


def test_without_the_checkpoint_api_a_tree_has_no_cuda_processes(tree):
    api = CudaCheckpointAPI(lib_path="/nonexistent/libcuda.so.1")
    assert not api.available()
    assert "cannot load /nonexistent/libcuda.so.1" in api.unavailable_reason()
    assert cuda_pids(tree["root"], api) == []
    report = checkpoint_tree(tree["root"], api=api)
    assert report.pids == [] and report.message == NO_CUDA
    assert restore_tree([], api=api).message == NO_CUDA
    with pytest.raises(ColdSnapError) as e:
        api.lock(tree["root"])
    assert e.value.code is ErrorCode.ENVIRONMENT


def test_real_maps_of_a_cpu_tree_have_no_nvidia_mappings(tree):
    assert read_maps(tree["root"])  # readable
    assert foreign_nvidia_mappings(tree["root"], []) == []


# ---- foreign /dev/nvidia mappings ---------------------------------------------------------------------------

NV_CTL = "7f3a2c000000-7f3a2c001000 rw-s 00000000 00:05 1031 /dev/nvidiactl\n"
NV_UVM = "7f3a2d000000-7f3a2d200000 rw-s 00000000 00:05 1040 /dev/nvidia-uvm\n"
NV_DEV = "200000000-200200000 rw-s 00000000 00:05 1032 /dev/nvidia0 (deleted)\n"
LIBC = "7f3a2e000000-7f3a2e028000 r--p 00000000 fd:01 4213 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
ANON = "7ffd1c000000-7ffd1c021000 rw-p 00000000 00:00 0\n"
LOOKALIKE = "7f3a2f000000-7f3a2f001000 r--p 00000000 fd:01 99 /home/u/dev/nvidia0\n"


def test_maps_nvidia_matches_device_paths_only():
    assert maps_nvidia([LIBC, NV_CTL])
    assert maps_nvidia([NV_UVM]) and maps_nvidia([NV_DEV])
    assert not maps_nvidia([LIBC, ANON, LOOKALIKE])
    assert not maps_nvidia([])


def test_foreign_mappings_name_non_cuda_processes_that_map_nvidia():
    children = {1: [2, 3], 2: [4], 3: [], 4: []}
    maps = {1: [LIBC, NV_CTL, NV_DEV], 2: [LIBC, NV_CTL, NV_UVM], 3: [LIBC, ANON], 4: [NV_DEV]}
    cmd = {1: "python -m server", 2: "python worker.py", 3: "sleep 1", 4: "python -c fork"}
    foreign = foreign_nvidia_mappings(
        1, [1], children=lambda p: children[p], maps=lambda p: maps[p], cmdline=lambda p: cmd[p]
    )
    assert foreign == [(2, "python worker.py"), (4, "python -c fork")]
    text = describe_foreign(foreign)
    assert "pid 2 (python worker.py)" in text and "pid 4 (python -c fork)" in text
    assert "non-regular mapping" in text
    # every nvidia user a CUDA client: nothing foreign
    assert foreign_nvidia_mappings(1, [1, 2, 4], children=lambda p: children[p], maps=lambda p: maps[p],
                                   cmdline=lambda p: cmd[p]) == []


# ---- the binding against a stand-in libcuda -----------------------------------------------------------------

class FakeLibcuda:
    """Just enough of libcuda: records calls, returns configured codes, writes through byref() out-parameters."""

    NAMES = {801: b"CUDA_ERROR_NOT_SUPPORTED", 401: b"CUDA_ERROR_ILLEGAL_STATE"}

    def __init__(self, codes=None, driver=13000, state=0):
        self.codes = codes or {}
        self.calls = []
        self.driver = driver
        self.state_value = state
        self.restore_args = None
        self.lock_args = None

    def cuInit(self, flags):
        return 0

    def cuDriverGetVersion(self, out):
        out._obj.value = self.driver
        return 0

    def cuGetErrorName(self, code, out):
        if code not in self.NAMES:
            return 1
        out._obj.value = self.NAMES[code]
        return 0

    def _rc(self, name, pid):
        self.calls.append((name, pid))
        return self.codes.get((name, pid), self.codes.get(name, 0))

    def cuCheckpointProcessGetRestoreThreadId(self, pid, out):
        out._obj.value = pid + 1
        return self._rc("tid", pid)

    def cuCheckpointProcessGetState(self, pid, out):
        out._obj.value = self.state_value
        return self._rc("state", pid)

    def cuCheckpointProcessLock(self, pid, args):
        self.lock_args = args._obj
        return self._rc("lock", pid)

    def cuCheckpointProcessCheckpoint(self, pid, args):
        return self._rc("checkpoint", pid)

    def cuCheckpointProcessRestore(self, pid, args):
        self.restore_args = args._obj if args is not None else None
        return self._rc("restore", pid)

    def cuCheckpointProcessUnlock(self, pid, args):
        return self._rc("unlock", pid)


def test_error_message_format():
    assert (
        format_cuda_error("cuCheckpointProcessRestore", 123, 801, "CUDA_ERROR_NOT_SUPPORTED")
        == "cuCheckpointProcessRestore(pid 123): CUDA_ERROR_NOT_SUPPORTED (801)"
    )
    assert error_name(801) == "CUDA_ERROR_NOT_SUPPORTED"  # without a driver: our table
    assert error_name(12345) == "CUDA_ERROR_12345"


def test_failing_call_raises_gpu_failed_with_the_drivers_error_name():
    api = CudaCheckpointAPI(lib=FakeLibcuda(codes={"restore": 801, "checkpoint": 401, "unlock": 77}))
    assert api.available()
    with pytest.raises(ColdSnapError) as e:
        api.restore(123)
    assert e.value.code is ErrorCode.GPU_FAILED
    assert e.value.message == "cuCheckpointProcessRestore(pid 123): CUDA_ERROR_NOT_SUPPORTED (801)"
    with pytest.raises(ColdSnapError,
                       match=r"cuCheckpointProcessCheckpoint\(pid 9\): CUDA_ERROR_ILLEGAL_STATE \(401\)"):
        api.checkpoint(9)
    with pytest.raises(ColdSnapError, match=r"cuCheckpointProcessUnlock\(pid 9\): CUDA_ERROR_77 \(77\)"):
        api.unlock(9)


def test_queries_and_lock_args():
    lib = FakeLibcuda(state=2)
    api = CudaCheckpointAPI(lib=lib)
    assert api.state(5) == "checkpointed"
    assert api.restore_thread_id(5) == 6
    assert api.is_cuda_process(5)
    lib.codes["tid"] = 1
    assert not api.is_cuda_process(5)
    assert api.driver_version() == 13000 and api.driver_version_text() == "13.0"
    api.lock(5, timeout_ms=1234)
    assert lib.lock_args.timeoutMs == 1234
    assert lib.lock_args.reserved0 == 0 and list(lib.lock_args.reserved1) == [0] * 7


def test_restore_with_gpu_pairs_fills_a_zeroed_struct():
    assert ctypes.sizeof(CUcheckpointRestoreArgs) == 64
    lib = FakeLibcuda(driver=13000)
    api = CudaCheckpointAPI(lib=lib)
    old = "GPU-8d0a62a0-1b2c-3d4e-5f60-718293a4b5c6"
    new = "GPU-00112233-4455-6677-8899-aabbccddeeff"
    api.restore(7, gpu_pairs=[(old, new)])
    a = lib.restore_args
    assert a.gpuPairsCount == 1
    assert bytes(a.gpuPairs[0].oldUuid.bytes) == bytes.fromhex("8d0a62a01b2c3d4e5f60718293a4b5c6")
    assert bytes(a.gpuPairs[0].newUuid.bytes) == bytes.fromhex("00112233445566778899aabbccddeeff")
    assert set(a.reserved) <= {0} and a.reserved1 == 0
    api.restore(7)  # no pairs: NULL args
    assert lib.restore_args is None


def test_restore_with_gpu_pairs_on_an_old_driver_is_refused_clearly():
    api = CudaCheckpointAPI(lib=FakeLibcuda(driver=12080))
    with pytest.raises(ColdSnapError) as e:
        api.restore(7, gpu_pairs=[("GPU-" + "0" * 32, "GPU-" + "1" * 32)])
    assert e.value.code is ErrorCode.INCOMPATIBLE
    assert "UUID remapping" in e.value.message and "CUDA 12.8" in e.value.message


def test_restore_with_gpu_pairs_the_driver_rejects_names_the_remapping():
    api = CudaCheckpointAPI(lib=FakeLibcuda(codes={"restore": 801}))
    with pytest.raises(ColdSnapError, match=r"CUDA_ERROR_NOT_SUPPORTED \(801\) \[with 1 GPU UUID remapping pair"):
        api.restore(7, gpu_pairs=[(bytes(16), bytes(range(16)))])


def test_parse_gpu_uuid():
    assert parse_gpu_uuid("GPU-8d0a62a0-1b2c-3d4e-5f60-718293a4b5c6").hex() == "8d0a62a01b2c3d4e5f60718293a4b5c6"
    assert parse_gpu_uuid("8d0a62a01b2c3d4e5f60718293a4b5c6") == bytes.fromhex("8d0a62a01b2c3d4e5f60718293a4b5c6")
    for bad in ("GPU-123", "MIG-zz", b"short"):
        with pytest.raises(ColdSnapError):
            parse_gpu_uuid(bad)


# ---- tree operations against a stand-in API -----------------------------------------------------------------

class FakeAPI:
    """A CUDA driver in miniature: per-pid states and transitions, with injectable failures."""

    def __init__(self, pids, fail=None):
        self.states = {p: "running" for p in pids}
        self.fail = fail or {}
        self.log = []

    def _step(self, op, pid, before, after):
        self.log.append((op, pid))
        if (op, pid) in self.fail:
            raise ColdSnapError(ErrorCode.GPU_FAILED, f"cuCheckpointProcess{op.title()}(pid {pid}): CUDA_ERROR_X (1)")
        assert self.states[pid] == before, f"{op} on {pid} in state {self.states[pid]}"
        self.states[pid] = after

    def state(self, pid):
        return self.states[pid]

    def lock(self, pid, timeout_ms=30000):
        self._step("lock", pid, "running", "locked")

    def checkpoint(self, pid):
        self._step("checkpoint", pid, "locked", "checkpointed")

    def restore(self, pid, gpu_pairs=None):
        self._step("restore", pid, "checkpointed", "locked")

    def unlock(self, pid):
        self._step("unlock", pid, "locked", "running")


def test_checkpoint_tree_locks_all_then_checkpoints_all():
    api = FakeAPI([10, 11, 12])
    report = checkpoint_tree(1, api=api, pids=[10, 11, 12])
    assert [op for op, _ in api.log] == ["lock"] * 3 + ["checkpoint"] * 3
    assert set(api.states.values()) == {"checkpointed"}
    assert report.pids == [10, 11, 12]
    assert set(report.seconds) == {"discover", "lock", "checkpoint"}
    assert set(report.per_pid[11]) == {"lock", "checkpoint"}
    d = report.to_dict()
    assert d["operation"] == "checkpoint" and json.dumps(d)

    report = restore_tree([10, 11, 12], api=api)
    assert [op for op, _ in api.log[6:]] == ["restore"] * 3 + ["unlock"] * 3
    assert set(api.states.values()) == {"running"}
    assert set(report.seconds) == {"restore", "unlock"}


def test_checkpoint_failure_rolls_back_so_the_workload_keeps_running():
    api = FakeAPI([10, 11, 12], fail={("checkpoint", 11)})
    with pytest.raises(ColdSnapError) as e:
        checkpoint_tree(1, api=api, pids=[10, 11, 12])
    assert e.value.code is ErrorCode.GPU_FAILED
    assert "pid 11" in e.value.message and "rolled back: 3 process(es) running again" in e.value.message
    assert set(api.states.values()) == {"running"}


def test_lock_failure_rolls_back_the_locked_ones():
    api = FakeAPI([10, 11, 12], fail={("lock", 11)})
    with pytest.raises(ColdSnapError, match="rolled back"):
        checkpoint_tree(1, api=api, pids=[10, 11, 12])
    assert set(api.states.values()) == {"running"}
    # The ranks are locked side by side: whichever got locked is unlocked again, and nothing was checkpointed.
    locked = {pid for op, pid in api.log if op == "lock" and pid != 11}
    assert locked <= {pid for op, pid in api.log if op == "unlock"}
    assert not [op for op, _ in api.log if op == "checkpoint"]


def test_rollback_problems_are_reported():
    api = FakeAPI([10, 11], fail={("checkpoint", 11), ("restore", 10)})
    with pytest.raises(ColdSnapError, match=r"rollback left problems: pid 10: .*Restore"):
        checkpoint_tree(1, api=api, pids=[10, 11])


def test_restore_tree_is_safe_to_retry():
    api = FakeAPI([10, 11])
    checkpoint_tree(1, api=api, pids=[10, 11])
    api.fail = {("restore", 11)}
    with pytest.raises(ColdSnapError, match="pid 11"):
        restore_tree([10, 11], api=api)
    api.fail = {}
    restore_tree([10, 11], api=api)  # 10 only unlocked, 11 restored and unlocked
    assert set(api.states.values()) == {"running"}
    assert api.log.count(("restore", 10)) == 1


def test_nvml_without_a_driver_reports_no_gpus():
    report = nvml.discover()  # never raises
    if report.error:
        assert report.gpus == [] and report.driver_version is None
    assert nvml.cuda_version_text(13000) == "13.0" and nvml.cuda_version_text(12090) == "12.9"


# ---- on a GPU: the real driver, a real torch process --------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    n = 1 << 20
    x = torch.arange(n, device="cuda", dtype=torch.float32) * 3
    torch.cuda.synchronize()
    want = 3 * n * (n - 1) // 2
    forked = 0
    if "--fork" in sys.argv:  # a child forked after CUDA init: inherits /dev/nvidia mappings, no CUDA state
        forked = os.fork()
        if forked == 0:
            time.sleep(600)
            os._exit(0)
    print("READY", forked, flush=True)
    for line in sys.stdin:
        got = int(x.double().sum().item())
        print("OK" if got == want else f"BAD {got} != {want}", flush=True)
    """
)


@pytest.fixture
def cuda_api():
    api = CudaCheckpointAPI()
    if not api.available():
        pytest.skip(f"no NVIDIA GPU with the CUDA checkpoint API: {api.unavailable_reason()}")
    return api


@pytest.fixture
def torch_python(cuda_api):
    python = os.environ.get("COLDSNAP_TEST_PYTHON", "python3")
    probe = subprocess.run([python, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"{python} has no torch with CUDA (set COLDSNAP_TEST_PYTHON)")
    return python


class TorchChild:
    def __init__(self, python, *args):
        self.p = subprocess.Popen([python, "-c", CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True,
                                  env={**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"})
        line = self.p.stdout.readline().split()
        assert line and line[0] == "READY", f"child failed to start: {line}"
        self.pid = self.p.pid
        self.forked = int(line[1])

    def value_ok(self) -> str:
        self.p.stdin.write("check\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self):
        _kill([p for p in (self.forked, self.pid) if p])
        self.p.wait()


@pytest.fixture
def torch_child(torch_python):
    child = TorchChild(torch_python)
    yield child
    child.close()


@pytest.mark.gpu
def test_gpu_lock_and_unlock(cuda_api, torch_child):
    pid = torch_child.pid
    assert cuda_api.state(pid) == "running"
    assert cuda_api.restore_thread_id(pid) > 0
    cuda_api.lock(pid, 10000)
    assert cuda_api.state(pid) == "locked"
    cuda_api.unlock(pid)
    assert cuda_api.state(pid) == "running"
    assert torch_child.value_ok() == "OK"


@pytest.mark.gpu
def test_gpu_checkpoint_of_a_running_process_is_a_formatted_error(cuda_api, torch_child):
    pid = torch_child.pid
    with pytest.raises(ColdSnapError) as e:
        cuda_api.checkpoint(pid)  # must be locked first
    assert e.value.code is ErrorCode.GPU_FAILED
    assert e.value.message.startswith(f"cuCheckpointProcessCheckpoint(pid {pid}): CUDA_ERROR_")
    assert cuda_api.state(pid) == "running"
    assert torch_child.value_ok() == "OK"


@pytest.mark.gpu
def test_gpu_checkpoint_and_restore_a_torch_process(cuda_api, torch_child):
    pid = torch_child.pid
    assert cuda_pids(pid, cuda_api) == [pid]
    assert foreign_nvidia_mappings(pid, [pid]) == []
    report = checkpoint_tree(pid, api=cuda_api)
    assert report.pids == [pid]
    assert cuda_api.state(pid) == "checkpointed"
    assert not maps_nvidia(read_maps(pid)), "GPU state moved to host memory: no /dev/nvidia mappings left"
    report = restore_tree([pid], api=cuda_api)
    assert report.pids == [pid] and report.seconds["restore"] > 0
    assert cuda_api.state(pid) == "running"
    assert torch_child.value_ok() == "OK"


@pytest.mark.gpu
def test_gpu_direct_calls_lock_checkpoint_restore_unlock(cuda_api, torch_child):
    pid = torch_child.pid
    cuda_api.lock(pid)
    cuda_api.checkpoint(pid)
    assert cuda_api.state(pid) == "checkpointed"
    cuda_api.restore(pid)
    assert cuda_api.state(pid) == "locked"
    cuda_api.unlock(pid)
    assert cuda_api.state(pid) == "running"
    assert torch_child.value_ok() == "OK"


@pytest.mark.gpu
def test_gpu_forked_child_with_inherited_mappings_is_foreign(cuda_api, torch_python):
    child = TorchChild(torch_python, "--fork")
    try:
        assert child.forked > 0
        assert cuda_pids(child.pid, cuda_api) == [child.pid]
        foreign = foreign_nvidia_mappings(child.pid, [child.pid])
        assert [pid for pid, _ in foreign] == [child.forked]
        assert "--fork" in foreign[0][1]
    finally:
        child.close()


def test_stack_limit_is_left_alone_without_a_current_cuda_context():
    """set_stack_limit (an engine's release sheds the CUDA stack reserve) answers None, changing nothing, where no
    CUDA context is current: no libcuda here, or this test process never made one."""
    from coldsnap.gpu.libcuda import set_stack_limit

    assert set_stack_limit(0) is None
