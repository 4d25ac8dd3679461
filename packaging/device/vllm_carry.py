#!/usr/bin/env python3
"""Build the carry that puts vLLM's CUDA build on the GPU machine, reproducibly, from PyPI wheels.

The GPU machine has CPython 3.12 with torch 2.11.0 (CUDA 13.0) and no network; vLLM 0.20–0.26 pin exactly that
torch. A device call carries at most 64 MiB, so the carry is vLLM 0.26.0 trimmed to what an H200 (sm90) needs plus
the 32 small wheels its serve path imports beyond the machine's packages:

  1. download every wheel in vllm-carry.lock (pip, --no-deps) and check each file's sha256 against the lock;
  2. trim the vLLM wheel: drop the extensions a dense model on Hopper never loads (FlashAttention 2 for sm80, MoE,
     FlashMLA, QuTLASS, DeepGEMM, the sm100 FMHA, the opt-in Rust front end) and zero the non-sm90 GPU images in
     `_C_stable_libtorch.abi3.so` (its file layout unchanged; the sm90 ELF, else the newest PTX ≤ sm90, stays);
     RECORD is written anew, every entry stored uncompressed so the outer xz compresses the whole;
  3. pack the wheels into OUT/vllm-carry.tar.xz (fixed order and times: the same inputs give the same bytes) with
     install.sh beside it; with --keep-untrimmed-c, the untrimmed `_C` library too, as a second chunk.

    python3 packaging/device/vllm_carry.py [--out .carry/vllm-gpu] [--cache .carry/cache]

On the GPU machine: `bash .carry/vllm-gpu/install.sh /tmp/vllm-site` then PYTHONPATH=/tmp/vllm-site (the vLLM
adapter finds it through COLDSNAP_VLLM_CUDA_SITE). Stdlib only, and pip."""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import lzma
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from fnmatch import fnmatch
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCK = HERE / "vllm-carry.lock"
TRIM_BUILD_TAG = "0coldsnaptrim"
# Members of the vLLM wheel a dense model on an H200 never loads (MANIFEST of the carry that served there).
DROP = ("vllm/vllm_flash_attn/_vllm_fa2_C*", "vllm/_moe_C*", "vllm/_flashmla*_C*", "vllm/_qutlass_C*",
        "vllm/third_party/deep_gemm/*", "vllm/third_party/fmha_sm100/*", "*/vllm-rs", "vllm/vllm-rs*")
FATBIN_LIBRARY = "vllm/_C_stable_libtorch.abi3.so"
TARGET_ARCH = 90
FIXED_TIME = (2026, 1, 1, 0, 0, 0)


def log(msg: str) -> None:
    print(f"vllm-carry: {msg}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def read_lock() -> dict[str, str]:
    out = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, digest = line.split()
            out[name] = digest
    return out


def requirement(filename: str) -> str:
    """'pyzmq-27.3.0-cp312-abi3-….whl' → 'pyzmq==27.3.0'."""
    name, version = filename.split("-")[:2]
    return f"{name}=={version}"


def tags(filename: str) -> tuple[set[str], set[str]]:
    """The (abi, platform) tags a wheel file name carries."""
    parts = filename.removesuffix(".whl").split("-")
    return set(parts[-2].split(".")), set(parts[-1].split("."))


def download(lock: dict[str, str], cache: Path) -> dict[str, Path]:
    cache.mkdir(parents=True, exist_ok=True)
    missing = [f for f, d in lock.items() if not (cache / f).exists() or sha256(cache / f) != d]
    if missing:
        abis, platforms = set(), set()
        for f in missing:
            a, p = tags(f)
            abis |= a
            platforms |= p
        log(f"downloading {len(missing)} wheel(s) with pip")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "-d", str(cache),
               *(a for abi in sorted(abis) for a in ("--abi", abi)),
               *(a for plat in sorted(platforms) for a in ("--platform", plat)),
               *sorted({requirement(f) for f in missing})]
        subprocess.run(cmd, check=True)
    wheels = {}
    for f, digest in lock.items():
        path = cache / f
        if not path.exists():
            raise SystemExit(f"vllm-carry: pip did not bring {f} (another build of {requirement(f)}?)")
        if sha256(path) != digest:
            raise SystemExit(f"vllm-carry: {f} has sha256 {sha256(path)}, the lock says {digest}")
        wheels[f] = path
    return wheels


