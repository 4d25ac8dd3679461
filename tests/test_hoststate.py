"""State a workload keeps outside CRIU's images (coldsnap.workload.hostfiles): here, a container's /dev/shm bound from
the host (podman, docker, containerd), which a capture carries and a restore writes into the new container's. The
whole path runs for real with vLLM under podman (tests/test_shim_podman.py); these check its parts."""

from __future__ import annotations

import os
import stat

from coldsnap.contracts import CapturedFile
from coldsnap.workload.hostfiles import HeldShm, bound_shm_source, put_back_container_shm


def test_a_bound_dev_shm_is_found_and_a_tmpfs_one_is_not():
    podman = {"mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                         {"destination": "/dev/shm", "type": "bind", "source": "/var/lib/x/userdata/shm",
                          "options": ["bind", "private"]}]}
    docker = {"mounts": [{"destination": "/dev/shm/", "source": "/var/lib/docker/containers/c/mounts/shm",
                          "options": ["rbind", "rprivate"]}]}
    own = {"mounts": [{"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["size=1g"]}]}
    assert bound_shm_source(podman) == "/var/lib/x/userdata/shm"
    assert bound_shm_source(docker) == "/var/lib/docker/containers/c/mounts/shm"
    assert bound_shm_source(own) is None and bound_shm_source({}) is None


def test_held_files_keep_their_bytes_after_they_are_removed(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "psm_1").write_bytes(b"queue")
    (shm / "sub").mkdir()
    held = HeldShm(str(shm))
    try:
        assert set(held.fds) == {"psm_1"}  # regular files only
        os.unlink(shm / "psm_1")  # the container's engine unmounted its /dev/shm
        with open(f"/proc/self/fd/{held.fds['psm_1']}", "rb") as f:
            assert f.read() == b"queue"
    finally:
        held.close()
    assert held.fds == {} and HeldShm(None).fds == {}


def test_a_restore_writes_the_files_into_the_new_containers_dev_shm(tmp_path):
    staged = tmp_path / "files"
    staged.mkdir()
    (staged / "0").write_text("log")
    (staged / "1").write_bytes(b"abc")
    files = [CapturedFile(path="/var/log/engine.log", size=3, mode=0o644),
             CapturedFile(path="/dev/shm/psm_1", size=8, mode=0o600)]
    new_shm = tmp_path / "new-shm"
    new_shm.mkdir()
    spec = {"mounts": [{"destination": "/dev/shm", "type": "bind", "source": str(new_shm), "options": ["bind"]}]}
    assert put_back_container_shm(staged, files, spec) == [str(new_shm / "psm_1")]
    assert (new_shm / "psm_1").read_bytes() == b"abc" + bytes(5)  # its dump-time size, sparse
    assert stat.S_IMODE((new_shm / "psm_1").stat().st_mode) == 0o600
    assert not (tmp_path / "var").exists()  # only /dev/shm files are a container's to put back
    # A new container whose /dev/shm is its own tmpfs: nothing to write (the restore says what is missing).
    assert put_back_container_shm(staged, files, {"mounts": []}) == []
