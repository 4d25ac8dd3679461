"""ColdSnap: capture an initialized inference server once, restore it instead of cold-starting."""

__version__ = "0.1.0"
