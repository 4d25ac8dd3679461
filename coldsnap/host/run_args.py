"""`coldsnap run-args CAPSULE --for podman|docker|ctr`: the command that restores a container capsule, built from
the launch its capture recorded (contracts.ContainerLaunch): the same binds, tmpfs, /dev/shm size, network, working
directory and command, plus the runtime and the capsule's annotation. A restore needs the captured mount tree and
namespaces back; this is how to ask an engine for them.

What an engine makes by itself (/proc, /dev, /sys, cgroups, its own /etc/hosts, /etc/resolv.conf, /etc/hostname,
/run/.containerenv, its /dev/shm) is not repeated: the same options make it again. Environment variables are
passed by name only (`-e NAME`): ColdSnap never records their values, and the restored process has its own
environment back from the capsule anyway; the names matter for a cold fallback."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from coldsnap.contracts import CapsuleProfile, ColdSnapError, ErrorCode
from coldsnap.contracts import capsule as mt

ENGINES = ("podman", "docker", "ctr")
# mounts every engine makes for every container (repeating them would clash)
ENGINE_MADE = frozenset({"/proc", "/dev", "/dev/pts", "/dev/mqueue", "/dev/shm", "/sys", "/sys/fs/cgroup",
                         "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run/.containerenv"})
IMAGE = "IMAGE"  # where the capture did not record the image
TMPFS_KEYS = ("size", "mode", "uid", "gid", "nr_inodes")  # the tmpfs options every engine takes back


@dataclass
class RunArgs:
    engine: str
    argv: list[str]
    notes: list[str]

    def line(self) -> str:
        return " ".join(shlex.quote(a) for a in self.argv)


def run_args(profile: CapsuleProfile, digest: str, engine: str, runtime: str, name: str | None = None,
             image: str | None = None) -> RunArgs:
    if engine not in ENGINES:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"--for must be one of {', '.join(ENGINES)} (got {engine!r})")
    launch = profile.container
    if profile.snapshot_driver != "criu-runc" or launch is None:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"capsule {digest} was not captured from a container "
                            "(restore it with `coldsnap restore --capsule …`)")
    image = image or launch.image or IMAGE
    notes = [] if image != IMAGE else ["the capture did not record the image: replace IMAGE (capture --image)"]
    mounts = [m for m in launch.mounts
              if m.destination not in ENGINE_MADE and not m.destination.startswith(("/proc/", "/sys/", "/dev/"))]
    binds = [(m.source, m.destination, "ro" in m.options) for m in mounts if m.type == "bind"]
    tmpfs = [(m.destination, [o for o in m.options if o in ("rw", "ro") or o.split("=", 1)[0] in TMPFS_KEYS])
             for m in mounts if m.type == "tmpfs"]
    if engine == "ctr":
        argv = ["ctr", "run", "-d", "--runc-binary", runtime, "--annotation", f"{mt.ANNOTATION_CAPSULE}={digest}"]
        for src, dst, ro in binds:
            argv += ["--mount", f"type=bind,src={src},dst={dst},options=rbind:{'ro' if ro else 'rw'}"]
        for dst, opts in tmpfs:
            argv += ["--mount", f"type=tmpfs,src=tmpfs,dst={dst},options={':'.join(opts) or 'rw'}"]
        if launch.network == "host":
            argv.append("--net-host")
        elif launch.network == "path":
            argv += ["--with-ns", f"network:{launch.network_path}"]
        if launch.cwd:
            argv += ["--cwd", launch.cwd]
        argv += [image, name or "ID", *launch.args]
        notes.append("ctr passes no environment by name: add --env NAME=VALUE for what a cold fallback needs")
        return RunArgs(engine, argv, notes)
    argv = [engine, "run", "-d", *(["--name", name] if name else [])]
    if engine == "podman":
        argv += ["--runtime", runtime, "--annotation", f"{mt.ANNOTATION_CAPSULE}={digest}", "--network",
                 {"host": "host", "own": "none", "path": f"ns:{launch.network_path}"}[launch.network]]
    else:  # docker 20.10 has no --annotation: the shim reads COLDSNAP_CAPSULE from the container's environment
        argv += ["--runtime", "coldsnap", "-e", f"COLDSNAP_CAPSULE={digest}"]
        if launch.network == "host":
            argv += ["--network", "host"]
        else:  # docker makes every container's network namespace itself: its default (bridge) or --network none
            notes.append("docker: the capture's network namespace was docker's own; add --network none (or the "
                         "network it was on) as the captured container had it")
    if launch.shm_size:
        argv += ["--shm-size", str(launch.shm_size)]
    for dst, opts in tmpfs:
        argv += ["--tmpfs", f"{dst}:{','.join(opts)}" if opts else dst]
    for src, dst, ro in binds:
        argv += ["-v", f"{src}:{dst}:{'ro' if ro else 'rw'}"]
    for env_name in launch.env_names:
        if env_name not in ("PATH", "HOSTNAME", "container", "TERM", "HOME") and not env_name.startswith("COLDSNAP_"):
            argv += ["-e", env_name]
    if launch.cwd:
        argv += ["-w", launch.cwd]
    argv += [image, *launch.args]
    return RunArgs(engine, argv, notes)
