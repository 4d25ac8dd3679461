"""How a long operation says what it is doing: one sentence at a time (Progress), and, for a transfer, its bytes
(TransferProgress). The entry points choose where it goes (the CLI: stderr; --json: still stderr, one line each)."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]
TransferProgress = Callable[[str, int, int], None]  # (digest, bytes done, bytes total)


def quiet(_: str) -> None:
    """Progress that goes nowhere."""
