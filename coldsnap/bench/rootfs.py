"""The smallest root filesystem a container of a host engine needs: the host's /usr is bound read-only over it, so
it holds only the bin/lib/lib64/sbin → usr/* links, the empty directories runc mounts on, and root's passwd, group
and hosts entries. Used by the container benchmarks (coldsnap bench --via) and the container tests."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

MOUNT_POINTS = ("usr", "proc", "sys", "dev", "tmp", "etc", "root", "models", "run")


def host_usr_rootfs(root: Path, extra_dirs: Iterable[str] = ()) -> Path:
    """Make (idempotently) that root filesystem at root, with extra_dirs as more mount points; returns root."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("bin", "lib", "lib64", "sbin"):
        if (Path("/usr") / name).exists() and not (root / name).is_symlink() and not (root / name).exists():
            (root / name).symlink_to(f"usr/{name}")
    for d in (*MOUNT_POINTS, *(d.strip("/") for d in extra_dirs)):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    (root / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    return root
