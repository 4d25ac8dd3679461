"""`coldsnap-runtime`: a drop-in runc wrapper. Annotated bundles are restored from a capsule at `create`;
everything else goes to the real runc untouched. Stdlib-only at import: the pass-through path pays for nothing."""
