"""`coldsnap doctor`: can this host capture and restore? One row per fact, each with a one-line fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError

Status = Literal["ok", "warn", "fail"]

CRIU_MIN = (4, 2)

CAP_SYS_ADMIN = 21
CAP_SYS_RESOURCE = 24
CAP_CHECKPOINT_RESTORE = 40

# Container tools, each asked for its `--version`.
CONTAINER_TOOLS = ("runc", "crun", "podman", "containerd", "dockerd", "docker-registry")
_EXTRA_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict, repr=False)  # machine-readable facts behind the row

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


# ---- CRIU ---------------------------------------------------------------------------------------------------
def check_criu(criu_binary: str | None = None) -> list[Check]:
    from coldsnap.host.profile import criu_check, criu_version, version_tuple

    binary = criu_binary or settings().criu
    fix = "make setup (packaging/criu/provision.sh), or set COLDSNAP_CRIU to a CRIU >= 4.2"
    try:
        version = criu_version(binary)
    except ColdSnapError as e:
        return [Check("criu version", "fail", e.message, fix, {"binary": binary, "version": None}),
                Check("criu check", "fail", "skipped: no working CRIU", fix, {"ok": False})]
    facts = {"binary": binary, "version": version}
    if version_tuple(version) >= CRIU_MIN:
        rows = [Check("criu version", "ok", f"{version} ({binary})", "", facts)]
    else:
        rows = [Check("criu version", "fail", f"{version} ({binary}): kernels >= 6.16 need CRIU >= 4.2 (older ones "
                      "fail on vDSO or sockets)", fix, facts)]
    ok, detail = criu_check(binary)
    rows.append(Check("criu check", "ok" if ok else "fail", detail,
                      "" if ok else f"run `{binary} check` as root and read its complaints", {"ok": ok}))
    return rows


def import_pycriu():
    """pycriu from sys.path, else from the CRIU prefix (where provisioning unpacks it). Returns (module, where)."""
    try:
        import pycriu  # type: ignore[import-not-found]

        return pycriu, os.path.dirname(os.path.dirname(pycriu.__file__))
    except ImportError:
        pass
    path = str(settings().pycriu_path)
    if os.path.isdir(os.path.join(path, "pycriu")) and path not in sys.path:
        sys.path.append(path)
    import pycriu  # type: ignore[import-not-found]  # raises ImportError when absent there too

    return pycriu, path


def pycriu_version_rpc(criu_binary: str | None = None) -> str:
    """Ask `criu swrk` for its version over pycriu's RPC. Returns '4.2.1'; raises on any failure."""
    pycriu, _ = import_pycriu()
    rpc = pycriu.rpc
    c = pycriu.criu()
    c.use_binary(criu_binary or settings().criu)
    with tempfile.TemporaryDirectory(prefix="coldsnap-doctor-") as d:
        fd = os.open(d, os.O_DIRECTORY | os.O_RDONLY)
        try:
            c.opts.images_dir_fd = fd  # CRIU 4.x rejects any RPC without an images dir fd
            req = rpc.criu_req()
            req.type = rpc.VERSION
            req.opts.MergeFrom(c.opts)
            resp = c._send_req_and_recv_resp(req)  # pycriu has no public VERSION call
        finally:
            os.close(fd)
    if not resp.success:
        raise RuntimeError(f"VERSION request failed (cr_errno {resp.cr_errno})")
    v = resp.version
    text = f"{v.major_number}.{v.minor_number}"
    if v.HasField("sublevel"):
        text += f".{v.sublevel}"
    return text


def check_pycriu(criu_binary: str | None = None, expected_version: str | None = None) -> list[Check]:
    fix = "put <criu prefix>/pycriu on PYTHONPATH (make setup installs a .pth) and pip install protobuf"
    try:
        pycriu, where = import_pycriu()
    except Exception as e:  # noqa: BLE001 - ImportError or a protobuf mismatch inside it
        return [Check("pycriu import", "fail", f"{type(e).__name__}: {e}", fix),
                Check("pycriu VERSION RPC", "fail", "skipped: pycriu not importable", fix)]
    rows = [Check("pycriu import", "ok", f"pycriu {getattr(pycriu, '__version__', '?')} from {where}")]
    try:
        version = pycriu_version_rpc(criu_binary)
    except Exception as e:  # noqa: BLE001
        rows.append(Check("pycriu VERSION RPC", "fail", f"criu swrk: {e}",
                          "check that `criu swrk` runs as root with this CRIU"))
    else:
        if expected_version and version != expected_version:
            rows.append(Check("pycriu VERSION RPC", "warn", f"swrk says {version}, `criu --version` says "
                              f"{expected_version}", "point COLDSNAP_CRIU and pycriu at the same CRIU",
                              {"version": version}))
        else:
            rows.append(Check("pycriu VERSION RPC", "ok", f"criu swrk answered {version}", "", {"version": version}))
    return rows


