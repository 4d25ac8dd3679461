#!/usr/bin/env bash
# Make sure Debian's registry tools are installed: docker-registry (CNCF distribution 2.8.x; the tests and the
# registry benchmark start private instances of it) and, when named, others the tests drive (skopeo: a copy tool
# that must carry a capsule whole). Idempotent; apt only runs when a binary is missing.
# Usage: ensure.sh [PROGRAM ...]   (default: docker-registry; each PROGRAM is also its Debian package's name)
set -euo pipefail
[ $# -gt 0 ] || set -- docker-registry
missing=()
for program in "$@"; do command -v "$program" >/dev/null || missing+=("$program"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
for program in "$@"; do command -v "$program" >/dev/null; done
