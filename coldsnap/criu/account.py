"""Where a dump's bytes are: the pages CRIU stored, per process and per mapping (file name or anonymous).

    python -m coldsnap.criu.account IMAGES_DIR [--top N] [--json]

Used to decide what to shrink (a capsule's size and its restore time follow the pages stored)."""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict
from pathlib import Path

PAGE = 4096
PE_PRESENT = 4  # pagemap entry flag: the pages are in pages-N.img (not zero, not lazy, not in a parent)


def _load(path: Path) -> dict:
    from .driver import _pycriu

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


def account(images: Path) -> dict:
    names = _file_names(images)
    out = {"processes": [], "total_bytes": 0}
    for item in _load(images / "pstree.img")["entries"]:
        pid = int(item["pid"])
        mm_path, pm_path = images / f"mm-{pid}.img", images / f"pagemap-{pid}.img"
        if not (mm_path.exists() and pm_path.exists()):
            continue
        vmas = sorted(_load(mm_path)["entries"][0].get("vmas", []), key=lambda v: int(v["start"]))
        starts = [int(v["start"]) for v in vmas]
        by_vma: dict[str, int] = defaultdict(int)
        total = 0
        for e in _load(pm_path)["entries"][1:]:
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
                key = names.get(shmid) or f"anon {int(vma['end']) - int(vma['start']) >> 20} MiB mapping"
            by_vma[key] += nbytes
        top = sorted(by_vma.items(), key=lambda kv: -kv[1])
        out["processes"].append({"pid": pid, "bytes": total, "mappings": [{"name": k, "bytes": v} for k, v in top]})
        out["total_bytes"] += total
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coldsnap.criu.account", description=__doc__.split("\n\n")[0])
    p.add_argument("images", type=Path)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not (args.images / "pstree.img").exists():
        print(f"coldsnap: error: {args.images} holds no CRIU images (no pstree.img)", file=sys.stderr)
        return 2
    data = account(args.images)
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    print(f"{data['total_bytes'] / 2**20:.0f} MiB of pages in {len(data['processes'])} process(es)")
    for proc in data["processes"]:
        print(f"  pid {proc['pid']}: {proc['bytes'] / 2**20:.0f} MiB")
        for m in proc["mappings"][: args.top]:
            print(f"    {m['bytes'] / 2**20:9.1f} MiB  {m['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
