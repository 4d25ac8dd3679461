#!/usr/bin/env bash
# Debian's kubectl (package kubectl, which kubernetes-client depends on; from sid by default) unpacked into
# PREFIX/bin/kubectl, for the manifest checks in the tests; the host's own kubectl, if any, is left alone.
#
# Usage: kubectl.sh [PREFIX]   (default /var/lib/coldsnap/kubectl). Idempotent: a prefix whose stamp matches and
# whose kubectl runs is kept.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PREFIX=${1:-/var/lib/coldsnap/kubectl}
STAMP="suite=${COLDSNAP_DEBIAN_SUITE:-sid} package=kubectl"
if [ -x "$PREFIX/bin/kubectl" ] && [ "$(cat "$PREFIX/STAMP" 2>/dev/null)" = "$STAMP" ] &&
    "$PREFIX/bin/kubectl" version --client >/dev/null 2>&1; then
    exit 0
fi
ROOT=$(mktemp -d /tmp/coldsnap-kubectl.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
"$HERE/../debian/fetch.sh" "$ROOT" kubectl >"$ROOT.versions"
"$ROOT/usr/bin/kubectl" version --client >/dev/null 2>&1 || { echo "kubectl.sh: the unpacked kubectl does not run here" >&2; exit 1; }
mkdir -p "$PREFIX/bin"
install -m 0755 "$ROOT/usr/bin/kubectl" "$PREFIX/bin/kubectl.new"
mv "$PREFIX/bin/kubectl.new" "$PREFIX/bin/kubectl"
mv "$ROOT.versions" "$PREFIX/VERSION"
echo "$STAMP" >"$PREFIX/STAMP"
echo "kubectl.sh: $(cat "$PREFIX/VERSION") in $PREFIX/bin" >&2
