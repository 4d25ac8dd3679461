"""Capsules: OCI image layouts holding CRIU images, captured files and a weights manifest."""

from coldsnap.capsule.pack import pack_dir, unpack_layer
from coldsnap.capsule.store import CapsuleStore, Descriptor, LoadedCapsule, parse_reference

__all__ = ["CapsuleStore", "Descriptor", "LoadedCapsule", "pack_dir", "parse_reference", "unpack_layer"]
