"""`coldsnap demo`, as README's first command runs it: the reference engine on CPU, cold and restored, side by
side, with its JSON and chart; and without CRIU, a one-line error before any cold start."""
import json

import pytest
from conftest import coldsnap_cli, needs_root_criu


@pytest.mark.slow
def test_demo_restores_validated_and_writes_its_result(tmp_path):
    needs_root_criu()
    out = tmp_path / "out"
    r = coldsnap_cli(tmp_path, "demo", "--samples", "1", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(r.stdout)
    name = f"reference-cpu-{data['weights_mode']}"
    assert json.loads((out / f"{name}.json").read_text()) == data
    assert (out / f"{name}.png").stat().st_size > 0
    assert data["command"] == "coldsnap demo" and data["device"] == "cpu" and data["engine"] == "reference"
    assert data["validations"] == {"restore": "1/1", "vanilla": "1/1"} and data["fell_back"] == 0
    assert 0 < data["restore"]["median_s"] < data["vanilla"]["median_s"]


def test_demo_without_criu_says_so_before_any_cold_start(tmp_path, monkeypatch):
    monkeypatch.setenv("COLDSNAP_CRIU", str(tmp_path / "no-criu"))
    r = coldsnap_cli(tmp_path, "demo", "--samples", "1", "--out", str(tmp_path / "out"), timeout=120)
    assert r.returncode == 12, r.stderr[-2000:]
    assert "CRIU not found" in r.stderr and "Traceback" not in r.stderr
    assert "warm-up" not in r.stderr and not (tmp_path / "out").exists()
