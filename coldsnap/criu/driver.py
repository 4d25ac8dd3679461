"""One CRIU driver for every entry point: pycriu over `criu swrk`, options from one table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from coldsnap.base.locks import locked
from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError, ErrorCode

NETNS_KEY = "coldsnap-netns"


def _pycriu():
    """Import pycriu, from the provisioned CRIU prefix if it is not on sys.path already."""
    try:
        import pycriu
    except ImportError:
        path = str(settings().pycriu_path)
        if path not in sys.path:
            sys.path.append(path)
        try:
            import pycriu
        except ImportError as e:
            raise ColdSnapError(ErrorCode.ENVIRONMENT, f"pycriu not importable ({e}); run `make setup` "
                                "(packaging/criu/provision.sh)") from None
    return pycriu


@dataclass
class CriuOptions:
    """The CRIU option set, derived once and recorded in the capsule and receipt so a failure can be replayed."""

    tcp_established: bool = True  # a connection racing the dump must not fail it
    ext_unix_sk: bool = True
    file_locks: bool = True
    link_remap: bool = True  # POSIX semaphores / files mapped under unlinked names
    shell_job: bool = False  # the workload's root is a session leader (setsid), so not needed
    ghost_limit_mib: int = 1024
    network_lock: str = "nftables"  # the GPU image has no iptables; libnftables ships in the CRIU prefix
    leave_running: bool = False
    log_level: int = 4
    external: list[str] = field(default_factory=list)
    # The tree has its own mount namespace, a private copy of the host's (coldsnap.workload.mountns): every mount
    # the host also has is external, bound back from the host at restore, under the host's root.
    host_mounts: bool = False
    # Restore only: memory comes back on demand (userfaultfd), the rest copied behind the running tree by CRIU's
    # lazy-pages daemon, so what follows CRIU (the CUDA driver's restore) starts before every page is in.
    lazy_pages: bool = False

    def cli_flags(self) -> list[str]:
        """The same options as `criu` command-line flags (for receipts and by-hand replay)."""
        switches = {"--tcp-established": self.tcp_established, "--ext-unix-sk": self.ext_unix_sk,
                    "--file-locks": self.file_locks, "--link-remap": self.link_remap, "--shell-job": self.shell_job,
                    "--leave-running": self.leave_running}
        flags = [flag for flag, on in switches.items() if on]
        flags += [f"--ghost-limit={self.ghost_limit_mib}M", f"--network-lock={self.network_lock}"]
        flags += [f"--external={e}" for e in self.external]
        if self.host_mounts:
            flags += ["--external=mnt[]", "--root=/"]
        if self.lazy_pages:
            flags.append("--lazy-pages")
        return flags

    def apply(self, opts, pycriu) -> None:
        opts.tcp_established = self.tcp_established
        opts.ext_unix_sk = self.ext_unix_sk
        opts.file_locks = self.file_locks
        opts.link_remap = self.link_remap
        opts.shell_job = self.shell_job
        opts.ghost_limit = self.ghost_limit_mib << 20
        locks = {"iptables": pycriu.rpc.IPTABLES, "nftables": pycriu.rpc.NFTABLES, "skip": pycriu.rpc.SKIP}
        opts.network_lock = locks[self.network_lock]
        opts.log_level = self.log_level
        if self.host_mounts:
            opts.external.append("mnt[]")  # auto-detect: a mount the host also has is external
            opts.root = "/"


def lazy_pages_wanted() -> bool:
    return settings().lazy_pages


class LazyPages:
    """CRIU's lazy-pages daemon for one restore. It listens in the restore's work dir before the restore starts,
    answers the restored tree's page faults and copies every other page behind it, then exits. Until it has exited
    cleanly the tree is not whole: a daemon that dies leaves missing pages that the kernel would fill with zeros, so a
    restore is reported ready only after finish()."""

    SOCKET = "lazy-pages.socket"
    LOG = "lazy-pages.log"

    def __init__(self, binary: str, images_dir: Path, work_dir: Path):
        self.work_dir = work_dir
        self.proc = subprocess.Popen(
            [binary, "lazy-pages", "-D", str(images_dir), "-W", str(work_dir), "-o", self.LOG, "-v4"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def listening(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while not (self.work_dir / self.SOCKET).exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def finish(self, timeout: float = 120.0) -> None:
        """Wait until every page is in; a daemon that failed fails the restore."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ColdSnapError(ErrorCode.CRIU_FAILED, f"criu lazy-pages did not finish in {timeout:.0f} s "
                                f"(log: {self.work_dir / self.LOG})") from None
        if rc != 0:
            raise ColdSnapError(ErrorCode.CRIU_FAILED, f"criu lazy-pages failed: "
                                f"{first_error_line(self.work_dir / self.LOG)} (log: {self.work_dir / self.LOG})")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def first_error_line(log: Path) -> str:
    """The first meaningful CRIU error line (the RLIMIT_NOFILE one is noise on hosts without CAP_SYS_RESOURCE)."""
    try:
        for line in log.read_text(errors="replace").splitlines():
            if "Error" in line and "RLIMIT_NOFILE" not in line:
                return re.sub(r"^\(\s*[\d.]+\)\s*", "", line).strip()
    except OSError:
        pass
    return "no error line in the log"


