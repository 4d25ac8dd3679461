"""Mamba / linear-attention CPU ops of sgl_kernel: not provided by the stand-in (imported by some model backends at
load time; calling one raises)."""

from . import _not_provided


def __getattr__(name: str):
    if name.endswith("_cpu"):
        return _not_provided(name)
    raise AttributeError(f"module 'sgl_kernel.mamba' has no attribute {name!r}")
