"""Timing spans: monotonic durations anchored to one wall-clock origin, as receipts record them."""

from __future__ import annotations

import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Iterator

from coldsnap.contracts import Origin, Span


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.origin = Origin(wall_time=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                             monotonic_s=self.t0)
        self.spans: list[Span] = []

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.add(name, start, time.monotonic())

    def add(self, name: str, start_mono: float, end_mono: float) -> None:
        self.spans.append(Span(name=name, start_s=round(start_mono - self.t0, 6),
                               duration_s=round(end_mono - start_mono, 6)))
