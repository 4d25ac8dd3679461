"""Drop all-zero pages from a CRIU dump: fewer bytes to store, ship and restore.

CRIU stores every private page that was ever written, including pages that hold only zeros (a zero-initialised
KV cache, the CUDA driver's host copy of freshly allocated device memory: 900 of 1550 MiB in one GPU capsule). On
restore a private anonymous mapping starts zero-filled and CRIU writes only the pages its pagemap lists, so leaving
a zero page out of the pagemap restores the same bytes without reading or faulting it in one by one.

Only private anonymous mappings are thinned: in a private file mapping a missing page means "the file's bytes", and
special areas (vDSO, AIO rings, shadow stacks, plugin-restored ones) are left as CRIU wrote them. Dumps that point
at a parent (pre-dump chains) are left alone as well. Each pagemap and pages file is rewritten next to itself and
renamed over the original, so an interrupted run leaves a valid dump."""

from __future__ import annotations

import bisect
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

PAGE = 4096
ZERO_PAGE = bytes(PAGE)
WORTH_REWRITING = 8 << 20  # and 5% of the file: below that, thinning is not worth rewriting the pages

# CRIU's VmaEntry.status bits (criu/include/image.h)
VMA_AREA_REGULAR = 1 << 0
VMA_AREA_VSYSCALL = 1 << 2
VMA_AREA_VDSO = 1 << 3
VMA_ANON_PRIVATE = 1 << 9
VMA_AREA_VVAR = 1 << 12
VMA_AREA_AIORING = 1 << 13
VMA_AREA_SHSTK = 1 << 15
VMA_AREA_UPROBES = 1 << 17
VMA_EXT_PLUGIN = 1 << 27
_SPECIAL = VMA_AREA_VSYSCALL | VMA_AREA_VDSO | VMA_AREA_VVAR | VMA_AREA_AIORING | VMA_AREA_SHSTK | VMA_AREA_UPROBES \
    | VMA_EXT_PLUGIN
PE_PRESENT = 1 << 2


@dataclass
class Thinned:
    """What drop_zero_pages did: bytes of pages before and after, over how many processes, in how long."""

    bytes_before: int = 0
    bytes_after: int = 0
    processes: int = 0
    seconds: float = 0.0

    @property
    def dropped(self) -> int:
        return self.bytes_before - self.bytes_after

    @property
    def summary(self) -> str:
        if not self.dropped:
            return "no zero pages worth dropping"
        return (f"dropped {self.dropped / 2**20:.0f} MiB of zero pages ({self.bytes_before / 2**20:.0f} -> "
                f"{self.bytes_after / 2**20:.0f} MiB to restore)")

    def as_dict(self) -> dict:
        return {"bytes_before": self.bytes_before, "bytes_after": self.bytes_after, "zero_bytes_dropped": self.dropped,
                "processes": self.processes, "seconds": round(self.seconds, 3)}


def _thinnable(vma: dict) -> bool:
    status = int(vma.get("status", 0))
    return bool(status & VMA_AREA_REGULAR and status & VMA_ANON_PRIVATE and not status & _SPECIAL)


def _zero_page_flags(pages: mmap.mmap, offset: int, count: int) -> list[bool]:
    # Compared in place through the page cache: a page with data differs at its first bytes, so the scan costs
    # about as much as the zero pages it finds, never a copy of the whole file.
    with memoryview(pages) as view:
        return [view[at : at + PAGE] == ZERO_PAGE for at in range(offset, offset + count * PAGE, PAGE)]


Run = tuple[int, int]  # (offset, length) in a pages file


