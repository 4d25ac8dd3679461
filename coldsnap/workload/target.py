"""Where a container's server answers, and the calls ColdSnap makes to it (probe, engine release/resume).

Default: from inside the container's network namespace (/proc/<pid>/ns/net) to 127.0.0.1:<port>, which works
whatever network the engine set up. When the io.coldsnap.validation annotation names a "host", the server is
reached at host:port from the caller's own namespace instead (e.g. a published port)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from coldsnap.contracts import Validation
from coldsnap.net.enter import call_in_netns
from coldsnap.workload.probe import ProbeResult, ValidationProbe

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Target:
    pid: int  # host PID of the container's init
    port: int
    host: str | None = None

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(host, port, *args) where the server is reachable."""
        if self.host:
            return fn(self.host, self.port, *args)
        return call_in_netns(self.pid, fn, LOOPBACK, self.port, *args)

    def describe(self) -> str:
        if self.host:
            return f"{self.host}:{self.port}"
        return f"{LOOPBACK}:{self.port} in the network namespace of pid {self.pid}"


def _probe(host: str, port: int, validation: Validation, expected: str | None) -> ProbeResult:
    probe = ValidationProbe(host, port, validation)
    probe.wait_ready(timeout=validation.ready_timeout_s)
    return probe.complete(expected=expected)


def validate(target: Target, validation: Validation, expected: str | None) -> ProbeResult:
    """Wait for the health endpoint, then one real completion (equal to expected when given)."""
    return target.call(_probe, validation, expected)
