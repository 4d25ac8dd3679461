"""Where ColdSnap keeps things. One place; every path can be moved with an environment variable."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    home: Path
    store: Path  # local capsule store (OCI image layout)
    run: Path  # per-workload run directories (logs, pidfiles, state)
    receipts: Path
    staged: Path  # capsules unpacked for restore, one directory per capsule digest (coldsnap.flows.staging)
    criu_prefix: Path
    criu_binary: str | None  # explicit CRIU entry point; wins over the prefix

    @property
    def code(self) -> Path:
        """CUDA device code moved out of engines' memory at capture (coldsnap.gpu.codestash), one file per content."""
        return self.home / "code"

    @property
    def criu(self) -> str:
        if self.criu_binary:
            return self.criu_binary
        return str(self.criu_prefix / "bin" / "criu")

    @property
    def pycriu_path(self) -> Path:
        return self.criu_prefix / "pycriu"


def settings() -> Settings:
    home = Path(os.environ.get("COLDSNAP_HOME", "/var/lib/coldsnap"))
    return Settings(
        home=home,
        store=Path(os.environ.get("COLDSNAP_STORE", home / "store")),
        run=Path(os.environ.get("COLDSNAP_RUN", "/run/coldsnap")),
        receipts=Path(os.environ.get("COLDSNAP_RECEIPTS", home / "receipts")),
        staged=Path(os.environ.get("COLDSNAP_STAGED", home / "staged")),
        criu_prefix=Path(os.environ.get("COLDSNAP_CRIU_PREFIX", home / "criu")),
        criu_binary=os.environ.get("COLDSNAP_CRIU") or None,
    )
