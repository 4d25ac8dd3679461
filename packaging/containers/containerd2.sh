#!/usr/bin/env bash
# Debian sid's containerd 2.x (containerd, containerd-shim-runc-v2, ctr) unpacked into PREFIX/bin, beside the host's
# own containerd 1.x, the way CRIU is provisioned: for the CRI tests of the containerd that current Kubernetes
# releases use. Start it with PATH=PREFIX/bin:$PATH so that it finds its own shim.
#
# Usage: containerd2.sh [PREFIX]   (default /var/lib/coldsnap/containerd2). Idempotent.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PREFIX=${1:-/var/lib/coldsnap/containerd2}
STAMP="suite=${COLDSNAP_DEBIAN_SUITE:-sid} package=containerd"
ok() { [ "$(cat "$PREFIX/STAMP" 2>/dev/null)" = "$STAMP" ] && "$PREFIX/bin/containerd" --version >/dev/null 2>&1; }
ok && exit 0
ROOT=$(mktemp -d /tmp/coldsnap-containerd2.XXXXXX)
trap 'rm -rf "$ROOT" "$ROOT.versions"' EXIT
"$HERE/../debian/fetch.sh" "$ROOT" containerd >"$ROOT.versions"
"$ROOT/usr/bin/containerd" --version >/dev/null 2>&1 || { echo "containerd2.sh: the unpacked containerd does not run here" >&2; exit 1; }
NEW="$PREFIX.new.$$"
rm -rf "$NEW" && mkdir -p "$NEW/bin"
for b in containerd containerd-shim-runc-v2 ctr; do install -m 0755 "$ROOT/usr/bin/$b" "$NEW/bin/$b"; done
cp "$ROOT.versions" "$NEW/VERSION"
echo "$STAMP" >"$NEW/STAMP"
rm -rf "$PREFIX.old" && { [ ! -e "$PREFIX" ] || mv "$PREFIX" "$PREFIX.old"; } && mv "$NEW" "$PREFIX" && rm -rf "$PREFIX.old"
echo "containerd2.sh: $("$PREFIX/bin/containerd" --version) in $PREFIX/bin" >&2
