"""The smallest root filesystem a container of a host engine needs: the host's /usr is bound read-only over it, so
it holds only the bin/lib/lib64/sbin → usr/* links, the empty directories runc mounts on, and root's passwd, group
and hosts entries. Used by the container benchmarks (coldsnap bench --via) and the container tests; and the
OCI archive that brings such a root filesystem into containerd (`ctr images import`)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
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


def pause_rootfs(root: Path) -> tuple[Path, list[str]]:
    """A pod sandbox ("pause") image's root filesystem: the host's static busybox, sleeping (as PID 1 it ignores
    SIGTERM; the CRI plugin stops a sandbox with SIGKILL). Returns (root, the image's Cmd)."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    (root / "bin").mkdir(parents=True, exist_ok=True)
    for d in ("proc", "dev", "sys", "etc", "tmp"):
        (root / d).mkdir(exist_ok=True)
    shutil.copy(busybox, root / "bin" / "busybox")
    return root, ["/bin/busybox", "sleep", "2147483647"]


def oci_archive(rootfs: Path, out: Path, name: str, cmd: list[str] | None = None) -> Path:
    """An OCI image archive (oci-layout, index.json, blobs/) of rootfs as one uncompressed layer, named `name`
    (io.containerd.image.name), for `ctr images import`; cmd: the image's Cmd. Built here: no registry, no other
    engine needed."""

    def blob(tar: tarfile.TarFile, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        info = tarfile.TarInfo(f"blobs/sha256/{digest}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        return digest

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as lt:
        lt.add(rootfs, arcname=".")
    layer_bytes = layer.getvalue()
    with tarfile.open(out, "w") as tar:
        layer_digest = blob(tar, layer_bytes)
        config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": cmd or ["/bin/sh"]},
                             "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]}}).encode()
        config_digest = blob(tar, config)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": f"sha256:{config_digest}",
                       "size": len(config)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": f"sha256:{layer_digest}",
                        "size": len(layer_bytes)}]}).encode()
        manifest_digest = blob(tar, manifest)
        index = {"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": f"sha256:{manifest_digest}",
            "size": len(manifest), "annotations": {"io.containerd.image.name": name,
                                                   "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}}]}
        for fname, data in (("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
                            ("index.json", json.dumps(index).encode())):
            info = tarfile.TarInfo(fname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out
