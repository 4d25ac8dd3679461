#!/usr/bin/env bash
# Debian's cosign (sid) in PREFIX/bin (default /var/lib/coldsnap/cosign), for the signature tests: ColdSnap's
# signatures must pass `cosign verify --key`, and ColdSnap must accept capsules signed with `cosign sign --key`.
exec "$(dirname "$0")/../debian/binary.sh" cosign cosign "${1:-/var/lib/coldsnap/cosign}" version