# CRIU's parasite mounts the dumped task's /proc at a fixed directory of its mount namespace: two dumps of
# PID-namespace inits (both pid 1) in the host's mount namespace at once collide there ("Can't create a directory
# (-17)"). Dumps on this host take turns under this lock; restores and everything else around a dump run side by side.
DUMP_LOCK = "/run/coldsnap-criu-dump.lock"


def criu_version(binary: str) -> str | None:
    """X.Y[.Z] as `binary --version` prints it ("Version: 4.2.1"); None where it says nothing of the kind."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^Version:\s*(\d+)\.(\d+)(?:\.(\d+))?\s*$", out, re.MULTILINE)
    if m is None:
        return None
    return ".".join(str(int(g)) for g in m.groups() if g is not None)


class CriuDriver:
    def __init__(self, binary: str | None = None):
        self.binary = binary or settings().criu
        if not os.access(self.binary, os.X_OK):
            raise ColdSnapError(ErrorCode.ENVIRONMENT,
                                f"CRIU not found at {self.binary}; run `make setup` or set COLDSNAP_CRIU")

    @property
    def pycriu(self):
        """pycriu, imported at its first use (~0.15 s: protobuf): asking CRIU's version needs none of it."""
        return _pycriu()

    def _client(self):
        client = self.pycriu.criu()
        client.use_binary(self.binary)
        return client

    def version(self) -> str:
        """CRIU's version, X.Y[.Z]: `criu --version` (~10 ms), else its RPC (a swrk process of its own)."""
        return criu_version(self.binary) or self._rpc_version()

    def _rpc_version(self) -> str:
        req = self.pycriu.rpc.criu_req()
        req.type = self.pycriu.rpc.VERSION
        fd = os.open("/", os.O_DIRECTORY)
        try:
            req.opts.images_dir_fd = fd
            resp = self._client()._send_req_and_recv_resp(req)
        finally:
            os.close(fd)
        v = resp.version
        return f"{v.major_number}.{v.minor_number}" + (f".{v.sublevel}" if v.HasField("sublevel") else "")

    def dump(self, pid: int, images_dir: Path, options: CriuOptions, netns_inode: int | None) -> float:
        """Dump the tree rooted at pid (the init of its PID namespace). Returns seconds taken."""
        images_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        client = self._client()
        fd = os.open(images_dir, os.O_DIRECTORY)
        try:
            options.apply(client.opts, self.pycriu)
            client.opts.images_dir_fd = fd
            client.opts.pid = pid
            client.opts.log_file = "dump.log"
            client.opts.leave_running = options.leave_running
            # The network namespace is ColdSnap's (netns + veth), recreated at restore: never dump its contents.
            if netns_inode is not None:
                client.opts.external.append(f"net[{netns_inode}]:{NETNS_KEY}")
            client.opts.external.extend(options.external)
            t0 = time.monotonic()
            try:
                with locked(DUMP_LOCK):
                    client.dump()
            except self.pycriu.CRIUException as e:
                log = images_dir / "dump.log"
                raise ColdSnapError(ErrorCode.CRIU_FAILED, f"criu dump of pid {pid} failed: "
                                    f"{first_error_line(log)} (log: {log}; {e})") from None
            return time.monotonic() - t0
        finally:
            os.close(fd)

    def restore(self, images_dir: Path, work_dir: Path, options: CriuOptions, netns_path: str | None
                ) -> tuple[int, LazyPages | None]:
        """Restore the tree as a child of this process (rst_sibling). Returns the host PID of its root and, with
        options.lazy_pages, the daemon still bringing its pages in (finish() it before the tree counts as restored).
        Lazy pages that cannot start (no userfaultfd here) fall back to an ordinary restore, options updated."""
        work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        client = self._client()
        fd = os.open(images_dir, os.O_DIRECTORY)
        wfd = os.open(work_dir, os.O_DIRECTORY)
        nsfd = None
        lazy = None
        try:
            if options.lazy_pages:
                lazy = LazyPages(self.binary, images_dir, work_dir)
                if not lazy.listening():
                    lazy.kill()
                    lazy, options.lazy_pages = None, False
            client.opts.lazy_pages = options.lazy_pages
            options.apply(client.opts, self.pycriu)
            client.opts.images_dir_fd = fd
            client.opts.work_dir_fd = wfd
            client.opts.log_file = "restore.log"
            client.opts.rst_sibling = True
            if netns_path:
                # criu swrk is forked from us, so an inheritable fd reaches it under the same number.
                nsfd = os.open(netns_path, os.O_RDONLY)
                os.set_inheritable(nsfd, True)
                client.opts.inherit_fd.add(key=NETNS_KEY, fd=nsfd)
            try:
                resp = client.restore()
            except self.pycriu.CRIUException as e:
                if lazy is not None:
                    lazy.kill()
                log = work_dir / "restore.log"
                raise ColdSnapError(ErrorCode.CRIU_FAILED,
                                    f"criu restore failed: {first_error_line(log)} (log: {log}; {e})") from None
            return resp.pid, lazy
        finally:
            os.close(fd)
            os.close(wfd)
            if nsfd is not None:
                os.close(nsfd)


