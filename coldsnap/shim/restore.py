"""Restore a staged capsule as the container `create` was asked for: `runc restore --detach` with the caller's
bundle, pid file and console socket and the capsule's recorded CRIU options, then hydrate (loopback, CUDA, the
engine's resume). Raises ColdSnapError; the caller cleans up and decides whether to fall back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from coldsnap.base.files import private_dir
from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.criu import runc_options
from coldsnap.criu.driver import first_error_line
from coldsnap.engines import get_adapter
from coldsnap.flows.restore import Staged
from coldsnap.flows.spans import Timeline
from coldsnap.gpu import steps as gpu_steps
from coldsnap.oci import records
from coldsnap.oci.argv import RuncArgv
from coldsnap.workload import hostfiles
from coldsnap.workload.target import Target


def work_dir_path(container_id: str) -> Path:
    return Path(records.state_dir()) / "work" / container_id


def work_dir(container_id: str) -> Path:
    """A fresh work dir for this container's restore (runc's and CRIU's logs; removed when it is deleted)."""
    path = work_dir_path(container_id)
    shutil.rmtree(path, ignore_errors=True)
    return private_dir(path)


def restore_argv(runc: str, parsed: RuncArgv, images: Path, work: Path, pid_file: str, flags: list[str]) -> list[str]:
    """The caller's globals (its --log/--criu replaced: runc logs to our work dir, CRIU is ColdSnap's)."""
    argv = [runc, *parsed.global_argv(drop=("criu", "log", "log-format")),
            "--log", str(work / "runc.log"), "--log-format", "json", "--criu", settings().criu,
            "restore", "--detach", "--image-path", str(images), "--work-path", str(work),
            "--bundle", parsed.bundle, "--pid-file", os.path.abspath(pid_file)]
    if parsed.console_socket:
        argv += ["--console-socket", os.path.abspath(parsed.console_socket)]
    if parsed.flag("no-pivot"):
        argv.append("--no-pivot")
    return argv + flags + [parsed.container_id]


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


def _keep_log(log: Path, container_id: str) -> Path | None:
    """CRIU's restore log beside the container's receipt: the work dir goes when the container does."""
    if not log.exists():
        return None
    dest = private_dir(settings().receipts) / f"{container_id}.restore.log"
    shutil.copyfile(log, dest)
    dest.chmod(0o600)
    return dest


def runc_restore(runc: str, parsed: RuncArgv, staged: Staged, work: Path) -> tuple[int, list[str]]:
    """Returns (host pid of the restored init, the argv used). The container is running when this returns."""
    flags, lines = runc_options.split(staged.capsule.profile.criu_options, "restore")
    conf = runc_options.write_config(work / "criu.conf", lines)
    pid_file = parsed.pid_file or str(work / "restore.pid")
    argv = restore_argv(runc, parsed, staged.images, work, pid_file, flags)
    # stdio is inherited: runc hands the caller's pipes (conmon's, containerd's) to the restored process.
    rc = subprocess.call(argv, env={**os.environ, "CRIU_CONFIG_FILE": str(conf)})
    if rc != 0:
        kept = _keep_log(work / "restore.log", parsed.container_id)
        raise ColdSnapError(ErrorCode.CRIU_FAILED,
                            f"runc restore failed (exit {rc}): {_runc_error(work / 'runc.log')}; "
                            f"CRIU: {first_error_line(work / 'restore.log')}" + (f" (log: {kept})" if kept else ""))
    try:
        return int(Path(pid_file).read_text().strip()), argv
    except (OSError, ValueError):
        raise ColdSnapError(ErrorCode.RUNTIME, f"runc restore wrote no pid to {pid_file}") from None


def restore_container(runc: str, parsed: RuncArgv, staged: Staged, spec: dict, target_host: str | None,
                      target_port: int | None, tl: Timeline) -> dict:
    """criu-restore and hydrate spans; returns what the record needs. spec: the new container's."""
    profile = staged.capsule.profile
    work = work_dir(parsed.container_id)
    t0 = time.monotonic()  # the restore clock: staging excluded, as for process mode
    # files of a bound /dev/shm the dump refers to: into the new container's before CRIU looks for them
    put_back = hostfiles.put_back_container_shm(staged.files, profile.files, spec)
    try:
        with tl.span("criu-restore"):
            pid, argv = runc_restore(runc, parsed, staged, work)
        target = Target(pid=pid, port=target_port or profile.launch.port, host=target_host)
        with tl.span("hydrate"):
            gpu = gpu_steps.restore_restored_tree(pid) if profile.cuda_pids else gpu_steps.GpuCheckpoint()
            adapter = get_adapter(profile.engine.name)
            target.call(adapter.after_restore, profile.kv_discarded, profile.weights_mode)
    except BaseException:
        hostfiles.remove_files(put_back)  # the cold start the caller falls back to gets its /dev/shm as it was
        raise
    return {"pid": pid, "t0": t0, "work_dir": str(work), "runc_restore": argv, "port": target.port,
            "host": target.host, "cuda_processes": len(gpu.pids)}
