"""Make PyPI's torchvision (a CUDA build) importable next to the CPU build of torch.

    python torchvision_guard.py VENV

torchvision's compiled ops (_C) do not load against a CPU torch, and its __init__ then fails while registering
meta/autograd kernels for those ops. This edit imports the two registration modules only when the ops loaded;
everything else in torchvision (what transformers and SGLang import) works without them. Idempotent."""

import re
import sys
from pathlib import Path

MARK = "# coldsnap: op registrations only with compiled ops"


def patch(init: Path) -> bool:
    text = init.read_text()
    if MARK in text:
        return False
    names = ("_autograd_registrations", "_meta_registrations")
    block = re.search(r"from torchvision import \((?P<body>[^)]*)\)", text)
    if not block or not all(n in block.group("body") for n in names):
        raise SystemExit(f"{init}: unexpected layout, not patched")
    body = block.group("body")
    for n in names:
        body = re.sub(rf"\s*{n},", "", body)
    guarded = (f"if extension._has_ops():  {MARK}\n"
               f"    from torchvision import {', '.join(names)}  # noqa: F401\n"
               f"from torchvision import ({body})")
    init.write_text(text[:block.start()] + guarded + text[block.end():])
    return True


def main() -> None:
    venv = Path(sys.argv[1])
    inits = sorted(venv.glob("lib/python3*/site-packages/torchvision/__init__.py"))
    if not inits:
        raise SystemExit(f"no torchvision in {venv}")
    print(f"torchvision guard: {'patched' if patch(inits[0]) else 'already patched'} {inits[0]}")


if __name__ == "__main__":
    main()
