"""What crosses the seam between the flows and an engine adapter (coldsnap.engines)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EngineRelease(BaseModel):
    """An engine's answer to before_capture: what it released for the dump. Empty (falsy): nothing was released,
    so nothing need be resumed. Engine-specific facts (timings, sleep levels, bytes freed) ride along as extra
    fields and go into the receipt as they are."""

    model_config = ConfigDict(extra="allow")

    saved_weights: str | None = Field(default=None, description="The file the engine saved its in-memory weights "
                                      "to (native mode): it travels beside the images as a pinned payload.")
    prefetch_plans: dict[str, list[list[int]]] = Field(default_factory=dict, description="GPU UUID → the weight "
                                                       "pieces (offset, length) that GPU loads at restore.")

    def __bool__(self) -> bool:
        return bool(self.model_dump(exclude_defaults=True))

    def facts(self) -> dict:
        """What the receipt shows of it (the prefetch plans go into the capsule's profile instead)."""
        return self.model_dump(exclude_defaults=True, exclude={"prefetch_plans"})
