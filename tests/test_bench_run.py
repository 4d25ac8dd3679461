"""`coldsnap bench --template`, for real (reference engine on CPU, real CRIU): vanilla starts, full-state restores
and template restores in one run; each restore's clock split into its parts (they add up to its time to first
token), the template's device work phase by phase, and a chart."""

import pytest
from conftest import needs_root_criu, run_bench

pytestmark = pytest.mark.slow


def test_bench_splits_each_restore_and_times_the_templates_device_work(tmp_path):
    needs_root_criu()
    data = run_bench(tmp_path, "reference-cpu-recovery-template", "--template", "--samples", "2",
                     "--vanilla-samples", "1")
    assert data["validations"] == {"vanilla": "1/1", "restore": "2/2"}
    assert len(data["restore_parts"]) == 2
    for parts, ttft in zip(data["restore_parts"], data["restore"]["samples_s"]):
        assert list(parts) == ["network", "criu-restore", "cuda driver", "engine resume", "first token"]
        assert parts["criu-restore"] > 0 and abs(sum(parts.values()) - ttft) < 0.01
    template = data["template"]
    assert template["validated"] == "2/2"
    work = template["device_work_medians_s"]
    assert {"cuda_init", "load", "build", "warmup"} <= set(work)
    assert sum(work.values()) < template["span_medians_s"]["hydrate"]  # inside the template's hydrate
