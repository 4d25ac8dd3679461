"""Write the seed corpus of hostile inputs the fuzzers start from (tests/test_fuzz.py replays every file here).

    python tests/fuzz_corpus/make_corpus.py      # rewrites tar/*.tar.zst; the other seeds are plain files

Each tar seed is a tar+zstd layer a malicious or broken capsule could carry."""

import io
import tarfile
from pathlib import Path

import zstandard

HERE = Path(__file__).parent


def layer(name: str, members: list[tuple[tarfile.TarInfo, bytes | None]], raw: bytes | None = None) -> None:
    buf = io.BytesIO()
    if raw is None:
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for info, data in members:
                tar.addfile(info, io.BytesIO(data) if data is not None else None)
        raw = buf.getvalue()
    (HERE / "tar").mkdir(exist_ok=True)
    (HERE / "tar" / f"{name}.tar.zst").write_bytes(zstandard.ZstdCompressor(level=19).compress(raw))


def info(name: str, kind=tarfile.REGTYPE, size: int = 0, link: str = "") -> tarfile.TarInfo:
    i = tarfile.TarInfo(name)
    i.type, i.size, i.linkname, i.mode = kind, size, link, 0o644
    return i


def main() -> None:
    layer("ok", [(info("images", tarfile.DIRTYPE), None), (info("images/core-1.img", size=5), b"hello")])
    layer("absolute", [(info("/tmp/coldsnap-fuzz-escape", size=3), b"bad")])
    layer("dotdot", [(info("images/../../escape", size=3), b"bad")])
    layer("symlink-out", [(info("images/link", tarfile.SYMTYPE, link="/etc"), None),
                          (info("images/link/passwd", size=3), b"bad")])
    layer("hardlink-out", [(info("images/hard", tarfile.LNKTYPE, link="/etc/passwd"), None)])
    layer("device", [(info("images/null", tarfile.CHRTYPE), None)])
    layer("fifo", [(info("images/pipe", tarfile.FIFOTYPE), None)])
    layer("duplicate", [(info("a", size=1), b"1"), (info("a", size=1), b"2")])
    layer("file-then-dir", [(info("a", size=1), b"1"), (info("a/b", size=1), b"2")])
    layer("bomb", [(info("zeros", size=512 << 20), b"\0" * (512 << 20))])  # 512 MiB of zeros in a few KiB
    layer("truncated", [], raw=b"\0" * 100 + b"ustar")
    (HERE / "tar" / "not-zstd.tar.zst").write_bytes(b"PK\x03\x04 a zip, not zstd")


if __name__ == "__main__":
    main()
