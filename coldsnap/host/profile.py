"""This host as a restore depends on it: CPU, kernel, CRIU, NVIDIA driver and GPUs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError, ErrorCode, HostProfile
from coldsnap.gpu import nvml

# Noise CRIU prints on every run where root lacks CAP_SYS_RESOURCE (RLIMIT_NOFILE hard limit can't be raised).
CRIU_NOISE = ("rlimit: Can't setup RLIMIT_NOFILE",)


def read_cpuinfo(text: str | None = None) -> tuple[str, list[str]]:
    """(cpu model, sorted flags) from /proc/cpuinfo: x86 'model name'/'flags', arm64 'Features' and the CPU part."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or fields.get("Model") or fields.get("Hardware") or ""
    if not model and "CPU implementer" in fields:  # arm64 without a model name
        model = f"implementer {fields['CPU implementer']} part {fields.get('CPU part', '?')}"
    flags = fields.get("flags") or fields.get("Features") or ""
    return model or "unknown", sorted(set(flags.split()))


def host_profile(criu_version: str) -> HostProfile:
    """The profile a capsule records at capture and admission compares at restore."""
    u = os.uname()
    model, flags = read_cpuinfo()
    gpu = nvml.discover()
    return HostProfile(arch=u.machine, cpu_model=model, cpu_flags=flags, kernel=u.release, criu_version=criu_version,
                       driver_version=gpu.driver_version, cuda_version=gpu.cuda_version, gpus=gpu.gpus,
                       gpu_links=gpu.links)


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise ColdSnapError(ErrorCode.ENVIRONMENT,
                            f"CRIU not found at {argv[0]} (run packaging/criu/provision.sh)") from None
    except PermissionError:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"CRIU at {argv[0]} is not executable") from None
    except subprocess.TimeoutExpired:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"`{' '.join(argv)}` did not finish in {timeout:.0f} s") from None


def parse_criu_version(output: str) -> str | None:
    m = re.search(r"^Version:\s*(\S+)", output, re.MULTILINE)
    return m.group(1) if m else None


def criu_version(criu_binary: str | None = None) -> str:
    """'4.2.1' from `criu --version`. Raises ColdSnapError(ENVIRONMENT) when CRIU is missing or says no version."""
    binary = criu_binary or settings().criu
    p = _run([binary, "--version"], timeout=30)
    version = parse_criu_version(p.stdout + "\n" + p.stderr)
    if p.returncode != 0 or not version:
        out = (p.stderr or p.stdout).strip().splitlines()
        raise ColdSnapError(ErrorCode.ENVIRONMENT,
                            f"`{binary} --version` failed (exit {p.returncode}): {out[-1] if out else 'no output'}")
    return version


def version_tuple(version: str) -> tuple[int, ...]:
    """'4.2.1' → (4, 2, 1); non-numeric tails are ignored ('4.2-rc1' → (4, 2))."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in m.group().split(".")) if m else ()


def interpret_criu_check(returncode: int, output: str) -> tuple[bool, str]:
    """(ok, detail) of `criu check`: ok when it exits 0 and says 'Looks good.'; known noise lines are dropped."""
    lines = [ln for ln in output.splitlines() if ln.strip() and not any(n in ln for n in CRIU_NOISE)]
    if returncode == 0 and any("Looks good" in ln for ln in lines):
        return True, "Looks good."
    return False, f"exit {returncode}: {'; '.join(lines[-5:]) if lines else 'no output'}"


def criu_check(criu_binary: str | None = None) -> tuple[bool, str]:
    """Run `criu check` (needs root). Never raises: a missing binary is (False, why)."""
    binary = criu_binary or settings().criu
    try:
        p = _run([binary, "check"], timeout=120)
    except ColdSnapError as e:
        return False, e.message
    return interpret_criu_check(p.returncode, (p.stdout or "") + "\n" + (p.stderr or ""))
