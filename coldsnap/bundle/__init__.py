"""OCI bundles as the runtime sees them: runc's argv and the bundle's config.json.

Pass-through code imports this package on every runc call: it must stay stdlib-only and cheap (json, os)."""

from .argv import RuncArgv, parse_runc_argv
from .spec import annotations_of, load_spec, write_spec

__all__ = ["RuncArgv", "annotations_of", "load_spec", "parse_runc_argv", "write_spec"]