# ---- containers ---------------------------------------------------------------------------------------------
def _which(name: str) -> str | None:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(_EXTRA_PATH)
    return shutil.which(name, path=path)


def check_container_tools() -> list[Check]:
    rows = []
    for name in CONTAINER_TOOLS:
        path = _which(name)
        if not path:
            rows.append(Check(f"tool {name}", "warn", "not installed (container capture unavailable through it)",
                              "make setup-containers"))
            continue
        try:
            p = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=15,
                               stdin=subprocess.DEVNULL)
            first = ((p.stdout or "") + (p.stderr or "")).strip().splitlines()
            version = first[0].strip() if first else "?"
            status: Status = "ok" if p.returncode == 0 else "warn"
        except (OSError, subprocess.TimeoutExpired) as e:
            version, status = f"version query failed: {e}", "warn"
        rows.append(Check(f"tool {name}", status, f"{version} ({path})",
                          "" if status == "ok" else "make setup-containers"))
    return rows


# ---- kernel facts -------------------------------------------------------------------------------------------
def cgroup_version(mountinfo: str | None = None) -> str:
    """'v2' | 'hybrid' | 'v1' | 'none', from the cgroup mounts under /sys/fs/cgroup in /proc/self/mountinfo."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as f:
                mountinfo = f.read()
        except OSError:
            mountinfo = ""
    mounts: list[tuple[str, str]] = []  # (mount point, fs type)
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and len(fields) >= 5 and fields[4].startswith("/sys/fs/cgroup"):
            mounts.append((fields[4], (right.split() or [""])[0]))
    if ("/sys/fs/cgroup", "cgroup2") in mounts:
        return "v2"
    types = {t for _, t in mounts}
    if "cgroup" in types:
        return "hybrid" if "cgroup2" in types else "v1"
    return "v2" if "cgroup2" in types else "none"


def effective_capabilities(status_text: str | None = None) -> int:
    """The CapEff bit mask of this process (from /proc/self/status)."""
    if status_text is None:
        with open("/proc/self/status") as f:
            status_text = f.read()
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_cgroup() -> Check:
    v = cgroup_version()
    if v == "none":
        return Check("cgroup", "warn", "no cgroup filesystem under /sys/fs/cgroup", "mount cgroup2 on /sys/fs/cgroup",
                     {"version": v})
    return Check("cgroup", "ok", {"v2": "v2 (unified)", "hybrid": "hybrid (v1 controllers + v2 unified)",
                                  "v1": "v1"}[v], "", {"version": v})


def check_capabilities(cap_eff: int | None = None) -> list[Check]:
    caps = effective_capabilities() if cap_eff is None else cap_eff

    def row(name: str, bit: int, status: Status, detail: str, fix: str = "") -> Check:
        return Check(name, "ok", "held") if caps >> bit & 1 else Check(name, status, detail, fix)

    admin = row("CAP_SYS_ADMIN", CAP_SYS_ADMIN, "fail", "missing: CRIU dump/restore and namespaces need it",
                "run as root")
    if admin.status == "ok":
        restore = row("CAP_CHECKPOINT_RESTORE", CAP_CHECKPOINT_RESTORE, "ok",
                      "missing, not needed while CAP_SYS_ADMIN is held")
    else:
        restore = row("CAP_CHECKPOINT_RESTORE", CAP_CHECKPOINT_RESTORE, "fail", "missing (and no CAP_SYS_ADMIN)",
                      "run as root")
    resource = row("CAP_SYS_RESOURCE", CAP_SYS_RESOURCE, "warn", "missing: RLIMIT_NOFILE can't be raised above its "
                   "hard limit; CRIU's 'rlimit: Can't setup RLIMIT_NOFILE' message is harmless",
                   "none needed; give containers --ulimit nofile within the hard limit")
    return [admin, restore, resource]


def check_kernel() -> Check:
    u = os.uname()
    return Check("kernel", "ok", f"{u.release} ({u.machine})", "", {"release": u.release})


# ---- NVIDIA -------------------------------------------------------------------------------------------------
def check_nvidia() -> list[Check]:
    from coldsnap.gpu import nvml
    from coldsnap.gpu.cuda_checkpoint import CudaCheckpointAPI

    report = nvml.discover()
    if report.gpus:
        listed = ", ".join(f"{g.index}: {g.name} {g.memory_mib} MiB cc {g.compute_capability}" for g in report.gpus)
        rows = [Check("nvidia gpus", "ok", f"driver {report.driver_version}, CUDA {report.cuda_version}; {listed}", "",
                      {"driver": report.driver_version, "cuda": report.cuda_version, "count": len(report.gpus)})]
    elif report.driver_version:
        rows = [Check("nvidia gpus", "warn", f"driver {report.driver_version} but no GPU visible: CPU-only capture",
                      "check the device nodes / NVIDIA_VISIBLE_DEVICES")]
    else:
        rows = [Check("nvidia gpus", "warn", f"no GPU: CPU-only capture ({report.error})",
                      "none needed for CPU workloads; GPU capture needs an NVIDIA driver r570+")]
    api = CudaCheckpointAPI()
    if api.available():
        rows.append(Check("cuda checkpoint api", "ok",
                          f"{api.lib_path} exports cuCheckpointProcess* (CUDA {api.driver_version_text()})"))
    else:
        rows.append(Check("cuda checkpoint api", "fail" if report.gpus else "warn", str(api.unavailable_reason()),
                          "upgrade the NVIDIA driver to r570+" if report.gpus else "none needed for CPU workloads"))
    return rows


# ---- the doctor ---------------------------------------------------------------------------------------------
def _guard(name: str, fn: Callable[[], Check | list[Check]]) -> list[Check]:
    """A check that crashes is a failed row, never a crashed doctor."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001
        return [Check(name, "fail", f"check crashed: {type(e).__name__}: {e}", "report this as a ColdSnap bug")]
    return out if isinstance(out, list) else [out]


