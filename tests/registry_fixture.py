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


class Throttle:
    """A TCP proxy in front of the registry sending its answers at about `rate` bytes/s a connection: slow enough
    for a test to catch a pull in the middle of its weights. only: throttle only the answers to requests whose
    line holds this text (a blob's digest), the rest passing at full speed."""

    def __init__(self, upstream: str, rate: int, only: str | None = None) -> None:
        import socket
        import threading

        host, port = upstream.rsplit(":", 1)
        self.upstream, self.rate, self.only = (host, int(port)), rate, only.encode() if only else None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            slow = [self.only is None]  # this connection's answer now: throttled or not (its last request says)
            threading.Thread(target=self._requests, args=(client, server, slow), daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client, slow), daemon=True).start()

    def _requests(self, src, dst, slow: list[bool]) -> None:
        try:
            while data := src.recv(64 << 10):
                if self.only is not None and data[:4] in (b"GET ", b"HEAD"):  # one request at a time (no pipelining)
                    slow[0] = self.only in data.split(b"\r\n", 1)[0]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def _answers(self, src, dst, slow: list[bool]) -> None:
        import time

        try:
            while data := src.recv(64 << 10):
                dst.sendall(data)
                if slow[0]:
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.listener.close()
