"""How the CLI shows a long operation on stderr. On a terminal: the step under way with its elapsed time, and a bar
for each blob that moves (bytes, rate, time left), by rich; each finished step stays as a line. Elsewhere (a pipe,
a log, CI): one line per step and one per blob moved, nothing that redraws. With --json: nothing (the receipt on
stdout says it all)."""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, TYPE_CHECKING, cast

if TYPE_CHECKING:  # rich loads only where there is a terminal to draw on (~50 ms a command's start spares)
    from rich.console import Console
    from rich.progress import Progress, TaskID


def _new_bars(console: Console) -> Progress:
    """The bars: the step's spinner and elapsed time; for a blob, its bar, bytes, rate and time left."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        ProgressColumn,
        SpinnerColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    class Transfer(ProgressColumn):
        """Bytes, rate and time left for a blob's bar; nothing for a step (it has no total)."""

        parts = (DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())

        def render(self, task: Task) -> Text:
            if task.total is None:
                return Text("")
            return Text(" ").join(Text(str(p.render(task))) for p in self.parts)

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), Transfer(), TimeElapsedColumn(),
                    console=console, transient=True)


class Shown:
    """A Progress (called with a sentence per step) that also takes transfers: .transfer(blob, done, total), the
    TransferProgress that push and pull report to."""

    def __init__(self, quiet: bool = False, stream: IO[str] | None = None, terminal: bool | None = None):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        live = (self.stream.isatty() if terminal is None else terminal) and not quiet
        self.console: Console | None = None
        if live:
            from rich.console import Console

            self.console = Console(file=self.stream, force_terminal=True, highlight=False)
        self.bars: Progress | None = None
        self.step: TaskID | None = None
        self.blobs: dict[str, tuple[TaskID, float]] = {}  # moving: its bar and when it started
        self.finished: set[str] = set()
        self._lock = threading.RLock()

    def __call__(self, message: str) -> None:
        with self._lock:
            self._step(message)

    def _step(self, message: str) -> None:
        if self.quiet:
            return
        if self.console is not None:  # the step under way, drawn with its elapsed time
            bars = self._bars()
            if self.step is not None:
                bars.remove_task(self.step)
            self.step = bars.add_task(message, total=None)
        self._line(message)

    def transfer(self, blob: str, done: int, total: int) -> None:
        with self._lock:  # blobs move side by side, each reporting from its own threads
            self._transfer(blob, done, total)

    def _transfer(self, blob: str, done: int, total: int) -> None:
        if self.quiet or blob in self.finished:  # a repeated final report adds no line
            return
        if blob not in self.blobs:
            task = self._bars().add_task(f"{blob[:19]}…", total=total) if self.console else cast("TaskID", 0)
            self.blobs[blob] = (task, time.monotonic())
        task, started = self.blobs[blob]
        if self.bars is not None:
            self.bars.update(task, completed=done)
        if done >= total:
            if self.bars is not None:
                self.bars.remove_task(task)
            took = max(time.monotonic() - started, 1e-6)
            self._line(f"moved {blob[:19]}…: {total / 2**20:.1f} MiB in {took:.1f} s ({total / took / 1e6:.0f} MB/s)")
            self.blobs.pop(blob)
            self.finished.add(blob)

    def _line(self, text: str) -> None:
        if self.bars is not None:  # above the bars, which redraw below it
            self.bars.console.print(f"coldsnap: {text}")
        else:
            print(f"coldsnap: {text}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bars is not None:
            self.bars.stop()
            self.bars = None

    def _bars(self) -> Progress:
        if self.bars is None:
            assert self.console is not None
            self.bars = _new_bars(self.console)
            self.bars.start()
        return self.bars
