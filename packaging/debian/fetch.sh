#!/usr/bin/env bash
# Download Debian's own build of packages from SUITE (default sid) through a private apt sources list and unpack
# them into ROOT (dpkg-deb -x: no maintainer scripts, nothing installed on the host). The host's apt configuration,
# package lists and dpkg database are left alone.
#
# Usage: fetch.sh ROOT PACKAGE...      Environment: COLDSNAP_DEBIAN_SUITE (default sid). Prints each PACKAGE=VERSION.
set -euo pipefail
ROOT=$1; shift
SUITE=${COLDSNAP_DEBIAN_SUITE:-sid}
die() { echo "coldsnap-debian: error: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (apt-get)"
WORK=$(mktemp -d /tmp/coldsnap-debian.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/debs" "$ROOT"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $SUITE main" \
    >"$WORK/sources.list"
APT=(-o "Dir::Etc::SourceList=$WORK/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$WORK/lists" -o "Dir::Cache=$WORK/cache" -o Debug::NoLocking=1
    -o Acquire::Retries=3 -o APT::Sandbox::User=root)
apt-get "${APT[@]}" -qq update || die "apt-get update for $SUITE failed"
for pkg in "$@"; do
    # Debian's version by name: a package installed from another vendor's repository may rank higher.
    version=$(apt-cache "${APT[@]}" madison "$pkg" | awk -F'|' '/deb.debian.org/ {gsub(/ /, "", $2); print $2; exit}')
    [ -n "$version" ] || die "no $pkg in Debian $SUITE"
    (cd "$WORK/debs" && apt-get "${APT[@]}" -qq download "$pkg=$version") || die "apt-get download $pkg failed"
    echo "$pkg=$version"
done
for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$ROOT"; done
