"""`coldsnap bench --via podman --samples 1`, for real: a private podman, the reference engine (torch.compile on)
started cold and restored by coldsnap-runtime; the JSON says both samples validated and the chart is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow]
CRIU = os.environ.get("COLDSNAP_CRIU_PREFIX", "/var/lib/coldsnap/criu") + "/bin/criu"


def _skip(reason: str) -> None:
    print(f"test_bench_via skipped: {reason}")
    pytest.skip(reason)


def test_bench_via_podman_one_sample(tmp_path):
    if os.geteuid() != 0:
        _skip("needs root: rootful podman, runc and CRIU")
    if not os.access(CRIU, os.X_OK):
        _skip(f"CRIU not provisioned at {CRIU}: run `make setup`")
    out = tmp_path / "results"
    r = subprocess.run([str(Path(sys.prefix) / "bin" / "coldsnap"), "bench", "--via", "podman", "--samples", "1",
                        "--out", str(out), "--json"], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((out / "reference-podman-cpu.json").read_text())
    assert data["validations"] == {"vanilla": "1/1", "restore": "1/1"}
    assert data["via"] == "podman" and data["compile"]["torch_compile"]
    assert data["restore_receipts"][0]["state"] == "succeeded"
    assert json.loads(data["restore_settings"]["io.coldsnap.policy"]) == {"fallback_to_cold": False}
    assert data["passthrough_overhead"]["reps"] == 20
    assert (out / "reference-podman-cpu.png").stat().st_size > 0
    assert data["command"].startswith("coldsnap bench --via podman --samples 1")
