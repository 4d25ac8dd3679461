#!/usr/bin/env bash
# Debian's kubectl (package kubectl, which kubernetes-client depends on) in PREFIX/bin (default
# /var/lib/coldsnap/kubectl), for the manifest checks in the tests; the host's own kubectl is left alone.
exec "$(dirname "$0")/../debian/binary.sh" kubectl kubectl "${1:-/var/lib/coldsnap/kubectl}" version --client
