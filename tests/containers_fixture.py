"""Containers of the tests' own making: a rootfs that borrows the host's /usr (read-only), the repository and its
Python (read-only, at the same paths, so the same interpreter and venv run inside), a pre-made network namespace
with lo up, and OCI bundles over them. Plus the helpers that install and start what the container tests need
(packaging/containers/setup.sh) on private paths."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "packaging" / "containers" / "setup.sh"
VENV = Path(sys.prefix)
PYTHON_HOME = Path(sys.base_prefix)  # where the venv's interpreter really lives (pyenv, /usr, ...)
# COLDSNAP_TEST_RUNTIME (the GPU machine runs the repository through wrappers), else beside this interpreter (the
# venv), else on PATH.
RUNTIME = Path(os.environ.get("COLDSNAP_TEST_RUNTIME") or (
    VENV / "bin" / "coldsnap-runtime" if (VENV / "bin" / "coldsnap-runtime").exists()
    else shutil.which("coldsnap-runtime") or VENV / "bin" / "coldsnap-runtime"))
HOOK = RUNTIME.with_name("coldsnap-hook")
CRIU = os.environ.get("COLDSNAP_CRIU_PREFIX", "/var/lib/coldsnap/criu") + "/bin/criu"

ENGINE_PORT = 8000
ENGINE_ARGS = [str(VENV / "bin" / "python"), "-m", "coldsnap_reference.server",
               "--weights", "/models/reference.safetensors", "--host", "0.0.0.0", "--port", str(ENGINE_PORT),
               "--device", "cpu", "--no-compile", "--layers", "2", "--hidden", "64", "--heads", "2",
               "--kv-mib", "4", "--threads", "1", "--weights-load", "copy", "--warmup-tokens", "2"]


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: runc, CRIU and namespaces")
    if not os.access(CRIU, os.X_OK):
        pytest.skip(f"CRIU not provisioned at {CRIU}: run `make setup`")


def ensure(*parts: str) -> None:
    """Install what is missing via packaging/containers/setup.sh (idempotent)."""
    r = subprocess.run([str(SETUP), "install", *parts], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"{SETUP} install {' '.join(parts)} failed: {(r.stderr or r.stdout).strip()[-800:]}")


def make_rootfs(root: Path) -> Path:
    from coldsnap_bench.rootfs import host_usr_rootfs

    return host_usr_rootfs(root)


def _bind(src: Path | str, dest: Path | str | None = None, ro: bool = True) -> dict:
    return {"destination": str(dest or src), "type": "bind", "source": str(src),
            "options": ["rbind", "ro" if ro else "rw"]}


def host_binds(src: Path | str) -> list[dict]:
    """A host directory read-only at the same path, as ColdSnap binds one (its submounts each on their own, or CRIU
    fails on the GPU machine's /usr/local/nvidia)."""
    from coldsnap.oci.spec import host_bind

    return host_bind(str(src), str(src))


def shared_binds() -> list[dict]:
    """Host /usr, the repository (with its venv) and the interpreter's home, read-only at the same paths."""
    binds = [*host_binds("/usr"), _bind(REPO)]
    if not str(VENV).startswith(str(REPO) + "/"):
        binds.append(_bind(VENV))
    if not str(PYTHON_HOME).startswith("/usr"):
        binds.append(_bind(PYTHON_HOME))
    return binds


BASE_SPEC = {
    "ociVersion": "1.0.2-dev",
    "process": {
        "terminal": False, "user": {"uid": 0, "gid": 0}, "args": ["/bin/sh"],
        "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "TMPDIR=/tmp",
                "PYTHONDONTWRITEBYTECODE=1"],
        "cwd": "/",
        "capabilities": {k: ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
                         for k in ("bounding", "effective", "permitted", "ambient")},
        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
        "noNewPrivileges": True,
    },
    "root": {"path": "rootfs", "readonly": False},
    "hostname": "coldsnap-test",
    "mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
    ],
    "linux": {
        "resources": {"devices": [{"allow": False, "access": "rwm"}]},
        "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
        "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
                        "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
        "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
    },
    "x-coldsnap-test": {"unknown": ["fields", "are", "kept"]},  # a field no runtime knows: must survive our writes
}


