"""Receipts: the machine-readable record of one operation, written whatever the outcome."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from coldsnap.contracts.base import FORMAT_VERSION, Strict
from coldsnap.contracts.errors import ErrorCode

State = Literal["succeeded", "failed", "refused", "fell-back"]


class Span(Strict):
    name: str
    start_s: float = Field(description="Seconds since the receipt's monotonic origin.")
    duration_s: float


class Origin(Strict):
    wall_time: str = Field(description="ISO-8601 UTC wall-clock time at monotonic 0.")
    monotonic_s: float = Field(description="time.monotonic() at the origin, on the host that ran the operation.")


class ErrorInfo(Strict):
    code: ErrorCode = Field(strict=False)  # the code's string, as JSON carries it
    message: str
    exit_code: int | None = Field(default=None, description="The exit status the CLI ends with for this code.")


class Receipt(Strict):
    format: Literal[1] = FORMAT_VERSION
    kind: Literal["coldsnap.receipt"] = "coldsnap.receipt"
    operation: str
    operation_id: str
    request_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    state: State
    origin: Origin
    spans: list[Span] = Field(default_factory=list)
    result: dict[str, Any] = Field(default_factory=dict)
    error: ErrorInfo | None = None
    coldsnap_version: str