def criu_images_open_files(images_dir: Path) -> list[dict]:
    """Regular files the dumped tree held open, with the size CRIU recorded (restore insists on it)."""
    pycriu = _pycriu()
    path = images_dir / "files.img"
    if not path.exists():
        return []
    with open(path, "rb") as f:
        entries = pycriu.images.load(f)["entries"]
    regs = [e["reg"] for e in entries if e.get("type") == "REG" and e.get("reg")]
    return [{"path": reg["name"], "size": int(reg.get("size", 0)), "flags": int(reg["flags"], 0)
             if isinstance(reg.get("flags"), str) else int(reg.get("flags", 0))} for reg in regs]


def criu_stats(directory: Path, kind: str) -> dict:
    """CRIU's own account of a dump or restore (stats-dump in the images, stats-restore in the work dir): its times
    in seconds and its page counts. Empty when CRIU wrote none."""
    path = directory / f"stats-{kind}"
    try:
        with open(path, "rb") as f:
            entry = _pycriu().images.load(f)["entries"][0]
    except Exception:  # noqa: BLE001 - stats are informational
        return {}
    raw = entry.get(kind) or {}
    return {(k[:-5] + "_s" if k.endswith("_time") else k): (int(v) / 1e6 if k.endswith("_time") else int(v))
            for k, v in raw.items()}
