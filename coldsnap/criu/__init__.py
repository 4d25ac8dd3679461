"""CRIU: find the provisioned binary, derive options from a request in one place, dump and restore via pycriu."""

from coldsnap.criu.driver import (
    CriuDriver,
    CriuOptions,
    LazyPages,
    criu_images_open_files,
    criu_stats,
    lazy_pages_wanted,
)
from coldsnap.criu.sparse import drop_zero_pages

__all__ = ["CriuDriver", "CriuOptions", "LazyPages", "criu_images_open_files", "criu_stats", "drop_zero_pages",
           "lazy_pages_wanted"]
