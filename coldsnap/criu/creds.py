"""What a set of CRIU images will restore, held to the container's spec before `runc restore` runs.

CRIU restores each task's credentials as the images record them (uids and gids, the five capability sets,
no_new_privs, the seccomp mode), and the images are bytes anyone who can write a capsule chose. So a container
restore reads every task's core image and refuses a capsule that would give its processes more than the new
container's config.json grants: a uid or gid the spec does not give (when the spec's user is not root), a
capability in any set outside the spec's bounding set (what the container's processes can ever hold: a root
process that execs gets its bounding set as permitted), no_new_privs off where the spec turns it on, no seccomp
filter where the spec has one. The filters' contents are not compared."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coldsnap.contracts import ColdSnapError, ErrorCode

# Linux capability numbers (include/uapi/linux/capability.h)
CAPABILITIES = ["CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
                "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
                "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
                "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE",
                "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM",
                "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE"]
SETS = {"cap_bnd": "bounding", "cap_prm": "permitted", "cap_eff": "effective", "cap_inh": "inheritable",
        "cap_amb": "ambient"}
SECCOMP_FILTER = 2
SECCOMP_MODES = {"disabled": 0, "strict": 1, "filter": SECCOMP_FILTER}  # pycriu gives the enum's name


def _seccomp_mode(value) -> int:
    return SECCOMP_MODES.get(value.lower(), -1) if isinstance(value, str) else int(value or 0)


@dataclass
class TaskCreds:
    pid: int
    uids: set[int]
    gids: set[int]
    caps: dict[str, int]  # image field (cap_bnd, …) -> bit mask
    no_new_privs: bool
    seccomp_mode: int | None  # None: a thread's core image, which leaves seccomp to its task's (the leader's)


def _mask(words) -> int:
    return sum(int(w) << (32 * i) for i, w in enumerate(words or []))


def image_creds(images: Path) -> list[TaskCreds]:
    """Every task's credentials in a CRIU image directory (core-<pid>.img)."""
    from coldsnap.criu.driver import _pycriu

    pycriu = _pycriu()
    out = []
    for path in sorted(images.glob("core-*.img")):
        try:
            with open(path, "rb") as f:
                entry = pycriu.images.load(f)["entries"][0]
            tc = entry["thread_core"]
            creds = tc["creds"]
        except Exception as e:  # noqa: BLE001 - a core image that does not decode is a capsule not to restore
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"CRIU image {path.name} does not decode: {e}") from None
        ids = ("uid", "euid", "suid", "fsuid"), ("gid", "egid", "sgid", "fsgid")
        out.append(TaskCreds(
            pid=int(path.stem.split("-", 1)[1]),
            uids={int(creds.get(k, 0)) for k in ids[0]},
            gids={int(creds.get(k, 0)) for k in ids[1]} | {int(g) for g in creds.get("groups") or []},
            caps={k: _mask(creds.get(k)) for k in SETS},
            no_new_privs=bool(creds.get("no_new_privs", 0)),
            seccomp_mode=_seccomp_mode(tc.get("seccomp_mode")) if "seccomp_mode" in tc or "tc" in entry else None))
    return out


def _spec_mask(names) -> int:
    wanted = {str(name).upper().removeprefix("CAP_") for name in names or []}
    return sum(1 << i for i, cap in enumerate(CAPABILITIES) if cap in wanted)


def _names(mask: int) -> str:
    return ", ".join(f"CAP_{n}" for i, n in enumerate(CAPABILITIES) if mask >> i & 1) or f"bits {mask:#x}"


def exceeds_spec(tasks: list[TaskCreds], spec: dict) -> str | None:
    """The first thing the images would restore that the spec does not grant, as a sentence; None when nothing."""
    process = spec.get("process") or {}
    user = process.get("user") or {}
    uid, gid = int(user.get("uid", 0)), int(user.get("gid", 0))
    gids = {gid} | {int(g) for g in user.get("additionalGids") or []}
    caps = process.get("capabilities") or {}
    bounding = _spec_mask(caps.get("bounding")) if "bounding" in caps else _spec_mask(
        [n for key in SETS.values() for n in caps.get(key) or []])
    nnp = bool(process.get("noNewPrivileges"))
    seccomp = bool((spec.get("linux") or {}).get("seccomp"))
    for t in tasks:
        if uid != 0 and t.uids - {uid}:
            return f"task {t.pid} would run as uid {sorted(t.uids - {uid})[0]}; the container's user is uid {uid}"
        if uid != 0 and t.gids - gids:
            return f"task {t.pid} would hold gid {sorted(t.gids - gids)[0]}; the container grants {sorted(gids)}"
        for field, key in SETS.items():
            if extra := t.caps[field] & ~bounding:
                return (f"task {t.pid} would hold {_names(extra)} in its {key} set, outside the container's "
                        "capability bounding set")
        if nnp and not t.no_new_privs:
            return f"task {t.pid} would run without no_new_privs; the container's spec sets noNewPrivileges"
        if seccomp and t.seccomp_mode is not None and t.seccomp_mode != SECCOMP_FILTER:
            return f"task {t.pid} would run without a seccomp filter; the container's spec has one"
    return None
