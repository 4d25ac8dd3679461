"""Contracts: pydantic models and constants only. No I/O; imports nothing else of ColdSnap."""

from pydantic import BaseModel

from coldsnap.contracts.base import FORMAT_VERSION, Strict, canonical_json, sha256_hex
from coldsnap.contracts.engine import EngineRelease
from coldsnap.contracts.errors import EXIT_CODES, ColdSnapError, ErrorCode
from coldsnap.contracts.parse import parse_request
from coldsnap.contracts.profile import (
    Capabilities,
    CapsuleProfile,
    CapturedFile,
    ContainerLaunch,
    ContainerMount,
    Distributed,
    GpuInfo,
    HostProfile,
    NetworkPlan,
)
from coldsnap.contracts.receipt import ErrorInfo, Origin, Receipt, Span
from coldsnap.contracts.request import (
    ENGINE_NAMES,
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
from coldsnap.contracts.trust import ContainerRule, RestorePolicy, TrustRule

SCHEMAS: dict[str, type[BaseModel]] = {
    "capture-request": CaptureRequest,
    "restore-request": RestoreRequest,
    "workload-request": WorkloadRequest,
    "receipt": Receipt,
    "capsule-profile": CapsuleProfile,
    "capabilities": Capabilities,
    "policy": RestorePolicy,
    "engine-release": EngineRelease,
}

__all__ = ["ENGINE_NAMES", "Capabilities", "CapsuleProfile", "CaptureRequest", "CapturedFile", "ContainerLaunch",
           "ContainerRule", "ContainerMount", "ColdSnapError", "Distributed", "EXIT_CODES", "Engine", "EngineRelease",
           "ErrorCode", "ErrorInfo", "FORMAT_VERSION", "GpuInfo", "HostProfile", "Launch", "Lifecycle", "Model",
           "Mount", "NetworkPlan", "OPERATIONS", "Origin", "Policy", "REQUEST_ADAPTER", "Receipt", "RestorePolicy",
           "RestoreRequest", "SCHEMAS", "Span", "Strict", "TrustRule", "Validation", "WeightFile", "WorkloadRequest",
           "canonical_json", "parse_request", "sha256_hex"]
