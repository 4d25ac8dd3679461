"""Engines ColdSnap knows how to launch, capture and restore (the embedded reference engine among them).

The adapter contract is in base.py; each engine's adapter is imported only when asked for (an engine's own
process imports this package, and must not pay for the others)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from coldsnap.contracts import ENGINE_NAMES, ColdSnapError, ErrorCode

if TYPE_CHECKING:
    from coldsnap.engines.base import EngineAdapter

ADAPTERS = {  # engine name (contracts.ENGINE_NAMES) → module:class of its adapter
    "reference": "coldsnap.engines.reference:ReferenceAdapter",
    "vllm": "coldsnap.engines.vllm:VllmAdapter",
    "sglang": "coldsnap.engines.sglang:SglangAdapter",
}
assert tuple(ADAPTERS) == ENGINE_NAMES


def get_adapter(name: str) -> EngineAdapter:
    if name not in ADAPTERS:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"engine {name!r} has no adapter in this ColdSnap "
                            f"(one of: {', '.join(ENGINE_NAMES)})")
    module, cls = ADAPTERS[name].split(":")
    return getattr(import_module(module), cls)()
