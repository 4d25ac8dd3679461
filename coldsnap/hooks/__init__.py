"""`coldsnap-hook`: OCI hooks around a container the shim restored (validate at poststart, clean up at poststop)."""
