"""A private docker-registry (distribution 2.8) for the session: `from registry_fixture import registry`.

Installs the Debian package when missing (packaging/registry/ensure.sh), writes a config into a tmp dir
(filesystem storage there, 127.0.0.1:<free port>, delete enabled), serves it, waits for GET /v2/, and yields
"127.0.0.1:PORT" (a str with .storage = the registry's storage root, for tests that tamper with blobs).
"""

import subprocess

import pytest

from coldsnap_bench.registry import ENSURE, LocalRegistry


def ensure_registry() -> None:
    r = subprocess.run([str(ENSURE)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"docker-registry is not installed and {ENSURE} could not install it: "
                    f"{(r.stderr or r.stdout).strip()[-500:]}")


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    ensure_registry()
    reg = LocalRegistry.start(tmp_path_factory.mktemp("registry"))
    try:
        yield reg
    finally:
        reg.stop()
