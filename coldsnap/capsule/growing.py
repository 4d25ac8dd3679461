"""A blob's partial file while one stream fills it, for a reader that follows it: a restore that pulls its capsule
unpacks the CRIU images while they arrive (coldsnap.flows.staging.UnpackingEarly), instead of after.

Following is only ever a head start: the follower writes into a private directory that is published once the
pull has verified the blob against its digest, and discarded otherwise. Anything but one straight run from the
file's start to its end (a partial resumed from an earlier pull, a restart from byte 0, a broken connection) stops
the follower: the restore then unpacks the verified blob as it would have anyway."""

from __future__ import annotations

import threading
from pathlib import Path


class Growing:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.path: Path | None = None
        self.size = 0
        self.at = 0  # bytes in the file, in order from its start
        self.state = "waiting"  # → "filling" → "whole" | "broken"

    def started(self, path: Path, size: int, offset: int) -> None:
        """The stream begins, `offset` bytes already in the file (an earlier pull's partial: not followed)."""
        with self._cond:
            if self.state == "waiting":
                self.path, self.size, self.state = path, size, "filling" if offset == 0 else "broken"
            else:
                self.state = "broken"  # a second start: a retry
            self._cond.notify_all()

    def wrote(self, at: int) -> None:
        with self._cond:
            self.at = at
            self._cond.notify_all()

    def ended(self, whole: bool) -> None:
        """The stream ended: the file holds the whole blob (size and digest checked), or not."""
        with self._cond:
            if self.state == "filling":
                self.state = "whole" if whole else "broken"
            self._cond.notify_all()

    def broke(self) -> None:
        """Not one straight run any more (or the pull ended without it): whoever follows stops."""
        with self._cond:
            if self.state != "whole":
                self.state = "broken"
            self._cond.notify_all()

    def wait_started(self, timeout: float) -> Path | None:
        """The file, once its stream is filling it from byte 0; None when it is not followed."""
        with self._cond:
            self._cond.wait_for(lambda: self.state != "waiting", timeout)
            return self.path if self.state in ("filling", "whole") else None

    def wait_for(self, n: int, timeout: float = 120.0) -> None:
        """Until the file holds its first n bytes; raises StopFollowing when it never will on this stream."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.at >= n or self.state == "broken", timeout) or self.at < n:
                raise StopFollowing(f"the stream stopped before byte {n}")

    def verified(self, timeout: float = 600.0) -> bool:
        """Whether the stream ended with the whole blob, size and digest checked (waits for its end)."""
        with self._cond:
            self._cond.wait_for(lambda: self.state in ("whole", "broken"), timeout)
            return self.state == "whole"


class StopFollowing(Exception):
    """The followed stream will not bring the file whole: give up, and read the verified blob instead."""