def make_bundle(path: Path, rootfs: Path, args: list[str], netns: str | None = None,
                annotations: dict[str, str] | None = None, extra_mounts: list[dict] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    spec = copy.deepcopy(BASE_SPEC)
    spec["root"]["path"] = str(rootfs)
    spec["process"]["args"] = list(args)
    spec["mounts"] += shared_binds() + list(extra_mounts or [])
    ns = {"type": "network"}
    if netns:
        ns["path"] = f"/var/run/netns/{netns}"
    spec["linux"]["namespaces"].append(ns)
    if annotations:
        spec["annotations"] = dict(annotations)
    (path / "config.json").write_text(json.dumps(spec, indent=1))
    return path


class NetNS:
    """A named network namespace with lo up (runc restores a netns it created itself with lo down). Made by
    ColdSnap's own coldsnap.net.netns: no iproute2 needed (the GPU machine has none)."""

    def __init__(self, prefix: str = "cstest"):
        from coldsnap.net.netns import create_namespace, namespace_route

        self.name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        create_namespace(self.name)
        try:
            with namespace_route(self.name) as ns:
                ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        except BaseException:
            self.delete()  # a half-made namespace would outlive the test
            raise

    def delete(self) -> None:
        from pyroute2 import netns

        try:
            netns.remove(self.name)
        except OSError:
            pass


class VethNetNS:
    """A network namespace joined to the host by a veth pair (host side `host_address`, container side `address`),
    made by ColdSnap's own coldsnap.net in a free workload slot: clients on the host reach the container directly,
    from outside its namespace, the way a pod's clients do. It outlives the containers that join it, as a pod's
    does."""

    def __init__(self, prefix: str = "cseng"):
        from coldsnap.net import allocate_plan, create_network

        self.plan = allocate_plan(f"{prefix}-{uuid.uuid4().hex[:8]}", 8000)
        create_network(self.plan)
        self.name, self.host_veth = self.plan.netns, self.plan.host_veth
        self.host_address, self.address = self.plan.host_address, self.plan.workload_address

    def delete(self) -> None:
        from coldsnap.net import destroy_network

        destroy_network(self.plan)


def make_engine_bundle(path: Path, rootfs: Path, launch, netns: str, annotations: dict[str, str] | None = None,
                       shm_size: str = "1g") -> Path:
    """A bundle whose process is an engine adapter's container launch (prepare_container): the host's /usr as
    the image, the launch's own read-only binds (engine venv, its interpreter, the model, ColdSnap's prefix),
    private tmpfs for /tmp, $HOME and /dev/shm (CRIU carries their contents in its images, so a restore needs
    nothing the rootfs kept), and a pre-made network namespace."""
    from coldsnap.oci.spec import apply_launch

    path.mkdir(parents=True, exist_ok=True)
    spec = copy.deepcopy(BASE_SPEC)
    spec["root"]["path"] = str(rootfs)
    spec["mounts"] = [m for m in spec["mounts"] if m["destination"] != "/dev/shm"] + [
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "nodev", "mode=1777", f"size={shm_size}"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]},
        {"destination": "/root", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=700"]},
        *host_binds("/usr")]
    apply_launch(spec, launch.argv, launch.env, launch.cwd, launch.mounts)
    spec["linux"]["namespaces"].append({"type": "network", "path": f"/var/run/netns/{netns}"})
    if annotations:
        spec["annotations"] = dict(annotations)
    (path / "config.json").write_text(json.dumps(spec, indent=1))
    return path


def engine_launch(engine: str):
    """An engine adapter's container launch (prepare_container) of the fixture model, its venv built if missing."""
    from test_engine_sglang import SGLANG_VENV
    from test_engine_vllm import FIXTURE_MODEL, VLLM_VENV, ensure_engine

    from coldsnap.contracts import CaptureRequest
    from coldsnap.engines import get_adapter

    options = {"vllm": {"venv": VLLM_VENV, "model": FIXTURE_MODEL, "enforce_eager": True, "max_model_len": 2048},
               "sglang": {"venv": SGLANG_VENV, "model": FIXTURE_MODEL}}[engine]
    ensure_engine(engine, options["venv"])
    return get_adapter(engine).prepare_container(CaptureRequest(operation="capture", engine={
        "name": engine, "options": options}))


def launch_binds(launch) -> list[dict]:
    """The spec mounts of an engine launch: the host's /usr (the image) and the launch's own binds, each with its
    host submounts; options end in "ro" or "rw"."""
    from coldsnap.oci.spec import host_bind

    return [*host_binds("/usr")] + [m for b in launch.mounts for m in host_bind(b.source, b.target, b.readonly)]


def launch_run_args(launch) -> list[str]:
    """`run` options (podman's and docker's) for an engine launch, as a user would write them: the launch's
    read-only binds, its environment and working directory, private tmpfs for /tmp and $HOME, a 1 GiB /dev/shm
    (vLLM's queues)."""
    volumes = [a for m in launch_binds(launch) for a in ("-v", f"{m['source']}:{m['destination']}:{m['options'][-1]}")]
    env = [a for k, v in launch.env.items() for a in ("-e", f"{k}={v}")]
    return ["--shm-size", "1g", "--tmpfs", "/tmp:rw,mode=1777", "--tmpfs", "/root:rw,mode=700", "-e", "HOME=/root",
            *env, *(["-w", launch.cwd] if launch.cwd else []), *volumes]


