"""`coldsnap bench --replicas N`, for real (reference engine on CPU, real CRIU): for N = 1 … N, N vanilla starts at
once and N restores of one capsule at once, each burst clocked to the last replica validated; the result has a row
per N with its same-run limit, and every workload is gone afterwards."""

import json

import pytest
from conftest import coldsnap_cli, needs_root_criu, run_bench

pytestmark = pytest.mark.slow


def test_replicas_bench_restores_n_at_once_and_leaves_nothing_running(tmp_path):
    needs_root_criu()
    data = run_bench(tmp_path, "reference-cpu-replicas", "--replicas", "2")
    assert [row["replicas"] for row in data["rows"]] == [1, 2]
    for row in data["rows"]:
        n = row["replicas"]
        assert row["validated"] == {"vanilla": f"{n}/{n}", "restore": f"{n}/{n}"}
        assert 0 < row["restore_s"] < row["vanilla_s"] and row["limit_s"] > 0
    assert data["rows"][1]["limit_s"] > data["rows"][0]["limit_s"]  # two replicas move twice the bytes
    status = coldsnap_cli(tmp_path, "status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["workloads"] == []  # all stopped, after the clock
