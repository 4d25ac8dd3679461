"""The ground floor: stdlib-only helpers every other floor may use. Where ColdSnap keeps things (paths), the one
atomic file writer (files), /proc facts (procfs) and checked SHA-256 digests (digests). Imports nothing of ours."""