# --- trimming the GPU images of one library --------------------------------------------------------------------
def section(elf: bytes, wanted: str) -> tuple[int, int]:
    """(file offset, size) of an ELF64 section by name."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        return name, offset, size

    _, str_off, _ = header(shstrndx)
    for i in range(shnum):
        name, offset, size = header(i)
        end = elf.index(b"\0", str_off + name)
        if elf[str_off + name:end].decode() == wanted:
            return offset, size
    raise SystemExit(f"vllm-carry: no {wanted} section")


def keep_only_arch(elf: bytes, arch: int = TARGET_ARCH) -> tuple[bytes, int, int]:
    """Zero the payload of every GPU image in .nv_fatbin but, per fat binary, the sm_<arch> ELF (else the newest
    PTX at or below it). Returns (new bytes, bytes kept, bytes zeroed)."""
    base, size = section(elf, ".nv_fatbin")
    data, out = elf[base:base + size], bytearray(elf)
    off, kept, dropped = 0, 0, 0
    while off < len(data):
        magic, _ver, header_size, fat_size = struct.unpack_from("<IHHQ", data, off)
        if magic != 0xBA55ED50:
            off += 8
            continue
        p, end, entries = off + header_size, off + header_size + fat_size, []
        while p < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, p)
            entry_arch, = struct.unpack_from("<I", data, p + 28)
            entries.append((kind, entry_arch, base + p + entry_header, payload))
            p += entry_header + payload
        keep = [e for e in entries if e[0] == 2 and e[1] == arch]
        if not keep:  # no sm90 ELF: the newest PTX the driver can compile for sm90; none: nothing runs here anyway
            ptx = [e for e in entries if e[0] == 1 and e[1] <= arch]
            keep = [max(ptx, key=lambda e: e[1])] if ptx else []
        for e in entries:
            if e in keep:
                kept += e[3]
            else:
                out[e[2]:e[2] + e[3]] = bytes(e[3])
                dropped += e[3]
        off = end
    return bytes(out), kept, dropped


# --- the trimmed wheel -----------------------------------------------------------------------------------------
def record_line(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def trim_wheel(src: Path, dest_dir: Path) -> tuple[Path, bytes]:
    """The trimmed vLLM wheel (every entry stored) and the untrimmed _C library's bytes."""
    name, version, *rest = src.name.removesuffix(".whl").split("-")
    dest = dest_dir / ("-".join([name, version, TRIM_BUILD_TAG, *rest]) + ".whl")
    original_c = b""
    with zipfile.ZipFile(src) as zin:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        members, rows = [], []
        for info in zin.infolist():
            if info.filename == record_name or any(fnmatch(info.filename, pat) for pat in DROP):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/WHEEL"):  # the tags its new file name says, and the build tag
                lines = [x for x in data.decode().splitlines() if x and not x.startswith(("Tag:", "Build:"))]
                data = "\n".join([*lines, f"Tag: {'-'.join(rest)}", f"Build: {TRIM_BUILD_TAG}", "", ""]).encode()
            if info.filename == FATBIN_LIBRARY:
                original_c = data
                data, kept, dropped = keep_only_arch(data)
                log(f"{FATBIN_LIBRARY}: sm{TARGET_ARCH} images {kept / 1e6:.1f} MB kept, {dropped / 1e6:.1f} MB "
                    "zeroed")
            members.append((info, data))
            rows.append(record_line(info.filename, data))
    rows.append([record_name, "", ""])
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    tmp = dest.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
        for info, data in [*members, (zipfile.ZipInfo(record_name, FIXED_TIME), text.getvalue().encode())]:
            out = zipfile.ZipInfo(info.filename, FIXED_TIME)
            out.external_attr = info.external_attr
            zout.writestr(out, data)
    tmp.replace(dest)
    return dest, original_c


def stored(src: Path, dest_dir: Path) -> Path:
    """A dependency wheel rewritten with stored entries (the same files, the same RECORD)."""
    dest = dest_dir / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            out = zipfile.ZipInfo(info.filename, FIXED_TIME)
            out.external_attr = info.external_attr
            zout.writestr(out, zin.read(info))
    return dest


def pack(files: list[Path], archive: Path) -> None:
    tmp = archive.with_suffix(".tmp")
    with lzma.open(tmp, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(files, key=lambda p: p.name):
            info = tar.gettarinfo(str(path), arcname=f"wheels/{path.name}")
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)
    tmp.replace(archive)


INSTALL = r"""#!/bin/bash
# Install the carried vLLM (CUDA build, trimmed for sm90) into TARGET: bash install.sh [TARGET]  (default
# /tmp/vllm-site), then PYTHONPATH=TARGET. Made by packaging/device/vllm_carry.py; stdlib and pip only.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
T=${1:-/tmp/vllm-site}
X=$(mktemp -d)
trap 'rm -rf "$X"' EXIT
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
    "$HERE/vllm-carry.tar.xz" "$X"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$T" "$X"/wheels/*.whl
if [ -f "$HERE/_C_stable_libtorch.abi3.so.xz" ]; then  # the untrimmed library, when carried as a second chunk
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    "$HERE/_C_stable_libtorch.abi3.so.xz" "$T/vllm/_C_stable_libtorch.abi3.so"
fi
echo "vLLM installed in $T"
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".carry/vllm-gpu"))
    ap.add_argument("--cache", type=Path, default=Path(".carry/cache"))
    ap.add_argument("--keep-untrimmed-c", action="store_true",
                    help="also write the untrimmed _C library (xz) as a second chunk")
    args = ap.parse_args()
    wheels = download(read_lock(), args.cache)
    work = args.cache / "stored"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    vllm = next(p for f, p in wheels.items() if f.startswith("vllm-"))
    trimmed, original_c = trim_wheel(vllm, work)
    files = [trimmed, *(stored(p, work) for f, p in wheels.items() if p is not vllm)]
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"packing {len(files)} wheels ({sum(p.stat().st_size for p in files) / 2**20:.0f} MiB stored) with xz")
    pack(files, args.out / "vllm-carry.tar.xz")
    (args.out / "install.sh").write_text(INSTALL)
    if args.keep_untrimmed_c:
        with lzma.open(args.out / "_C_stable_libtorch.abi3.so.xz", "wb", preset=6) as f:
            f.write(original_c)
    shutil.rmtree(work)
    for p in sorted(args.out.iterdir()):
        print(f"{sha256(p)}  {p}  {p.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
