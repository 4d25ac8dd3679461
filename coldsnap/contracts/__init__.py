"""Contracts: pydantic models and constants only. No I/O; imports nothing else of ColdSnap."""

from .base import FORMAT_VERSION, Strict, canonical_json, sha256_hex
from .errors import EXIT_CODES, ColdSnapError, ErrorCode
from .profile import Capabilities, CapsuleProfile, CapturedFile, Distributed, GpuInfo, HostProfile, NetworkPlan
from .receipt import ErrorInfo, Origin, Receipt, Span
from .request import (
    OPERATIONS,
    REQUEST_ADAPTER,
    CaptureRequest,
    Engine,
    Launch,
    Lifecycle,
    Model,
    Mount,
    Policy,
    RestoreRequest,
    Validation,
    WeightFile,
    WorkloadRequest,
)
from .parse import parse_request

SCHEMAS = {
    "capture-request": CaptureRequest,
    "restore-request": RestoreRequest,
    "workload-request": WorkloadRequest,
    "receipt": Receipt,
    "capsule-profile": CapsuleProfile,
    "capabilities": Capabilities,
}

__all__ = [name for name in dir() if not name.startswith("_")]
