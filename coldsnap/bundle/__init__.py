"""OCI bundles as the runtime sees them: runc's argv (argv.py), the bundle's config.json (spec.py) and
ColdSnap's CRIU options as runc takes them (criu_runc.py).

Stdlib only. The shim imports argv.py on every runc call, so this package imports nothing by itself."""
