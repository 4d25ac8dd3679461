"""OCI runtime surface shared by the shim and the hooks, stdlib only: runc's argv (argv), a bundle's config.json
(spec), the shim's per-container records (records), runc's log lines (runclog), where the real runc is and the
runtime's settings (runtime), and OCI hooks (hooks).

The shim imports argv and runtime on every runc call, so this package imports nothing by itself."""
