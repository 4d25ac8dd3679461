"""A container's writable layer carried across a restore (coldsnap.workload.layer), on real overlay mounts: the
files a container wrote are held before the dump and written into a new container's root of the same image; a
failed restore leaves that root as the image made it; nothing is written through a symlink or outside the root."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from coldsnap.contracts import CapturedFile, ColdSnapError, ErrorCode
from coldsnap.workload.layer import HeldLayer, put_back_layer, writable_layer


def test_the_upper_directory_is_read_from_mountinfo(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(
        "29 1 0:26 / / rw - ext4 /dev/vda1 rw\n"
        "300 29 0:90 / /var/lib/docker/overlay2/abc/merged rw,relatime - overlay overlay "
        "rw,lowerdir=/l1:/l2,upperdir=/var/lib/docker/overlay2/abc/diff,workdir=/var/lib/docker/overlay2/abc/work\n"
        "301 29 0:91 / /srv/with\\040space rw - overlay overlay rw,lowerdir=/l,upperdir=/u\\040x,workdir=/w\n"
        "302 29 0:92 / /plain rw - ext4 /dev/vda1 rw\n")
    assert writable_layer("/var/lib/docker/overlay2/abc/merged", str(info)) == "/var/lib/docker/overlay2/abc/diff"
    assert writable_layer("/srv/with space", str(info)) == "/u x"
    assert writable_layer("/plain", str(info)) is None
    assert writable_layer("/nowhere", str(info)) is None


class Overlay:
    """An image (lower) and one container root over it: upper + work, mounted at merged."""

    def __init__(self, base: Path, lower: Path, name: str):
        self.upper, self.work, self.merged = (base / name / d for d in ("upper", "work", "merged"))
        for d in (self.upper, self.work, self.merged):
            d.mkdir(parents=True)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={lower},upperdir={self.upper},workdir={self.work}", str(self.merged)], check=True)

    def umount(self) -> None:
        subprocess.run(["umount", str(self.merged)], check=False)


@pytest.fixture
def image(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: overlay mounts")
    lower = tmp_path / "image"
    (lower / "etc").mkdir(parents=True)
    (lower / "etc" / "app.conf").write_text("from the image\n")
    (lower / "tmp").mkdir()
    (lower / "data").mkdir()
    (lower / "escape").symlink_to("/etc")  # an image's absolute symlink: must never lead a write to the host
    mounts: list[Overlay] = []

    def container(name: str) -> Overlay:
        mounts.append(Overlay(tmp_path, lower, name))
        return mounts[-1]

    yield container
    for m in mounts:
        m.umount()


def test_what_a_container_wrote_comes_back_in_a_new_container_of_the_image(image, tmp_path):
    old = image("old")
    (old.merged / "tmp" / "serve.log").write_text("line 1\n")
    (old.merged / "tmp" / "deep" / "er").mkdir(parents=True)
    (old.merged / "tmp" / "deep" / "er" / "pid").write_text("25\n")
    (old.merged / "etc" / "app.conf").write_text("changed by the container\n")
    (old.merged / "data" / "mounted").write_text("on a volume")  # a mount point: not the root filesystem's
    os.chmod(old.merged / "tmp" / "serve.log", 0o640)

    held = HeldLayer(str(old.merged), ["/data"])
    with open(old.merged / "tmp" / "serve.log", "a") as log:  # the server writes on until the dump
        log.write("line 2\n")
    files, sources = held.captured()
    held.close()
    by_path = {f.path: f for f in files}
    assert set(by_path) == {"/tmp/serve.log", "/tmp/deep/er/pid", "/etc/app.conf"}
    assert all(f.layer for f in files) and by_path["/tmp/serve.log"].size == len("line 1\nline 2\n")
    assert by_path["/tmp/serve.log"].mode == 0o640
    staged = tmp_path / "staged"
    staged.mkdir()
    for i, f in enumerate(files):  # as a capsule's files come out of staging: by position
        (staged / str(i)).write_bytes((old.upper / f.path.lstrip("/")).read_bytes())

    new = image("new")
    done = put_back_layer(staged, files, str(new.merged))
    assert (new.merged / "tmp" / "serve.log").read_text() == "line 1\nline 2\n"
    assert (new.merged / "tmp" / "deep" / "er" / "pid").read_text() == "25\n"
    assert (new.merged / "etc" / "app.conf").read_text() == "changed by the container\n"
    assert (new.upper / "tmp" / "serve.log").exists()  # through the overlay: into the new container's own layer
    assert os.stat(new.merged / "tmp" / "serve.log").st_mode & 0o777 == 0o640

    done.undo()  # the restore failed: the cold start finds the image as it was
    assert not (new.merged / "tmp" / "serve.log").exists()
    assert (new.merged / "etc" / "app.conf").read_text() == "from the image\n"
    assert sorted(p.name for p in (new.merged / "etc").iterdir()) == ["app.conf"]


def test_a_write_never_follows_a_symlink_or_leaves_the_root(image, tmp_path):
    new = image("new")
    through_link = [CapturedFile(path="/escape/coldsnap-test-should-not-exist", size=1, mode=0o600, layer=True)]
    with pytest.raises(ColdSnapError) as e:
        put_back_layer(None, through_link, str(new.merged))
    assert e.value.code == ErrorCode.INCOMPATIBLE
    assert not Path("/etc/coldsnap-test-should-not-exist").exists()
    for bad in ("/tmp/../../x", "relative/../x", "/"):
        with pytest.raises(ColdSnapError) as e:
            put_back_layer(None, [CapturedFile(path=bad, size=0, mode=0o600, layer=True)], str(new.merged))
        assert e.value.code == ErrorCode.CAPSULE_CORRUPT, bad


def test_a_layer_too_large_is_refused_at_capture_naming_the_largest_file(image, monkeypatch):
    old = image("big")
    with open(old.merged / "tmp" / "huge.bin", "wb") as f:
        f.truncate(3 * 2**20)
    monkeypatch.setenv("COLDSNAP_LAYER_MAX_MIB", "2")
    with pytest.raises(ColdSnapError) as e:
        HeldLayer(str(old.merged), [])
    assert e.value.code == ErrorCode.INVALID_REQUEST and "/tmp/huge.bin" in e.value.message


def test_a_plain_directory_root_has_no_layer(tmp_path):
    assert HeldLayer(str(tmp_path), []).captured() == ([], {})
