"""Run a command with io_uring switched off by a seccomp filter.

    python -m coldsnap.engines.seccomp -- CMD [ARG...]

CRIU cannot dump an io_uring file descriptor (``Unknown shit 600 (anon_inode:[io_uring])``), and uvloop's libuv
opens one in every server process of vLLM and SGLang (``UV_USE_IO_URING=0`` does not stop it). With this filter
io_uring_setup, io_uring_enter and io_uring_register fail with ENOSYS — what an old kernel answers — and libuv falls
back to epoll. The filter is installed in this process and then CMD is exec'd: seccomp filters survive execve and
are inherited by every child and thread, so the whole tree of CMD runs without io_uring, and CRIU carries the filter
across dump and restore. Standard library only (ctypes): it must run under any engine's Python.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys

# io_uring syscalls have the same numbers on every architecture with the unified syscall table (5.1+).
IO_URING_SYSCALLS = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}

# AUDIT_ARCH_* values (linux/audit.h): the filter checks the architecture before it trusts a syscall number.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "i386": 0x40000003}
X32_SYSCALL_BIT = 0x40000000

# classic BPF (linux/filter.h, linux/seccomp.h)
BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
BPF_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
BPF_RET_K = 0x06  # BPF_RET | BPF_K
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
OFF_NR, OFF_ARCH = 0, 4  # offsetof(struct seccomp_data, nr / arch)

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter(arch: int, numbers: list[int], err: int = errno.ENOSYS) -> bytes:
    """A classic-BPF seccomp program: on `arch`, the syscalls `numbers` (x32 bit ignored) return -err; everything
    else — and every other architecture — is allowed."""
    deny = SECCOMP_RET_ERRNO | (err & 0xFFFF)
    prog = [
        _insn(BPF_LD_W_ABS, OFF_ARCH),
        _insn(BPF_JEQ_K, arch, jt=1, jf=0),
        _insn(BPF_RET_K, SECCOMP_RET_ALLOW),
        _insn(BPF_LD_W_ABS, OFF_NR),
        _insn(BPF_AND_K, 0xFFFFFFFF & ~X32_SYSCALL_BIT),
    ]
    # One compare per syscall: a match jumps to the deny return at the end, a miss falls through to the next.
    prog += [_insn(BPF_JEQ_K, nr, jt=len(numbers) - i) for i, nr in enumerate(numbers)]
    prog += [_insn(BPF_RET_K, SECCOMP_RET_ALLOW), _insn(BPF_RET_K, deny)]
    return b"".join(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def native_arch() -> int:
    machine = platform.machine()
    if machine in ("x86_64", "amd64"):
        return AUDIT_ARCH["x86_64"] if sys.maxsize > 2**32 else AUDIT_ARCH["i386"]
    if machine in ("aarch64", "arm64"):
        return AUDIT_ARCH["aarch64"]
    if machine in ("i386", "i686"):
        return AUDIT_ARCH["i386"]
    raise OSError(errno.ENOTSUP, f"no io_uring seccomp filter for architecture {machine}")


def install(numbers: list[int] | None = None, err: int = errno.ENOSYS) -> None:
    """Install the filter on the calling thread (and, through exec/fork/clone, on everything it starts)."""
    prog = build_filter(native_arch(), list(numbers or IO_URING_SYSCALLS.values()), err)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.addressof(buf))
    # Unprivileged filters need no_new_privs; it is harmless for root and keeps setuid binaries from escaping it.
    for what, args in (("PR_SET_NO_NEW_PRIVS", (PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)),
                       ("PR_SET_SECCOMP", (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0))):
        if libc.prctl(*args) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"prctl({what}): {os.strerror(e)}")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m coldsnap.engines.seccomp -- CMD [ARG...]", file=sys.stderr)
        return 2
    try:
        install()
    except OSError as e:
        print(f"coldsnap.engines.seccomp: {e}", file=sys.stderr)
        return 126
    try:
        os.execvp(args[0], args)
    except OSError as e:
        print(f"coldsnap.engines.seccomp: cannot run {args[0]}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
