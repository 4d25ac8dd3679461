"""Strict pydantic base and canonical JSON (the form request hashes are taken over)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final

from pydantic import BaseModel, ConfigDict

FORMAT_VERSION: Final = 1


class Strict(BaseModel):
    """Unknown fields are errors, never silently dropped: a typo must not change behaviour."""

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True, strict=True)


def canonical_json(data: Any) -> str:
    """Sorted keys, no whitespace, UTF-8 as is: equal documents give equal bytes whatever their key order."""
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json", exclude_none=False)
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(data: Any) -> str:
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()
