#!/usr/bin/env bash
# One binary from Debian's own build of a package (SUITE, default sid), unpacked into PREFIX/bin, for tools the
# tests drive and that this Debian lacks or ships too old (kubectl, cosign): nothing is installed on the host.
#
# Usage: binary.sh PACKAGE BINARY PREFIX [CHECK-ARGS...]   e.g. binary.sh cosign cosign /var/lib/coldsnap/cosign version
# Idempotent: a prefix whose stamp matches and whose binary runs (BINARY CHECK-ARGS) is kept.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PACKAGE=$1 BINARY=$2 PREFIX=$3; shift 3
CHECK=("$@"); [ ${#CHECK[@]} -gt 0 ] || CHECK=(--version)
STAMP="suite=${COLDSNAP_DEBIAN_SUITE:-sid} package=$PACKAGE binary=$BINARY"
if [ -x "$PREFIX/bin/$BINARY" ] && [ "$(cat "$PREFIX/STAMP" 2>/dev/null)" = "$STAMP" ] &&
    "$PREFIX/bin/$BINARY" "${CHECK[@]}" >/dev/null 2>&1; then
    exit 0
fi
ROOT=$(mktemp -d /tmp/coldsnap-$PACKAGE.XXXXXX)
trap 'rm -rf "$ROOT" "$ROOT.versions"' EXIT
"$HERE/fetch.sh" "$ROOT" "$PACKAGE" >"$ROOT.versions"
"$ROOT/usr/bin/$BINARY" "${CHECK[@]}" >/dev/null 2>&1 || { echo "binary.sh: the unpacked $BINARY does not run here" >&2; exit 1; }
mkdir -p "$PREFIX/bin"
install -m 0755 "$ROOT/usr/bin/$BINARY" "$PREFIX/bin/$BINARY.new"
mv "$PREFIX/bin/$BINARY.new" "$PREFIX/bin/$BINARY"
cp "$ROOT.versions" "$PREFIX/VERSION"
echo "$STAMP" >"$PREFIX/STAMP"
echo "binary.sh: $(cat "$PREFIX/VERSION") in $PREFIX/bin" >&2
