"""Contracts: pydantic models and constants only. No I/O; imports nothing else of ColdSnap.

Its names load their module on first use (PEP 562), so that what needs only the errors or the strict JSON reader
(the OCI hooks, inside every container restore) does not build every model first."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

    from coldsnap.contracts.base import (
        FORMAT_VERSION,
        Strict,
        canonical_json,
        sha256_hex,
    )
    from coldsnap.contracts.engine import (
        EngineRelease,
    )
    from coldsnap.contracts.errors import (
        EXIT_CODES,
        ColdSnapError,
        ErrorCode,
    )
    from coldsnap.contracts.parse import (
        parse_request,
    )
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
    from coldsnap.contracts.receipt import (
        ErrorInfo,
        Origin,
        Receipt,
        Span,
    )
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
    from coldsnap.contracts.trust import (
        ContainerRule,
        RestorePolicy,
        TrustRule,
    )

_WHERE = {
    "FORMAT_VERSION": "base",
    "Strict": "base",
    "canonical_json": "base",
    "sha256_hex": "base",
    "EngineRelease": "engine",
    "EXIT_CODES": "errors",
    "ColdSnapError": "errors",
    "ErrorCode": "errors",
    "parse_request": "parse",
    "Capabilities": "profile",
    "CapsuleProfile": "profile",
    "CapturedFile": "profile",
    "ContainerLaunch": "profile",
    "ContainerMount": "profile",
    "Distributed": "profile",
    "GpuInfo": "profile",
    "HostProfile": "profile",
    "NetworkPlan": "profile",
    "ErrorInfo": "receipt",
    "Origin": "receipt",
    "Receipt": "receipt",
    "Span": "receipt",
    "ENGINE_NAMES": "request",
    "OPERATIONS": "request",
    "REQUEST_ADAPTER": "request",
    "CaptureRequest": "request",
    "Engine": "request",
    "Launch": "request",
    "Lifecycle": "request",
    "Model": "request",
    "Mount": "request",
    "Policy": "request",
    "RestoreRequest": "request",
    "Validation": "request",
    "WeightFile": "request",
    "WorkloadRequest": "request",
    "ContainerRule": "trust",
    "RestorePolicy": "trust",
    "TrustRule": "trust",
}

__all__ = ["Capabilities", "CapsuleProfile", "CaptureRequest", "CapturedFile", "ColdSnapError", "ContainerLaunch",
           "ContainerMount", "ContainerRule", "Distributed", "ENGINE_NAMES", "EXIT_CODES", "Engine",
           "EngineRelease", "ErrorCode", "ErrorInfo", "FORMAT_VERSION", "GpuInfo", "HostProfile", "Launch",
           "Lifecycle", "Model", "Mount", "NetworkPlan", "OPERATIONS", "Origin", "Policy", "REQUEST_ADAPTER",
           "Receipt", "RestorePolicy", "RestoreRequest", "SCHEMAS", "Span", "Strict", "TrustRule", "Validation",
           "WeightFile", "WorkloadRequest", "canonical_json", "parse_request", "sha256_hex"]


def _schemas() -> dict[str, type[BaseModel]]:
    from coldsnap.contracts.engine import EngineRelease
    from coldsnap.contracts.profile import Capabilities, CapsuleProfile
    from coldsnap.contracts.receipt import Receipt
    from coldsnap.contracts.request import CaptureRequest, RestoreRequest, WorkloadRequest
    from coldsnap.contracts.trust import RestorePolicy

    return {
        "capture-request": CaptureRequest,
        "restore-request": RestoreRequest,
        "workload-request": WorkloadRequest,
        "receipt": Receipt,
        "capsule-profile": CapsuleProfile,
        "capabilities": Capabilities,
        "policy": RestorePolicy,
        "engine-release": EngineRelease,
    }


def __getattr__(name: str) -> Any:
    if name == "SCHEMAS":
        value: Any = _schemas()
    elif name in _WHERE:
        value = getattr(importlib.import_module(f"coldsnap.contracts.{_WHERE[name]}"), name)
    else:
        raise AttributeError(f"module 'coldsnap.contracts' has no attribute {name!r}")
    globals()[name] = value  # once loaded, a plain attribute
    return value
