"""Engines ColdSnap knows how to launch, capture and restore (the embedded reference engine among them)."""
