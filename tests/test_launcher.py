"""coldsnap-runc, the runtime's front door in C (packaging/launcher/coldsnap-runc.c): every call it cannot rule
out goes to the Python shim, every other call to runc with the argv unchanged. Checked against the shim's own
decision table (test_shim_decision.py) with stand-ins for runc and for the shim that say who ran; no root."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap.oci import records

LAUNCHER = Path(sys.prefix) / "bin" / "coldsnap-runc"
ANNOTATED = {"ociVersion": "1.0.2", "annotations": {"io.coldsnap.capsule": "sha256:" + "a" * 64}}


@pytest.fixture
def door(tmp_path):
    if not LAUNCHER.exists():
        pytest.skip(f"{LAUNCHER} is not built (packaging/setup.sh builds it with cc)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(LAUNCHER, bin_dir / "coldsnap-runc")
    for who in ("coldsnap-runtime", "runc"):
        (bin_dir / who).write_text(f'#!/bin/sh\necho "{who.replace("coldsnap-runtime", "shim")} $*"\n')
        (bin_dir / who).chmod(0o755)
    annotated, plain = tmp_path / "annotated", tmp_path / "plain"
    for bundle, spec in ((annotated, ANNOTATED), (plain, {"ociVersion": "1.0.2", "annotations": {"a": "b"}})):
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps(spec))
    root = tmp_path / "runc-root"
    root.mkdir()

    def run(*argv, marker_for=None):
        marker = None
        if marker_for:
            marker = Path(records.marker_path(str(root), marker_for))
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        try:
            r = subprocess.run([str(bin_dir / "coldsnap-runc"), *argv], capture_output=True, text=True, timeout=30,
                               env={"PATH": f"{bin_dir}:/usr/bin:/bin", "COLDSNAP_RUNC": str(bin_dir / "runc")})
        finally:
            if marker:
                marker.unlink()
        return r.stdout.split(" ", 1)[0] if r.returncode == 0 else f"rc={r.returncode}:{r.stderr}"

    return run, annotated, plain, root


def test_the_front_door_sends_only_what_could_be_ours_to_the_shim(door):
    run, annotated, plain, root = door
    r = str(root)
    assert run("--root", r, "create", "--bundle", str(annotated), "c1") == "shim"
    assert run("--root", r, "create", "-b", str(annotated), "--pid-file", "/p", "c1") == "shim"
    assert run("--root", r, "run", "-d", f"--bundle={annotated}", "c1") == "shim"
    assert run("--root", r, "create", "--bundle", str(plain), "c1") == "runc"
    assert run("--root", r, "create", "--bundle", str(annotated)) == "runc"  # no id: runc's usage error
    assert run("--root", r, "start", "c1") == "runc"
    assert run("--root", r, "start", "c1", marker_for="c1") == "shim"
    assert run("--root", r, "delete", "--force", "c1", marker_for="c1") == "shim"
    assert run("--root", r, "delete", "c2", marker_for="c1") == "runc"
    assert run("--root", r, "state", "c1", marker_for="c1") == "runc"
    assert run("--root", r, "exec", "c1", "create", "--bundle", str(annotated)) == "runc"
    assert run("--version") == "runc" and run() == "runc"
    assert run("--root", r, "--log", "/dev/null", "--log-format", "json", "kill", "c1", "KILL") == "runc"


def test_the_runc_it_execs_gets_the_argv_unchanged(door, tmp_path):
    run, _, plain, root = door
    argv = ["--root", str(root), "create", "--bundle", str(plain), "--console-socket", "/s", "a b", "--", "x"]
    r = subprocess.run([str(tmp_path / "bin" / "coldsnap-runc"), *argv], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "COLDSNAP_RUNC": str(tmp_path / "bin" / "runc")})
    assert r.stdout == "runc " + " ".join(argv) + "\n"
    missing = subprocess.run([str(tmp_path / "bin" / "coldsnap-runc"), "list"], capture_output=True, text=True,
                             env={"PATH": str(tmp_path / "nothing")})
    assert missing.returncode == 1 and "no runc found" in missing.stderr
    assert os.path.exists(tmp_path / "bin" / "coldsnap-runc")
