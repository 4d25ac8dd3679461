"""The real sparkrun (PyPI 0.4.2, in its own Python 3.12 venv, not patched) with ColdSnap's plugin, on a private
dockerd, on localhost (coldsnap_bench.sparkrun.SparkrunLab): `sparkrun run` of a recipe starts cold while no
capsule exists; `sparkrun coldsnap capture` captures it; the next `sparkrun run` restores it, validated, and
sparkrun's own readiness, logs, status, watchdog and stop behave; a corrupt capsule starts cold with a receipt.
Reference engine and vLLM (CPU).

This host has no GPU, and sparkrun plans one rank per accelerator: the plugin's `cpu_slot` setting gives the host
one CPU slot through sparkrun's own hardware-probe extension (a stand-in for an accelerator, named so here and in
docs/sparkrun.md); everything after planning is sparkrun's own code path."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request

import pytest
from containers_fixture import ensure, needs_root, private_coldsnap

from coldsnap.base.paths import settings
from coldsnap_bench.sparkrun import SparkrunLab, free_port

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    needs_root()
    ensure("docker")
    base = tmp_path_factory.mktemp("sparkrun")
    with private_coldsnap(base):
        lab = SparkrunLab(base, {k: os.environ[k] for k in ("COLDSNAP_HOME", "COLDSNAP_RUN", "COLDSNAP_CRIU_PREFIX")})
        try:
            lab.start()
            yield lab
        finally:
            lab.stop()


@pytest.fixture(scope="module")
def ref(lab):
    port = free_port()
    return {"recipe": lab.recipe("ref", "reference", port), "port": port, "state": {}}


def run(lab, recipe, *extra, mode=None):
    r = lab.sparkrun("run", recipe.name, "--hosts", "localhost", "--no-follow", *extra, mode=mode)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Inference ready at" in out, out[-2000:]  # sparkrun's own readiness: a streamed chat token
    return out


def stop(lab, recipe):
    r = lab.sparkrun("stop", recipe.name, "--hosts", "localhost")
    assert r.returncode == 0, (r.stdout + r.stderr)[-1500:]
    deadline = time.monotonic() + 30
    while lab.containers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert lab.containers() == []


def complete(port: int, prompt: str, model: str = "tiny") -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


PROMPTS = ["ColdSnap says", "The capital of", "Once upon a time"]


def server_processes(lab, marker: str) -> list[str]:
    """The command lines in the (one) container's PID namespace that mention marker."""
    name = lab.containers()[0]
    r = lab.docker("exec", name, "sh", "-c", "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done")
    return [line for line in r.stdout.splitlines() if marker in line and "for p in" not in line]


def test_without_a_capsule_sparkrun_run_starts_cold(lab, ref):
    out = run(lab, ref["recipe"])
    assert "no capsule for this launch" in out
    launch = lab.last_launch()
    assert launch["decision"] == "cold" and launch["identity"]["engine"] == "reference"
    ref["state"]["texts"] = [complete(ref["port"], p) for p in PROMPTS]
    assert len(set(ref["state"]["texts"])) > 1
    stop(lab, ref["recipe"])


