"""Receipts: the machine-readable record of one operation, written whatever the outcome."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import Field, field_serializer, model_validator

from coldsnap.contracts.base import FORMAT_VERSION, Strict
from coldsnap.contracts.errors import ErrorCode
from coldsnap.contracts.results import RESULTS, CaptureFacts, Operation, RestoreFacts, Result, SleepFacts, WakeFacts

F = TypeVar("F", CaptureFacts, RestoreFacts, SleepFacts, WakeFacts)

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
    operation: Operation
    operation_id: str
    request_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    state: State
    origin: Origin
    spans: list[Span] = Field(default_factory=list)
    result: Result | None = Field(
        default=None, description="What the operation did: the model its operation names (contracts.results).")
    error: ErrorInfo | None = None
    coldsnap_version: str

    @model_validator(mode="before")
    @classmethod
    def _result_of_its_operation(cls, data: Any) -> Any:
        """A result read back from JSON is the model of the receipt's own operation, never a guess among four."""
        if isinstance(data, dict) and isinstance(data.get("result"), dict) and data.get("operation") in RESULTS:
            data = {**data, "result": RESULTS[data["operation"]].model_validate(data["result"], strict=False)}
        return data

    def facts(self, model: type[F]) -> F:
        """The result, as the model this receipt's operation has: asking a restore's receipt for capture facts (or
        one without a result) is a bug, said here rather than as a missing attribute later."""
        if not isinstance(self.result, model):
            raise TypeError(f"a {self.operation} receipt ({self.state}) has no {model.__name__}")
        return self.result

    @field_serializer("result")
    def _result_without_nones(self, result: Any) -> Any:
        return result.model_dump(mode="json", exclude_none=True) if result is not None else None
