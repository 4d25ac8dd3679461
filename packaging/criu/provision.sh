#!/usr/bin/env bash
# Provision CRIU >= 4.2 into a relocatable prefix.
#
# Why: kernels >= 6.16 need CRIU >= 4.2 (3.17 fails on the vDSO, 4.1.x on every TCP/UDP socket). Debian 12/13
# ship older CRIU, so unless the system criu is already >= 4.2 and `criu check` passes, we unpack Debian sid's
# criu + libcompel + their libraries + sid's libc into one prefix and run criu through that libc's loader.
# The prefix runs on Debian 12, Debian 13 and the GPU machine's Ubuntu image (it brings its own libc).
#
# Usage: provision.sh [PREFIX]     (default: $COLDSNAP_CRIU_PREFIX or /var/lib/coldsnap/criu)
# Result: PREFIX/bin/criu (entry point), PREFIX/pycriu (python package dir for PYTHONPATH), PREFIX/VERSION.
# Idempotent: a prefix whose stamp matches and whose criu runs is kept. Non-interactive; fails loudly.
set -euo pipefail

PREFIX=${1:-${COLDSNAP_CRIU_PREFIX:-/var/lib/coldsnap/criu}}
SUITE=${COLDSNAP_CRIU_SUITE:-sid}
MIN_VERSION=4.2
# criu's runtime closure in sid (apt-cache depends --recurse, minus what only python3/debconf pull in).
PACKAGES="criu libcompel1 python3-pycriu libc6 libgcc-s1 libbsd0 libmd0 libgnutls30t64 libgmp10 libhogweed6t64
libidn2-0 libnettle8t64 libp11-kit0 libffi8 libtasn1-6 libunistring5 libnet9 libnftables1 libjansson4 libmnl0
libnftnl11 libxtables12 libnl-3-200 libprotobuf-c1 libuuid1 libedit2 libtinfo6"
STAMP="suite=$SUITE packages=$(echo $PACKAGES | tr -s ' \n' ' ')"

log() { echo "coldsnap-criu: $*" >&2; }
die() { log "error: $*"; exit 1; }

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }

prefix_ok() {
    [ -x "$PREFIX/bin/criu" ] && [ -f "$PREFIX/STAMP" ] && [ "$(cat "$PREFIX/STAMP")" = "$STAMP" ] &&
        "$PREFIX/bin/criu" --version >/dev/null 2>&1
}

if prefix_ok; then
    log "prefix $PREFIX already provisioned ($(cat "$PREFIX/VERSION"))"
    exit 0
fi

[ "$(id -u)" = 0 ] || die "must run as root (needs apt-get)"
command -v apt-get >/dev/null || die "apt-get not found: provision CRIU >= $MIN_VERSION by hand and set COLDSNAP_CRIU"
command -v dpkg-deb >/dev/null || die "dpkg-deb not found"

WORK=$(mktemp -d /tmp/coldsnap-criu.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/debs" "$WORK/root"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $SUITE main" \
    >"$WORK/sources.list"
APT=(-o "Dir::Etc::SourceList=$WORK/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$WORK/lists" -o "Dir::Cache=$WORK/cache" -o Debug::NoLocking=1
    -o Acquire::Retries=3 -o APT::Sandbox::User=root)

log "fetching the $SUITE package index"
apt-get "${APT[@]}" -qq update || die "apt-get update for $SUITE failed"
log "downloading $(echo $PACKAGES | wc -w) packages"
(cd "$WORK/debs" && apt-get "${APT[@]}" -qq download $PACKAGES) || die "apt-get download failed"
for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$WORK/root"; done

R="$WORK/root"
LIB="usr/lib/x86_64-linux-gnu"
[ -x "$R/usr/sbin/criu" ] || die "criu binary missing from the unpacked packages"
[ -e "$R/$LIB/ld-linux-x86-64.so.2" ] || die "sid's loader missing from the unpacked libc6"

# Assemble the prefix next to the target and swap it in atomically.
NEW="$PREFIX.new.$$"
rm -rf "$NEW"
mkdir -p "$NEW/bin" "$NEW/lib" "$NEW/sbin" "$NEW/pycriu"
cp -a "$R/usr/sbin/criu" "$NEW/sbin/criu"
# Libraries: everything under usr/lib/x86_64-linux-gnu and lib/x86_64-linux-gnu (usrmerge or not), no docs.
for d in "$R/$LIB" "$R/lib/x86_64-linux-gnu"; do
    [ -d "$d" ] && cp -a "$d"/. "$NEW/lib/"
done
rm -rf "$NEW/lib/gconv" "$NEW/lib/audit" "$NEW/lib/perl"* 2>/dev/null || true
cp -a "$R/usr/lib/python3/dist-packages/pycriu" "$NEW/pycriu/"
# crit is handy for inspecting images
[ -d "$R/usr/lib/python3/dist-packages/crit" ] && cp -a "$R/usr/lib/python3/dist-packages/crit" "$NEW/pycriu/"

# The entry point: run criu through sid's loader with the prefix's libraries, wherever the prefix lives.
cat >"$NEW/bin/criu" <<'EOF'
#!/bin/sh
# CRIU from a relocatable ColdSnap prefix: sid's criu run through sid's own loader and libraries.
P=$(dirname "$(dirname "$(readlink -f "$0")")")
exec "$P/lib/ld-linux-x86-64.so.2" --library-path "$P/lib" "$P/sbin/criu" "$@"
EOF
chmod 0755 "$NEW/bin/criu"

VERSION=$("$NEW/bin/criu" --version 2>/dev/null | sed -n 's/^Version: //p')
[ -n "$VERSION" ] || die "the provisioned criu does not run: $("$NEW/bin/criu" --version 2>&1 | head -3)"
version_ge "$VERSION" "$MIN_VERSION" || die "provisioned criu $VERSION is older than $MIN_VERSION"
echo "$VERSION" >"$NEW/VERSION"
echo "$STAMP" >"$NEW/STAMP"

mkdir -p "$(dirname "$PREFIX")"
rm -rf "$PREFIX.old"
[ -e "$PREFIX" ] && mv "$PREFIX" "$PREFIX.old"
mv "$NEW" "$PREFIX"
rm -rf "$PREFIX.old"
log "CRIU $VERSION provisioned in $PREFIX ($(du -sh "$PREFIX" | cut -f1))"