def completions_in(pid: int, model: str, port: int = ENGINE_PORT) -> list[str]:
    """test_engine_vllm.completions (its 10 greedy prompts) from inside the network namespace of pid: for containers
    on a network of their own (docker's `--network none`), which the host cannot reach."""
    code = ("import json, sys; from test_engine_vllm import completions; "
            "print(json.dumps(completions('127.0.0.1', int(sys.argv[1]), sys.argv[2])))")
    tests = str(Path(__file__).parent)
    r = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", sys.executable, "-c", code, str(port), model],
                       capture_output=True, text=True, timeout=900, cwd=tests,
                       env={**os.environ, "PYTHONPATH": tests})
    assert r.returncode == 0, r.stderr[-1500:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def runc(root: Path, *args: str, check: bool = False, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["runc", "--root", str(root), *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, check=check, **kw)


def unique(prefix: str) -> str:
    """Container ids must be unique on the host, not just per runc root: runc's default cgroup path is the id."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def run_detached(binary: str, root: Path, bundle: Path, cid: str) -> subprocess.CompletedProcess:
    """`runc run -d` with /dev/null stdio: the container inherits it (a pipe would never reach EOF, and CRIU
    cannot restore a host file as a container's stdio). runc's own errors go to --log; .stderr carries them."""
    log = root.parent / f"{cid}.run.log"
    with open(os.devnull, "r+b") as null:
        r = subprocess.run([binary, "--root", str(root), "--log", str(log), "run", "-d", "--bundle", str(bundle), cid],
                           stdin=null, stdout=null, stderr=null)
    r.stderr = log.read_text() if log.exists() else ""
    return r


def state(root: Path, cid: str) -> dict | None:
    r = runc(root, "state", cid)
    return json.loads(r.stdout) if r.returncode == 0 else None




def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def netns_http(netns: str, path: str, port: int = ENGINE_PORT, timeout: float = 5.0) -> tuple[int, str]:
    """GET http://127.0.0.1:port/path from inside a named netns (curl via `ip netns exec`)."""
    r = subprocess.run(["ip", "netns", "exec", netns, "curl", "-s", "-m", str(timeout), "-o", "-",
                        "-w", "\n%{http_code}", f"http://127.0.0.1:{port}{path}"], capture_output=True, text=True)
    body, _, code = r.stdout.rpartition("\n")
    return int(code or 0), body




def completion_in(pid: int, port: int = ENGINE_PORT) -> str:
    """A greedy completion from inside the network namespace of pid (nsenter + curl)."""
    r = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "curl", "-s", "-m", "60",
                        f"http://127.0.0.1:{port}/v1/completions",
                        "-d", json.dumps({"prompt": "ColdSnap says", "max_tokens": 16, "temperature": 0})],
                       capture_output=True, text=True)
    return json.loads(r.stdout)["choices"][0]["text"]


def healthy_at(address: str, port: int = ENGINE_PORT) -> bool:
    """/health answers 200 at address (a container's veth address, from the host)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{address}:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def healthy_in(pid: int, port: int = ENGINE_PORT) -> bool:
    r = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "curl", "-s", "-m", "2", "-o", "/dev/null",
                        "-w", "%{http_code}", f"http://127.0.0.1:{port}/health"], capture_output=True, text=True)
    return r.stdout.strip() == "200"


def env_wrapper(path: Path, env: dict[str, str], target: Path = RUNTIME) -> Path:
    """An executable that sets env and execs target. Engines start their runtime with an almost empty
    environment (podman/conmon: PWD and XDG_RUNTIME_DIR only), so a test's private ColdSnap paths travel this way
    (deployments use the defaults or /etc/coldsnap/runtime.json {"env": {...}})."""
    exports = " ".join(f"{k}={v}" for k, v in env.items())
    path.write_text(f"#!/bin/sh\nexport {exports}\nexec {target} \"$@\"\n")
    path.chmod(0o755)
    return path


def coldsnap_env(base: Path) -> dict[str, str]:
    return {"COLDSNAP_HOME": str(base / "home"), "COLDSNAP_RUN": str(base / "run"),
            "COLDSNAP_CRIU_PREFIX": str(Path(CRIU).parent.parent)}


def receipt(cid: str) -> dict:
    """The receipt the shim or its hook wrote for container cid (under the private home of private_coldsnap)."""
    from coldsnap.base.paths import settings

    return json.loads((settings().receipts / f"{cid}.json").read_text())


@contextlib.contextmanager
def module_lab(tmp_path_factory, name: str, make):
    """A module's container lab: root and the base packages, a fresh base directory, make(base) (an object with
    cleanup()), and a private ColdSnap home under base while the module runs; cleaned up at the end."""
    needs_root()
    ensure("base")
    base = tmp_path_factory.mktemp(name)
    lab = make(base)
    with private_coldsnap(base):
        try:
            yield lab
        finally:
            lab.cleanup()


@contextlib.contextmanager
def private_coldsnap(base: Path):
    """A private ColdSnap home and run dir under base for this process and what it starts (the shim, its hooks,
    capture_container, and a container engine started here, which passes its environment down to the runtime)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in coldsnap_env(base).items():
            mp.setenv(k, v)
        mp.delenv("COLDSNAP_STORE", raising=False)
        mp.delenv("COLDSNAP_RUNC", raising=False)
        yield mp


def oci_archive(rootfs: Path, out: Path, name: str, cmd: list[str] | None = None) -> Path:
    from coldsnap_bench.rootfs import oci_archive as make

    return make(rootfs, out, name, cmd)
