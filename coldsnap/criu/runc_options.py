"""ColdSnap's CRIU options (coldsnap.criu.CriuOptions.cli_flags(), the one option table) as runc takes them.

runc checkpoint/restore expose only some CRIU options as flags. The others (--link-remap, --ghost-limit,
--network-lock, ...) go to CRIU through a configuration file named by $CRIU_CONFIG_FILE, which runc passes on
to `criu swrk` with its environment. Nothing here is invented: every option comes from cli_flags()."""

from __future__ import annotations

from pathlib import Path

RUNC_FLAGS = ("--tcp-established", "--ext-unix-sk", "--shell-job", "--file-locks")
CHECKPOINT_ONLY = ("--leave-running",)
PROCESS_MODE_ONLY = ("--external=",)  # ColdSnap's own netns key; runc names the container's namespaces itself


def split(cli_flags: list[str], operation: str) -> tuple[list[str], list[str]]:
    """(runc flags, CRIU config-file lines) for operation 'checkpoint' or 'restore'."""
    flags: list[str] = []
    lines: list[str] = []
    for flag in cli_flags:
        if flag in RUNC_FLAGS or (flag in CHECKPOINT_ONLY and operation == "checkpoint"):
            flags.append(flag)
        elif flag in CHECKPOINT_ONLY or flag.startswith(PROCESS_MODE_ONLY):
            continue
        else:
            name, _, value = flag.lstrip("-").partition("=")
            lines.append(f"{name} {value}".strip())
    return flags, lines


def write_config(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    path.chmod(0o600)
    return path