def run_doctor() -> list[Check]:
    criu = settings().criu
    checks = _guard("criu", lambda: check_criu(criu))
    version = next((c.data.get("version") for c in checks if c.name == "criu version"), None)
    checks += _guard("pycriu", lambda: check_pycriu(criu, version))
    for name, fn in (("containers", check_container_tools), ("cgroup", check_cgroup),
                     ("capabilities", check_capabilities), ("kernel", check_kernel), ("nvidia", check_nvidia)):
        checks += _guard(name, fn)
    return checks


def render_table(checks: list[Check]) -> str:
    """Aligned plain text: status, name, detail; a 'fix:' line under each row that isn't ok."""
    if not checks:
        return "(no checks)\n"
    name_w = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status.upper():<4}  {c.name:<{name_w}}  {c.detail}")
        if c.status != "ok" and c.fix:
            lines.append(f"{'':<4}  {'':<{name_w}}  fix: {c.fix}")
    n_fail = sum(c.status == "fail" for c in checks)
    n_warn = sum(c.status == "warn" for c in checks)
    lines += ["", f"{'OK' if not n_fail else 'NOT OK'}: {n_fail} failed, {n_warn} warning(s), {len(checks)} checks"]
    return "\n".join(lines) + "\n"


def doctor_json(checks: list[Check]) -> dict[str, Any]:
    """{"ok": no row failed, "checks": [...], "criu": {"binary", "version", "check"}}."""
    by_name = {c.name: c for c in checks}
    facts = by_name["criu version"].data if "criu version" in by_name else {}
    check_row = by_name.get("criu check")
    return {"ok": not any(c.status == "fail" for c in checks), "checks": [c.to_dict() for c in checks],
            "criu": {"binary": facts.get("binary"), "version": facts.get("version"),
                     "check": check_row.status if check_row else None}}


__all__ = ["Check", "doctor_json", "render_table", "run_doctor"]
