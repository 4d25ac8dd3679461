"""A restore whose weights are still arriving resumes the engine once the prefetchers hold them all, before the
engine's files do: each adapter reads from its engine's resume answer whether the engine took the prefetched copy
(the restore refuses to let it serve otherwise). The answers here are shaped as the engines give them (the
reference engine's from a GPU container receipt, bench/results/reference-cuda-container-h100.receipts.json; vLLM's
from its worker extension, coldsnap.gpu.vllm_worker)."""

import json
from pathlib import Path

import pytest

from coldsnap.engines import get_adapter

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_the_reference_engine_says_whether_it_took_the_prefetched_weights():
    reference = get_adapter("reference")
    receipts = json.loads((RESULTS / "reference-cuda-container-h100.receipts.json").read_text())["receipts"]
    resumed = next(r for r in receipts if r["operation"] == "restore")["result"]["hydrate"]["engine_resume"]
    assert reference.prefetch_taken(resumed) is True  # a real GPU restore that took them
    assert reference.prefetch_taken({"weights_reload": {"bytes": 1, "seconds": 0.5}}) is False  # read the file
    assert reference.prefetch_taken({"weights_reload": {"prefetched": True, "prefetch_error": "x"}}) is False
    assert reference.prefetch_taken({"released": False}) is None  # nothing reloaded: nothing to say
    # and why not, for the restore's error
    assert reference.prefetch_error(resumed) is None
    assert reference.prefetch_error({"weights_reload": {"prefetched": True, "prefetch_error": "PrefetchError: x"}}) \
        == "PrefetchError: x"


@pytest.mark.parametrize("resumed, taken", [
    ({"reload": {"files": 4, "prefetched": 4, "filled": 0}}, True),
    ({"reload": {"files": 4, "prefetched": 3, "filled": 1, "errors": ["model-1.safetensors: gone"]}}, False),
    ({"reload_fallback": "ColdSnap's reload failed (…): vLLM's reload_weights instead"}, False),
    ({"wake_s": 0.2}, None),
])
def test_vllm_says_whether_it_took_the_prefetched_weights(resumed, taken):
    assert get_adapter("vllm").prefetch_taken(resumed) is taken
    assert (get_adapter("vllm").prefetch_error(resumed) is not None) is ("reload_fallback" in resumed)
