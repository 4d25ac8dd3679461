"""Soon: a call started on a thread of its own now, its result asked for later (the restore's work done while its
pull waits on the registry)."""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Soon(Generic[T]):
    """`call` running on a daemon thread named `name`; result() waits for it and returns what it returned, or
    raises what it raised."""

    def __init__(self, call: Callable[[], T], name: str) -> None:
        self._box: dict = {}
        self._thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], T]) -> None:
        try:
            self._box["value"] = call()
        except BaseException as e:  # noqa: BLE001 - raised again where the result is asked for
            self._box["error"] = e

    def result(self) -> T:
        self._thread.join()
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]
