"""CRIU through runc: ColdSnap's CRIU options (CriuOptions.cli_flags(), the one option table) as runc takes them,
and `runc checkpoint` / `runc restore` of a container with them.

runc checkpoint/restore expose only some CRIU options as flags. The others (--link-remap, --ghost-limit,
--network-lock, ...) go to CRIU through a configuration file named by $CRIU_CONFIG_FILE, which runc passes on
to `criu swrk` with its environment. Nothing here is invented: every option comes from cli_flags()."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from coldsnap.base.files import private_dir
from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.criu.driver import CriuOptions, first_error_line
from coldsnap.oci.argv import RuncArgv
from coldsnap.oci.runtime import Runc

RUNC_FLAGS = ("--tcp-established", "--ext-unix-sk", "--shell-job", "--file-locks")
CHECKPOINT_ONLY = ("--leave-running",)
PROCESS_MODE_ONLY = ("--external=",)  # ColdSnap's own netns key; runc names the container's namespaces itself


def split_options(cli_flags: list[str], operation: str) -> tuple[list[str], list[str]]:
    """(runc flags, CRIU config-file lines) for operation 'checkpoint' or 'restore'."""
    flags: list[str] = []
    lines: list[str] = []
    for flag in cli_flags:
        if flag in RUNC_FLAGS or (flag in CHECKPOINT_ONLY and operation == "checkpoint"):
            flags.append(flag)
        elif flag not in CHECKPOINT_ONLY and not flag.startswith(PROCESS_MODE_ONLY):
            name, _, value = flag.lstrip("-").partition("=")
            lines.append(f"{name} {value}".strip())
    return flags, lines


def _config_env(path: Path, lines: list[str]) -> dict[str, str]:
    """The environment that hands runc (and the `criu swrk` it runs) a CRIU config file of these lines, at path."""
    path.write_text("".join(line + "\n" for line in lines))
    path.chmod(0o600)
    return {**os.environ, "CRIU_CONFIG_FILE": str(path)}


QUIESCE_MODES = ("drain", "none")
IN_FLIGHT_LOCK = "nftables"  # libnftables ships in the CRIU prefix (the GPU image has no iptables)


def container_options(leave_running: bool, quiesce: str = "drain") -> CriuOptions:
    """The one option table. drain: the network lock off: the container's network namespace belongs to its
    engine (or to a pod) and may outlive the dump; a lock CRIU left there would black-hole whatever uses it next,
    and the capture quiesced first, so no connection needs it. none: connections are open and are dumped with
    the server (--tcp-established); CRIU locks the namespace (drops every packet but its own) before it freezes
    the tree and, once the tree is dumped and gone, leaves the lock in place, so a client's ACK or retransmit
    meets silence, not a reset; restoring into that namespace with the same option removes it once the sockets are
    back (and the shim removes it before a cold fallback there). With leave_running CRIU unlocks at once."""
    return CriuOptions(leave_running=leave_running, network_lock="skip" if quiesce == "drain" else IN_FLIGHT_LOCK)


def checkpoint_container(runc: str, runc_root: str | Path, container_id: str, images: Path, work: Path,
                    options: CriuOptions) -> list[str]:
    flags, lines = split_options(options.cli_flags(), "checkpoint")
    argv = Runc.at_root(runc, runc_root).argv("--criu", settings().criu, "checkpoint", "--image-path", str(images),
                                              "--work-path", str(work), *flags, container_id)
    r = subprocess.run(argv, env=_config_env(work.parent / "criu.conf", lines), capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise ColdSnapError(ErrorCode.CRIU_FAILED, f"runc checkpoint of {container_id} failed (exit {r.returncode}): "
                            f"{first_error_line(work / 'dump.log')} (runc: {r.stderr.strip()[-300:]})")
    return argv


def _runc_error(log: Path) -> str:
    """The last error runc logged (json lines), without the noise of CRIU's RLIMIT line."""
    msg = ""
    try:
        for line in log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("level") in ("error", "fatal"):
                msg = str(entry.get("msg", ""))
    except OSError:
        pass
    return msg.strip() or "no error in runc's log"


def _keep_log(log: Path, dest: Path) -> Path | None:
    """CRIU's restore log beside the container's receipt: the work dir goes when the container does."""
    if not log.exists():
        return None
    private_dir(dest.parent)
    shutil.copyfile(log, dest)
    dest.chmod(0o600)
    return dest


def restore_container(runc: str, parsed: RuncArgv, images: Path, criu_options: list[str], work: Path,
                      receipts: Path) -> tuple[int, list[str]]:
    """`runc restore --detach` as `create` was asked for: the caller's bundle, pid file and console socket, the
    capsule's recorded CRIU options. Returns (host pid of the restored init, the argv used); the container is
    running when this returns. On failure CRIU's log is kept in receipts/<id>.restore.log."""
    flags, lines = split_options(criu_options, "restore")
    pid_file = parsed.pid_file or str(work / "restore.pid")
    # The caller's globals, its --log/--criu replaced: runc logs to our work dir, CRIU is ColdSnap's.
    argv = Runc.for_call(runc, parsed, drop=("criu", "log", "log-format")).argv(
        "--log", str(work / "runc.log"), "--log-format", "json", "--criu", settings().criu,
        "restore", "--detach", "--image-path", str(images), "--work-path", str(work),
        "--bundle", parsed.bundle, "--pid-file", os.path.abspath(pid_file))
    if parsed.console_socket:
        argv += ["--console-socket", os.path.abspath(parsed.console_socket)]
    if parsed.flag("no-pivot"):
        argv.append("--no-pivot")
    argv += flags + [parsed.id]
    # stdio is inherited: runc hands the caller's pipes (conmon's, containerd's) to the restored process.
    rc = subprocess.call(argv, env=_config_env(work / "criu.conf", lines))
    if rc != 0:
        kept = _keep_log(work / "restore.log", receipts / f"{parsed.container_id}.restore.log")
        raise ColdSnapError(ErrorCode.CRIU_FAILED,
                            f"runc restore failed (exit {rc}): {_runc_error(work / 'runc.log')}; "
                            f"CRIU: {first_error_line(work / 'restore.log')}" + (f" (log: {kept})" if kept else ""))
    if settings().debug:  # where a successful restore's time went (CRIU logs with timestamps)
        _keep_log(work / "restore.log", receipts / f"{parsed.container_id}.restore.log")
    try:
        return int(Path(pid_file).read_text().strip()), argv
    except (OSError, ValueError):
        raise ColdSnapError(ErrorCode.RUNTIME, f"runc restore wrote no pid to {pid_file}") from None
