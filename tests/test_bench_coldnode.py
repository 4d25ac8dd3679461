"""`coldsnap bench --cold-node`, for real (reference engine on CPU, a private docker-registry on loopback, real CRIU):
every sample restores a registry reference on a fresh node (empty store, nothing staged, no weights file at the
pinned path), pulling the capsule and streaming its weights in the same command (CRIU restores meanwhile); the
result times issue → first token with its spans beside a vanilla start and the same-run limit, and the capture
host's weights file is back in place afterwards."""

import json
from pathlib import Path

import pytest
from conftest import coldsnap_cli, needs_root_criu, run_bench

pytestmark = pytest.mark.slow


def test_cold_node_bench_pulls_onto_fresh_nodes_and_restores(tmp_path):
    needs_root_criu()
    data = run_bench(tmp_path, "reference-cpu-cold-node", "--cold-node", "--samples", "2", "--vanilla-samples", "1")
    assert data["cold_node"] and data["validations"]["restore"] == "2/2"
    for run in data["runs"]:
        assert run["validated"] and run["pulled_bytes"] >= data["capsule"]["bytes"]  # everything came over the wire
        assert run["spans"]["pull"] > 0 and run["spans"]["criu-restore"] > 0
        assert run["streamed"]  # admitted and staged while the weights came in
        assert run["spans"]["verify"] > 0 and run["spans"]["weights"] > 0 and run["spans"]["unpack"] > 0
        assert abs(sum(run["spans"].values()) - run["total_s"]) < 0.01  # the spans account for the whole clock
        assert run["total_s"] > run["restore_ttft_s"]  # the pull and staging are inside this clock
    two = data["two_commands"]  # the same nodes restored by `pull`, then `restore`, in turns: the same run's baseline
    assert two["validated"] == "2/2" and len(two["samples_s"]) == 2
    assert all(r["validated"] and r["spans"]["unpack"] > 0 and not r["streamed"] for r in two["runs"])
    limit = data["physical_limit"]
    assert limit["pull_bytes"] > 0 and 0 < limit["pull_s"] < limit["limit_s"]
    slower = min(data["bandwidth"]["registry_read_gbs"], data["bandwidth"]["storage_write_gbs"])
    assert abs(limit["pull_s"] - limit["pull_bytes"] / (slower * 1e9)) < 0.01  # the pull at the slower rate
    assert data["ratio_median"] == round(data["vanilla"]["median_s"] / data["restore"]["median_s"], 2)
    inspect = coldsnap_cli(tmp_path, "inspect", data["capsule"]["digest"])
    weights = Path(json.loads(inspect.stdout)["profile"]["model"]["weights"][0]["path"])
    assert weights.is_file() and not Path(str(weights) + ".cold-node").exists()  # the capture host is as it was


def test_a_cold_node_bench_past_its_deadline_writes_the_samples_it_took(tmp_path):
    """--deadline-s: a run a time limit would cut off unwritten (a GPU call's) stops sampling and writes what it has;
    one of each is always taken, so a deadline already past leaves one vanilla start and one node."""
    needs_root_criu()
    data = run_bench(tmp_path, "reference-cpu-cold-node", "--cold-node", "--samples", "3", "--vanilla-samples", "2",
                     "--deadline-s", "1")
    assert data["samples"] == 1 and data["vanilla_samples"] == 1 and data["asked"] == {"samples": 3,
                                                                                      "vanilla_samples": 2}
    assert data["stopped_early"] == ["vanilla after 1 of 2", "cold nodes after 1 of 3"] and data["deadline_s"] == 1
    assert data["validations"] == {"vanilla": "1/1", "restore": "1/1"} and data["two_commands"]["validated"] == "1/1"
    assert len(data["runs"]) == 1 and data["runs"][0]["validated"] and data["physical_limit"]["limit_s"] > 0


def test_arms_restore_side_by_side_in_turning_order_each_with_its_settings(tmp_path, monkeypatch):
    """--arm: one capture and one vanilla for all arms; each round restores a fresh node once per arm, the order
    turning a round, each arm's settings in its commands' environment (here: the weights' pieces in memory first, or
    straight to the node's disk, which each run's receipt tells; pinned by 1 MiB pieces, so that the small CPU
    model's weights come by pieces at all). An arm whose restores fail (no CRIU where it looks) is said, not timed,
    and the bench goes on."""
    needs_root_criu()
    monkeypatch.setenv("COLDSNAP_PIN_PIECE_MIB", "1")
    data = run_bench(tmp_path, "reference-cpu-cold-node", "--cold-node", "--samples", "2", "--vanilla-samples", "1",
                     "--arm", "memory=COLDSNAP_PULL_SPOOL=1", "--arm", "disk=COLDSNAP_PULL_SPOOL=0",
                     "--arm", f"broken=COLDSNAP_CRIU_PREFIX={tmp_path / 'no-criu'}")
    assert [r["arm"] for r in data["runs"]] == ["memory", "disk", "disk", "memory"]
    assert data["two_commands"] is None and data["validations"]["restore"] == "4/6"
    assert [(f["node"], f["arm"]) for f in data["failed"]] == [(1, "broken"), (2, "broken")]
    assert all("exit" in f["error"] for f in data["failed"])
    arms = data.pop("arms")
    assert arms.pop("broken") == {"settings": {"COLDSNAP_CRIU_PREFIX": str(tmp_path / "no-criu")}, "restore": None,
                                  "validations": "0/2", "ratio_median": None, "vs_limit": None, "span_medians_s": {}}
    assert list(arms) == ["memory", "disk"] and arms["disk"]["settings"] == {"COLDSNAP_PULL_SPOOL": "0"}
    assert all(r["spooled"] == (r["arm"] == "memory") and r["streamed"] for r in data["runs"])
    for name, arm in arms.items():
        mine = sorted(r["total_s"] for r in data["runs"] if r["arm"] == name)
        assert arm["validations"] == "2/2" and arm["restore"]["samples_s"] == [r["total_s"] for r in data["runs"]
                                                                               if r["arm"] == name]
        assert arm["restore"]["min_s"] == mine[0] and arm["vs_limit"] > 0
    assert data["restore"] == arms["memory"]["restore"]  # the first arm is the run's baseline


@pytest.mark.parametrize("args, error", [
    (["--deadline-s", "60"], "--deadline-s applies to --cold-node only"),
    (["--cold-node", "--deadline-s", "0"], "--deadline-s must be a positive number of seconds"),
    (["--arm", "a="], "--arm applies to --cold-node only"),
    (["--cold-node", "--arm", "a"], "want NAME=[SETTING=VALUE,...]"),
    (["--cold-node", "--arm", "a=HOME=/x"], "'HOME=/x' is not SETTING=VALUE with SETTING one of ColdSnap's settings"),
    (["--cold-node", "--arm", "a=", "--arm", "a=COLDSNAP_PULL_SPOOL=0"], "--arm: two arms named 'a'"),
])
def test_a_deadline_or_arm_the_bench_cannot_keep_is_refused_in_one_line(tmp_path, args, error):
    r = coldsnap_cli(tmp_path, "bench", *args)
    assert r.returncode == 2 and error in r.stderr and "Traceback" not in r.stderr