def test_captured_then_restored_by_sparkrun_run(lab, ref):
    r = lab.sparkrun("coldsnap", "capture", "ref", "--hosts", "localhost", "--no-follow", "--json")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    receipt = json.loads(r.stdout.strip().splitlines()[-1])
    assert receipt["state"] == "succeeded" and receipt["operation"] == "capture"
    tag = receipt["result"]["tag"]
    assert lab.containers() == []  # the capture took the container (sparkrun's --rm removed it)
    listed = lab.sparkrun("coldsnap", "ls", "--json")
    assert [c["tag"] for c in json.loads(listed.stdout)] == [tag]

    out = run(lab, ref["recipe"])
    launch = lab.last_launch()
    assert launch["decision"] == "restore" and launch["tag"] == tag, launch
    assert launch["receipt"]["state"] == "succeeded", launch["receipt"]
    assert [s["name"] for s in launch["receipt"]["spans"]] == ["admit", "stage", "criu-restore", "hydrate", "validate"]
    assert [complete(ref["port"], p) for p in PROMPTS] == ref["state"]["texts"]
    # No second server beside the restored one; sparkrun's log is the restored server's, still written to.
    servers = server_processes(lab, "coldsnap_reference.server")
    assert len(servers) == 1, servers
    logs = lab.sparkrun("logs", "ref", "--hosts", "localhost", "--tail", "20")
    assert logs.returncode == 0 and '"event": "resumed"' in logs.stdout, (logs.stdout + logs.stderr)[-1500:]
    status = lab.sparkrun("status", "--hosts", "localhost")
    assert "Total: 1 container(s)" in status.stdout, status.stdout
    ttft = [float(x) for x in re.findall(r"TTFT ([0-9.]+)s", out)]
    print(f"\n[measured] sparkrun's own TTFT of the restored launch: {ttft} s")

    # The watchdog: the server dies, the container stops (PID 1 exits with it) and sparkrun's --rm removes it.
    name = lab.containers()[0]
    pid = lab.docker("exec", name, "cat", "/tmp/sparkrun_serve.pid").stdout.strip()
    lab.docker("exec", name, "kill", "-9", pid, check=False)
    deadline = time.monotonic() + 30
    while lab.containers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert lab.containers() == []

    # Restored again, then `sparkrun stop` leaves nothing running.
    run(lab, ref["recipe"])
    assert lab.last_launch()["decision"] == "restore"
    stop(lab, ref["recipe"])
    with pytest.raises(OSError):
        complete(ref["port"], PROMPTS[0])


def test_a_corrupt_capsule_starts_cold_with_a_receipt(lab, ref):
    from coldsnap.capsule import CapsuleStore
    from coldsnap.contracts import capsule as mt

    store = CapsuleStore(settings().store)
    tag = json.loads(lab.sparkrun("coldsnap", "ls", "--json").stdout)[0]["tag"]
    cap = store.load(store.resolve(tag, allow_unpinned=True))
    layer = cap.layer(mt.LAYER_CRIU)
    missing = layer.__class__(layer.media_type, "sha256:" + "e" * 64, layer.size)
    time.sleep(1.1)  # newer than the good one: the one a launch picks
    bad = store.write_capsule(cap.profile, [missing if d is layer else d for d in cap.layers], {}, tag=tag)
    try:
        out = run(lab, ref["recipe"])
        launch = lab.last_launch()
        assert launch["decision"] == "cold" and "capsule-corrupt" in launch["reason"], launch
        assert "capsule-corrupt" in out
        failed = [json.loads(p.read_text()) for p in settings().receipts.glob("prepare-*.json")]
        assert any(r["state"] == "failed" and r["error"]["code"] == "capsule-corrupt" for r in failed), failed
        assert [complete(ref["port"], p) for p in PROMPTS] == ref["state"]["texts"]
        stop(lab, ref["recipe"])
    finally:
        from coldsnap.capsule.gc import remove

        remove(store, bad)


def test_a_vllm_recipe_is_restored_with_the_same_completions(lab):
    from test_engine_vllm import FIXTURE_MODEL, VLLM_VENV, completions, ensure_engine

    ensure_engine("vllm", VLLM_VENV)
    port = free_port()
    recipe = lab.recipe("tiny-vllm", "vllm", port, {"venv": VLLM_VENV, "model": FIXTURE_MODEL})
    run(lab, recipe, mode="cold")
    before = completions("127.0.0.1", port, "tiny-llama")
    assert len(set(before)) > 1
    stop(lab, recipe)
    r = lab.sparkrun("coldsnap", "capture", "tiny-vllm", "--hosts", "localhost", "--no-follow", "--json")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = run(lab, recipe)
    launch = lab.last_launch()
    assert launch["decision"] == "restore" and launch["receipt"]["state"] == "succeeded", launch
    assert completions("127.0.0.1", port, "tiny-llama") == before
    servers = server_processes(lab, "vllm.entrypoints.openai.api_server")
    assert len(servers) == 1, servers
    print(f"\n[measured] vLLM via sparkrun, restored: {re.findall(r'TTFT [0-9.]+s', out)}")
    stop(lab, recipe)
