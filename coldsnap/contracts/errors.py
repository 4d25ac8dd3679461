"""Stable error codes: the contract between ColdSnap and whatever automates it.

Every failure that crosses a floor is a ColdSnapError carrying one of these codes. Entry points turn it into
a one-line message and the code's exit status; receipts carry the code string."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coldsnap.contracts.receipt import Receipt


class ErrorCode(str, Enum):
    INVALID_REQUEST = "invalid-request"
    CAPSULE_NOT_FOUND = "capsule-not-found"
    CAPSULE_CORRUPT = "capsule-corrupt"
    CAPSULE_UNPINNED = "capsule-unpinned"
    INCOMPATIBLE = "incompatible"
    RESOURCE_BUSY = "resource-busy"
    CRIU_FAILED = "criu-failed"
    GPU_FAILED = "gpu-failed"
    WORKLOAD_FAILED = "workload-failed"
    VALIDATION_FAILED = "validation-failed"
    VALIDATION_TIMEOUT = "validation-timeout"
    ENVIRONMENT = "environment"
    REGISTRY = "registry"
    RUNTIME = "runtime"
    UNTRUSTED = "untrusted"
    INTERNAL = "internal"


EXIT_CODES: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 2,
    ErrorCode.CAPSULE_NOT_FOUND: 3,
    ErrorCode.CAPSULE_CORRUPT: 4,
    ErrorCode.CAPSULE_UNPINNED: 4,
    ErrorCode.INCOMPATIBLE: 5,
    ErrorCode.RESOURCE_BUSY: 6,
    ErrorCode.CRIU_FAILED: 7,
    ErrorCode.GPU_FAILED: 8,
    ErrorCode.WORKLOAD_FAILED: 9,
    ErrorCode.VALIDATION_FAILED: 10,
    ErrorCode.VALIDATION_TIMEOUT: 11,
    ErrorCode.ENVIRONMENT: 12,
    ErrorCode.REGISTRY: 13,
    ErrorCode.RUNTIME: 14,
    ErrorCode.UNTRUSTED: 15,
    ErrorCode.INTERNAL: 70,
}


class ColdSnapError(Exception):
    """A failure with a stable code and a sentence a user can act on. An error that ended an operation carries the
    operation's receipt (written already), so an entry point can print it."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
        self.receipt: Receipt | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.code]

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"
