"""Prefetched weights handed into a container.

A prefetcher (coldsnap.gpu.prefetch) starts on the host before the container exists, so that the weights load
while CRIU and the CUDA driver restore; it listens on a host path the engine inside cannot see. Once the container's
processes are back, a relay listens inside the container's own /tmp (reached through /proc/PID/root) for each
prefetcher and passes the hand-over through: the memory's file descriptor and description from the prefetcher to
the engine, then the engine's release back, so that a prefetcher frees its copy only once the engine has let go of it
(prefetch.Session.release). The engine is given the paths as it sees them."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from contextlib import contextmanager, suppress
from typing import Iterator

# the longest a relay waits for the engine to connect, and then for each side of the hand-over
TIMEOUT_S = 120.0


def _owner(pid: int) -> tuple[int, int]:
    """The (uid, gid) the container's processes run as, on the host: the socket is theirs to connect to."""
    st = os.stat(f"/proc/{pid}")
    return st.st_uid, st.st_gid


def _pass_through(listener: socket.socket, upstream_path: str) -> None:
    try:
        conn, _ = listener.accept()
    except OSError:  # closed: the engine never came (it filled its copy itself, or the resume failed)
        return
    with conn, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as up:
        conn.settimeout(TIMEOUT_S)
        up.settimeout(TIMEOUT_S)
        fds: list[int] = []
        try:
            up.connect(upstream_path)
            data, fds, _, _ = socket.recv_fds(up, 1 << 16, 1)
            socket.send_fds(conn, [data or b"{}"], fds)
        except OSError:
            return  # the engine hears the connection close and fills its copy itself
        finally:
            for fd in fds:
                os.close(fd)
        with suppress(OSError):
            conn.recv(1)  # the engine has unmapped the memory (or gone)
            up.shutdown(socket.SHUT_WR)
            up.recv(1)  # and the prefetcher has freed its copy: the engine may hear it now


@contextmanager
def into_container(root_pid: int, prefetched: str | dict[str, str] | None) -> Iterator[str | dict[str, str] | None]:
    """Relays for the prefetchers' sockets (one, or {key: socket}) inside the container whose processes descend from
    root_pid; yields what the engine is given, the same shape with the paths it sees. Where no socket can be made in
    the container (no writable /tmp) the engine is given none: it reads the weights itself, only slower."""
    if not prefetched:
        yield prefetched
        return
    sockets = {"": prefetched} if isinstance(prefetched, str) else dict(prefetched)
    inside: dict[str, str] = {}
    listeners: list[tuple[socket.socket, str]] = []
    threads: list[threading.Thread] = []
    try:
        uid, gid = _owner(root_pid)
        for key, upstream in sockets.items():
            path = f"/tmp/.coldsnap-prefetch-{uuid.uuid4().hex[:12]}.sock"
            outer = f"/proc/{root_pid}/root{path}"
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(outer)
            except OSError:
                listener.close()
                raise
            listeners.append((listener, outer))
            os.chown(outer, uid, gid)
            os.chmod(outer, 0o600)
            listener.listen(1)
            listener.settimeout(TIMEOUT_S)
            thread = threading.Thread(target=_pass_through, args=(listener, upstream), daemon=True,
                                      name="coldsnap-prefetch-relay")
            thread.start()
            threads.append(thread)
            inside[key] = path
    except OSError:
        inside = {}
    try:
        yield (inside.get("") if isinstance(prefetched, str) else inside) or None
    finally:
        for listener, outer in listeners:
            with suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            with suppress(OSError):
                os.unlink(outer)
        for thread in threads:
            thread.join(TIMEOUT_S)
