"""Parse runc's command line without changing it.

runc (urfave/cli v1 on Go's flag package) takes global flags, then a subcommand, then the subcommand's flags, then
positional arguments. Flags may be written -x, --x, --x=v or --x v; parsing stops at the first non-flag or at `--`
(so `exec ID cmd --flag` keeps `--flag` as a positional). Unknown flags are kept and taken as booleans unless they
carry `=`: the parse is only used to decide, never to rebuild what the caller wrote.
"""

from __future__ import annotations

import os

# runc's own rule for a container id (libcontainer validateID): ASCII letters, digits and _ + , - . only, and not
# "." or "..". The shim builds paths from an id only after this check, so an id runc refuses goes to runc untouched.
ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+,-.")
MAX_ID = 200  # the shim's record is <id>.json, its temp file longer: beyond this, runc answers alone


def valid_container_id(container_id: str | None) -> bool:
    return (container_id is not None and 0 < len(container_id) <= MAX_ID and container_id not in (".", "..")
            and set(container_id) <= ID_CHARS)


GLOBAL_VALUE = frozenset({"root", "log", "log-format", "criu", "rootless"})

# Flags of runc 1.1 subcommands that take a value (the rest are booleans).
VALUE_FLAGS: dict[str, frozenset[str]] = {
    "create": frozenset({"bundle", "b", "console-socket", "pid-file", "preserve-fds"}),
    "run": frozenset({"bundle", "b", "console-socket", "pid-file", "preserve-fds"}),
    "restore": frozenset({"bundle", "b", "console-socket", "pid-file", "image-path", "work-path",
                          "manage-cgroups-mode", "empty-ns", "lsm-profile", "lsm-mount-context"}),
    "checkpoint": frozenset({"image-path", "work-path", "parent-path", "status-fd", "page-server",
                             "manage-cgroups-mode", "empty-ns"}),
    "exec": frozenset({"console-socket", "cwd", "env", "e", "user", "u", "additional-gids", "g", "process", "p",
                       "apparmor", "process-label", "cap", "c", "pid-file", "preserve-fds", "cgroup"}),
    "ps": frozenset({"format", "f"}),
    "list": frozenset({"format", "f"}),
    "events": frozenset({"interval"}),
    "update": frozenset({"resources", "r", "blkio-weight", "cpu-period", "cpu-quota", "cpu-rt-period",
                         "cpu-rt-runtime", "cpu-share", "cpuset-cpus", "cpuset-mems", "kernel-memory",
                         "kernel-memory-tcp", "memory", "memory-reservation", "memory-swap", "pids-limit",
                         "l3-cache-schema", "mem-bw-schema"}),
}


def _flag_name(token: str) -> str | None:
    """'--pid-file=x' → 'pid-file'; '-d' → 'd'; not a flag (or '-', '--') → None."""
    if len(token) < 2 or token[0] != "-" or token == "--":
        return None
    name = token[2:] if token.startswith("--") else token[1:]
    return name.split("=", 1)[0] or None


class RuncArgv:
    """A parsed runc command line (a plain class: dataclasses would cost the pass-through path milliseconds)."""

    __slots__ = ("argv", "globals", "command", "command_index", "flags", "args")

    def __init__(self, argv: tuple[str, ...], globals: dict[str, str | bool] | None = None, command: str | None = None,
                 command_index: int = -1, flags: dict[str, str | bool] | None = None, args: tuple[str, ...] = ()):
        self.argv = argv  # exactly what the caller passed (without argv[0])
        self.globals = globals or {}
        self.command = command
        self.command_index = command_index  # position of the subcommand in argv
        self.flags = flags or {}
        self.args = args

    def __repr__(self) -> str:
        return (f"RuncArgv(command={self.command!r}, globals={self.globals!r}, flags={self.flags!r}, "
                f"args={self.args!r})")

    @property
    def root(self) -> str:
        return str(self.globals.get("root") or "/run/runc")

    @property
    def log(self) -> str | None:
        value = self.globals.get("log")
        return str(value) if value else None

    @property
    def log_format(self) -> str:
        return str(self.globals.get("log-format") or "text")

    def flag(self, *names: str) -> str | bool | None:
        return next((self.flags[n] for n in names if n in self.flags), None)

    def _string(self, *names: str) -> str | None:
        value = self.flag(*names)
        return value if isinstance(value, str) and value else None

    @property
    def container_id(self) -> str | None:
        return self.args[0] if self.args else None

    @property
    def id(self) -> str:
        """The container id of a command the shim handles (its decision checked it: valid_container_id)."""
        cid = self.container_id
        if cid is None:
            raise ValueError(f"runc {self.command} without a container id")
        return cid

    @property
    def bundle(self) -> str:
        """The bundle directory; runc's default is the current directory."""
        value = self._string("bundle", "b")
        return os.path.abspath(value) if value else os.getcwd()

    @property
    def pid_file(self) -> str | None:
        return self._string("pid-file")

    @property
    def console_socket(self) -> str | None:
        return self._string("console-socket")

    @property
    def detach(self) -> bool:
        value = self.flag("detach", "d")
        return value.lower() in ("1", "t", "true") if isinstance(value, str) else bool(value)

    def global_argv(self, drop: tuple[str, ...] = ()) -> list[str]:
        """The caller's global flags verbatim (everything before the subcommand), without the flags named in drop."""
        tokens = list(self.argv[: self.command_index]) if self.command_index >= 0 else list(self.argv)
        out: list[str] = []
        i = 0
        while i < len(tokens):
            name = _flag_name(tokens[i])
            takes_value = name in GLOBAL_VALUE and "=" not in tokens[i]
            group = tokens[i:i + 2] if takes_value else tokens[i:i + 1]
            if name not in drop:
                out += group
            i += len(group)
        return out


def _parse_flags(tokens: list[str], start: int, value_names: frozenset[str]) -> tuple[dict[str, str | bool], int]:
    """Consume flags from tokens[start:]; return them and the index of the first non-flag."""
    flags: dict[str, str | bool] = {}
    i = start
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            return flags, i + 1
        name = _flag_name(token)
        if name is None:
            return flags, i
        if "=" in token:
            flags[name] = token.split("=", 1)[1]
        elif name in value_names and i + 1 < len(tokens):
            flags[name] = tokens[i + 1]
            i += 1
        else:
            flags[name] = True
        i += 1
    return flags, i


def parse_runc_argv(argv: list[str] | tuple[str, ...]) -> RuncArgv:
    tokens = list(argv)
    globals_, i = _parse_flags(tokens, 0, GLOBAL_VALUE)
    if i >= len(tokens):
        return RuncArgv(argv=tuple(tokens), globals=globals_)
    command = tokens[i]
    flags, j = _parse_flags(tokens, i + 1, VALUE_FLAGS.get(command, frozenset()))
    return RuncArgv(argv=tuple(tokens), globals=globals_, command=command, command_index=i, flags=flags,
                    args=tuple(tokens[j:]))
