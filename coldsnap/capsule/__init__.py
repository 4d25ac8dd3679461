"""Capsules: OCI image layouts holding CRIU images, captured files and a weights manifest."""

from coldsnap.capsule.pack import pack_dir, pack_parts, unpack_layer, unpack_layers
from coldsnap.capsule.store import CapsuleStore, Descriptor, LoadedCapsule, parse_reference

__all__ = ["CapsuleStore", "Descriptor", "LoadedCapsule", "pack_dir", "pack_parts", "parse_reference", "unpack_layer",
           "unpack_layers"]
