#!/usr/bin/env bash
# Debian's kubectl (package kubectl, which kubernetes-client depends on; from $SUITE, default sid) unpacked into PREFIX/bin/kubectl, for the
# manifest checks in the tests; the host's own kubectl, if any, is left alone.
#
# Usage: kubectl.sh [PREFIX]   (default /var/lib/coldsnap/kubectl). Idempotent: a prefix whose stamp matches and
# whose kubectl runs is kept.
set -euo pipefail
PREFIX=${1:-/var/lib/coldsnap/kubectl}
SUITE=${COLDSNAP_KUBECTL_SUITE:-sid}
STAMP="suite=$SUITE package=kubectl"
log() { echo "coldsnap-kubectl: $*" >&2; }
die() { log "error: $*"; exit 1; }

if [ -x "$PREFIX/bin/kubectl" ] && [ "$(cat "$PREFIX/STAMP" 2>/dev/null)" = "$STAMP" ] &&
    "$PREFIX/bin/kubectl" version --client >/dev/null 2>&1; then
    exit 0
fi
[ "$(id -u)" = 0 ] || die "must run as root (apt-get)"
WORK=$(mktemp -d /tmp/coldsnap-kubectl.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/debs" "$WORK/root"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $SUITE main" \
    >"$WORK/sources.list"
APT=(-o "Dir::Etc::SourceList=$WORK/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$WORK/lists" -o "Dir::Cache=$WORK/cache" -o Debug::NoLocking=1
    -o Acquire::Retries=3 -o APT::Sandbox::User=root)
log "fetching kubectl from Debian $SUITE"
apt-get "${APT[@]}" -qq update || die "apt-get update for $SUITE failed"
# Debian's version by name: a kubectl installed from another vendor's repository may rank higher.
VERSION=$(apt-cache "${APT[@]}" madison kubectl | awk -F'|' '/deb.debian.org/ {gsub(/ /, "", $2); print $2; exit}')
[ -n "$VERSION" ] || die "no kubectl in Debian $SUITE"
(cd "$WORK/debs" && apt-get "${APT[@]}" -qq download "kubectl=$VERSION") || die "apt-get download failed"
dpkg-deb -x "$WORK"/debs/kubectl_*.deb "$WORK/root"
[ -x "$WORK/root/usr/bin/kubectl" ] || die "no usr/bin/kubectl in the package"
"$WORK/root/usr/bin/kubectl" version --client >/dev/null 2>&1 || die "the unpacked kubectl does not run here"
mkdir -p "$PREFIX/bin"
install -m 0755 "$WORK/root/usr/bin/kubectl" "$PREFIX/bin/kubectl.new"
mv "$PREFIX/bin/kubectl.new" "$PREFIX/bin/kubectl"
echo "$VERSION" >"$PREFIX/VERSION"
echo "$STAMP" >"$PREFIX/STAMP"
log "kubectl $(cat "$PREFIX/VERSION") in $PREFIX/bin"
