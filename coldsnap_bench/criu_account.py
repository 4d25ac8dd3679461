"""Where a dump's bytes are: the pages CRIU stored, per process and per mapping (file name or anonymous).

    python -m coldsnap_bench.criu_account IMAGES_DIR [--top N] [--zeros] [--json]

Used to decide what to shrink (a capsule's size and its restore time follow the pages stored)."""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

PAGE = 4096
PE_PRESENT = 4  # pagemap entry flag: the pages are in pages-N.img (not zero, not lazy, not in a parent)


def _load(path: Path) -> dict:
    from coldsnap.criu.driver import _pycriu

    with open(path, "rb") as f:
        return _pycriu().images.load(f)


def _file_names(images: Path) -> dict[int, str]:
    names = {}
    files = images / "files.img"
    if files.exists():
        for e in _load(files)["entries"]:
            reg = e.get("reg")
            if reg:
                names[int(e["id"])] = reg["name"]
    return names


ZERO_PAGE = bytes(PAGE)


def _zero_pages(pages, offset: int, nbytes: int) -> int:
    """How many of the nbytes stored at offset in a pages-N.img are all-zero pages (restore could skip them)."""
    pages.seek(offset)
    data = memoryview(pages.read(nbytes))
    return sum(1 for at in range(0, len(data), PAGE) if data[at : at + PAGE] == ZERO_PAGE)


MADV_DONTFORK, MADV_HUGEPAGE = 10, 14  # bit numbers in CRIU's vma.madv (1 << advice)


def _anon_name(vma: dict) -> str:
    """An anonymous mapping by size, address and the hints that tell whose it is: MADV_DONTFORK is what the CUDA
    driver sets on the host memory it pins (cudaHostAlloc), for one."""
    start, end = int(vma["start"]), int(vma["end"])
    hints = []
    try:
        madv = int(vma.get("madv", 0) or 0)
        hints += [h for bit, h in ((MADV_DONTFORK, "dontfork"), (MADV_HUGEPAGE, "hugepage")) if madv >> bit & 1]
    except (TypeError, ValueError):  # a pretty-printed image: show it as it is
        hints.append(f"madv={vma.get('madv')}")
    return f"anon {end - start >> 20} MiB mapping at {start:#x}" + (f" [{' '.join(hints)}]" if hints else "")


def account(images: Path, zeros: bool = False) -> dict:
    names = _file_names(images)
    out: dict[str, Any] = {"processes": [], "total_bytes": 0}
    for item in _load(images / "pstree.img")["entries"]:
        pid = int(item["pid"])
        mm_path, pm_path = images / f"mm-{pid}.img", images / f"pagemap-{pid}.img"
        if not (mm_path.exists() and pm_path.exists()):
            continue
        vmas = sorted(_load(mm_path)["entries"][0].get("vmas", []), key=lambda v: int(v["start"]))
        starts = [int(v["start"]) for v in vmas]
        by_vma: dict[str, int] = defaultdict(int)
        zero_by_vma: dict[str, int] = defaultdict(int)
        total = offset = 0
        entries = _load(pm_path)["entries"]
        pages = open(images / f"pages-{int(entries[0]['pages_id'])}.img", "rb") if zeros else None
        for e in entries[1:]:
            if not int(e.get("flags", 0)) & PE_PRESENT:
                continue
            nbytes = int(e["nr_pages"]) * PAGE
            total += nbytes
            i = bisect.bisect_right(starts, int(e["vaddr"])) - 1
            vma = vmas[i] if i >= 0 else None
            if vma is None:
                key = "?"
            else:
                shmid = int(vma.get("shmid", 0))
                key = names.get(shmid) or _anon_name(vma)
            by_vma[key] += nbytes
            if pages:
                zero_by_vma[key] += _zero_pages(pages, offset, nbytes) * PAGE
            offset += nbytes
        if pages:
            pages.close()
        top = sorted(by_vma.items(), key=lambda kv: -kv[1])
        mappings = [{"name": k, "bytes": v} | ({"zero_bytes": zero_by_vma[k]} if zeros else {}) for k, v in top]
        proc = {"pid": pid, "bytes": total, "mappings": mappings}
        if zeros:
            proc["zero_bytes"] = sum(zero_by_vma.values())
        out["processes"].append(proc)
        out["total_bytes"] += total
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coldsnap_bench.criu_account", description=__doc__.split("\n\n")[0])
    p.add_argument("images", type=Path)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--zeros", action="store_true", help="also count all-zero pages (reads every stored page)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not (args.images / "pstree.img").exists():
        print(f"coldsnap: error: {args.images} holds no CRIU images (no pstree.img)", file=sys.stderr)
        return 2
    data = account(args.images, zeros=args.zeros)
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    print(f"{data['total_bytes'] / 2**20:.0f} MiB of pages in {len(data['processes'])} process(es)")
    for proc in data["processes"]:
        zero = f" ({proc['zero_bytes'] / 2**20:.0f} MiB all-zero pages)" if args.zeros else ""
        print(f"  pid {proc['pid']}: {proc['bytes'] / 2**20:.0f} MiB{zero}")
        for m in proc["mappings"][: args.top]:
            zero = f"  ({m['zero_bytes'] / 2**20:.1f} MiB zero)" if args.zeros else ""
            print(f"    {m['bytes'] / 2**20:9.1f} MiB  {m['name']}{zero}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
