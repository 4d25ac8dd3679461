"""What a capsule's images would restore, held to a container's spec (coldsnap.criu.creds.exceeds_spec), as a
table; the real images are read in tests/test_shim_runc.py (a capsule tampered with pycriu is refused)."""

import pytest

from coldsnap.criu.creds import CAPABILITIES, TaskCreds, _seccomp_mode, exceeds_spec


def caps(*names: str) -> int:
    return sum(1 << CAPABILITIES.index(n) for n in names)


DEFAULT = ["CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_AUDIT_WRITE"]
SPEC = {"process": {"user": {"uid": 0, "gid": 0}, "noNewPrivileges": True,
                    "capabilities": {k: DEFAULT for k in ("bounding", "effective", "permitted")}},
        "linux": {"seccomp": {"defaultAction": "SCMP_ACT_ERRNO"}}}


def task(uids=(0,), gids=(0,), bnd=None, prm=None, nnp=True, seccomp=2) -> TaskCreds:
    full = caps("KILL", "NET_BIND_SERVICE", "AUDIT_WRITE")
    return TaskCreds(pid=7, uids=set(uids), gids=set(gids),
                     caps={"cap_bnd": full if bnd is None else bnd, "cap_prm": full if prm is None else prm,
                           "cap_eff": 0, "cap_inh": 0, "cap_amb": 0}, no_new_privs=nnp, seccomp_mode=seccomp)


def with_user(uid: int, gid: int = 1000) -> dict:
    return {**SPEC, "process": {**SPEC["process"], "user": {"uid": uid, "gid": gid}}}


@pytest.mark.parametrize("t, spec, want", [
    (task(), SPEC, None),
    (task(prm=caps("KILL")), SPEC, None),  # fewer is fine
    (task(bnd=caps("KILL", "SYS_ADMIN")), SPEC, "CAP_SYS_ADMIN in its bounding set"),
    (task(prm=caps("NET_RAW")), SPEC, "CAP_NET_RAW in its permitted set"),
    (task(nnp=False), SPEC, "no_new_privs"),
    (task(seccomp=0), SPEC, "seccomp filter"),
    (task(seccomp=None), SPEC, None),  # a thread: its task's leader carries the mode
    (task(uids=(1000,), gids=(1000,)), with_user(1000), None),
    (task(uids=(1000, 0), gids=(1000,)), with_user(1000), "uid 0"),
    (task(uids=(1000,), gids=(0,)), with_user(1000), "gid 0"),
    (task(uids=(33,)), SPEC, None),  # a root container's processes may be any uid
])
def test_the_images_may_not_exceed_the_spec(t, spec, want):
    got = exceeds_spec([t], spec)
    assert (got is None) if want is None else (want in got), got


def test_pycriu_names_of_seccomp_modes():
    assert [_seccomp_mode(v) for v in ("disabled", "strict", "filter", 2, None)] == [0, 1, 2, 2, 0]
