"""The OCI runtime surface shared by the shim and the hooks, stdlib only (docs/architecture.md, "Floors").
The shim imports argv and runtime on every runc call, so this package imports nothing by itself."""
