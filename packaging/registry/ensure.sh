#!/usr/bin/env bash
# Make sure Debian's docker-registry (CNCF distribution 2.8.x) is installed: the tests and the registry
# benchmark start private instances of it. Idempotent; apt only runs when the binary is missing.
set -euo pipefail
command -v docker-registry >/dev/null || (apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-registry)
command -v docker-registry >/dev/null