def _plan(entries: list[dict], spans: list[Run], pages: mmap.mmap) -> tuple[list[dict], list[Run]]:
    """The thinned pagemap entries and the (offset, length) runs of the pages file they keep, in order."""
    starts = [lo for lo, _ in spans]
    current = [0, 0]  # the thinnable span last found: consecutive pages almost always fall in it

    def thinnable(vaddr: int) -> bool:
        if current[0] <= vaddr < current[1]:
            return True
        i = bisect.bisect_right(starts, vaddr) - 1
        if i >= 0 and vaddr < spans[i][1]:
            current[:] = spans[i]
            return True
        return False

    kept_entries: list[dict] = []
    runs: list[Run] = []
    offset = 0
    for e in entries:
        flags, vaddr, n = int(e.get("flags", 0)), int(e["vaddr"]), int(e["nr_pages"])
        if not flags & PE_PRESENT:
            kept_entries.append(e)
            continue
        if offset + n * PAGE > len(pages):
            raise ValueError("the pages file is shorter than its pagemap says")
        zero = _zero_page_flags(pages, offset, n)
        first = None  # first page of the run being kept
        for i in range(n + 1):
            keep = i < n and not (zero[i] and thinnable(vaddr + i * PAGE))
            if keep and first is None:
                first = i
            elif not keep and first is not None:
                kept_entries.append({**e, "vaddr": vaddr + first * PAGE, "nr_pages": i - first})
                at, length = offset + first * PAGE, (i - first) * PAGE
                if runs and runs[-1][0] + runs[-1][1] == at:
                    runs[-1] = (runs[-1][0], runs[-1][1] + length)
                else:
                    runs.append((at, length))
                first = None
        offset += n * PAGE
    return kept_entries, runs


def _copy_runs(src: int, dst: int, runs: list[Run]) -> None:
    for at, length in runs:
        while length:
            moved = os.copy_file_range(src, dst, length, at)
            if moved <= 0:
                raise OSError("copy_file_range stopped short")
            at, length = at + moved, length - moved


def _thin_process(images: Path, pid: int, pycriu) -> tuple[int, int]:
    """Rewrite one process's pagemap and pages file without its zero pages; returns (bytes before, bytes after)."""
    mm_path, pm_path = images / f"mm-{pid}.img", images / f"pagemap-{pid}.img"
    if not (mm_path.exists() and pm_path.exists()):
        return 0, 0
    with open(mm_path, "rb") as f:
        spans = sorted((int(v["start"]), int(v["end"]))
                       for v in pycriu.images.load(f)["entries"][0].get("vmas", []) if _thinnable(v))
    with open(pm_path, "rb") as f:
        pagemap = pycriu.images.load(f)
    head, entries = pagemap["entries"][0], pagemap["entries"][1:]
    pages_path = images / f"pages-{int(head['pages_id'])}.img"
    before = pages_path.stat().st_size
    if not spans or before == 0:
        return before, before
    with open(pages_path, "rb") as src:
        with mmap.mmap(src.fileno(), before, prot=mmap.PROT_READ) as pages:
            kept_entries, runs = _plan(entries, spans, pages)
        after = sum(length for _, length in runs)
        if before - after < max(WORTH_REWRITING, before // 20):
            return before, before  # too little to gain for a rewrite
        tmp_pages, tmp_map = pages_path.with_suffix(".thin"), pm_path.with_suffix(".thin")
        with open(tmp_pages, "wb") as dst:
            os.fchmod(dst.fileno(), os.stat(pages_path).st_mode & 0o777)
            _copy_runs(src.fileno(), dst.fileno(), runs)
    with open(tmp_map, "wb") as f:
        os.fchmod(f.fileno(), os.stat(pm_path).st_mode & 0o777)
        pycriu.images.dump({"magic": pagemap["magic"], "entries": [head] + kept_entries}, f)
    # Between these two renames the dump is inconsistent: callers thin a dump they have not packed yet and discard
    # it when anything fails, so no capsule is ever made from a half-thinned dump.
    os.replace(tmp_pages, pages_path)
    os.replace(tmp_map, pm_path)
    return before, after


def drop_zero_pages(images: Path) -> Thinned:
    """Thin every process of a dump in `images`; a dump with a parent (pre-dump chain) is left as it is."""
    from coldsnap.criu.driver import _pycriu

    started = time.monotonic()
    result = Thinned()
    if (images / "parent").exists():
        return result
    pycriu = _pycriu()
    with open(images / "pstree.img", "rb") as f:
        pids = [int(item["pid"]) for item in pycriu.images.load(f)["entries"]]
    for pid in pids:
        before, after = _thin_process(images, pid, pycriu)
        result.bytes_before += before
        result.bytes_after += after
        result.processes += 1
    result.seconds = time.monotonic() - started
    return result
