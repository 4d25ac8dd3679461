"""The CUDA driver's own checkpoint/restore, timed apart from ColdSnap (coldsnap_bench.driver_rate): the arithmetic
everywhere, a clear failure where there is no GPU, and a real round on the GPU machine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coldsnap_bench.driver_rate import measure, rate


def test_fixed_cost_and_rate_come_from_the_smallest_and_largest_sizes():
    out = rate([{"gib": 4.0, "restore_median_s": 0.99}, {"gib": 0.0, "restore_median_s": 0.25},
                {"gib": 1.0, "restore_median_s": 0.4}])
    assert out["fixed_restore_s"] == 0.25
    assert out["restore_gb_per_s"] == pytest.approx(4 * (1 << 30) / 0.74 / 1e9, rel=1e-3)
    # One size, or no time beyond the fixed cost: no rate to give.
    assert rate([{"gib": 0.0, "restore_median_s": 0.3}]) == {"fixed_restore_s": 0.3}


def _has_gpu() -> bool:
    torch = pytest.importorskip("torch")
    return torch.cuda.is_available()


def test_without_a_gpu_it_says_why_in_one_line():
    if _has_gpu():
        pytest.skip("this host has a GPU: the failure path is for hosts without one")
    p = subprocess.run([sys.executable, "-m", "coldsnap_bench.driver_rate", "--gib", "0", "--repeat", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("coldsnap_bench.driver_rate: "), p.stderr
    assert "Traceback" not in p.stderr


def test_a_round_on_the_gpu_keeps_the_memory_and_times_each_call():
    if not _has_gpu():
        pytest.skip("needs a CUDA GPU and the driver's checkpoint API (runs on the device machine)")
    r = measure(0.5, repeat=2)
    assert r["all_intact"], r
    assert len(r["rounds"]) == 2 and all(x["restore"] > 0 and x["checkpoint"] > 0 for x in r["rounds"])
