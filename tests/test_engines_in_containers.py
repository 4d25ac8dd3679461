"""Real vLLM (CPU build) and SGLang servers in containers, through coldsnap-runtime under plain runc (runc 1.1 +
CRIU 4.2, no mocks).

Each engine's container runs its adapter's container launch (prepare_container: the argv and environment process
mode uses, with the engine venv, its interpreter, the model and ColdSnap's own prefix bound read-only at their host
paths), on a rootfs of the tests' making with private tmpfs for /tmp, $HOME and /dev/shm, in a pre-made network
namespace joined to the host by a veth: clients live on the host, outside the container, as a pod's clients do.

(1) vLLM: cold start through the shim (unannotated: pass-through) → 10 greedy completions → capture_container →
    the container is gone → an annotated create + start through the shim restores it → coldsnap-hook validates →
    the receipt says restored (succeeded, not fell-back) → the same 10 completions, identical.
(2) vLLM: 16 streamed completions in flight → capture_container(quiesce="none") → restore through the shim into the
    same network namespace → every stream finishes over its original connection, its text identical to an
    uninterrupted run of the same prompt.
(3) SGLang: as (1).
One cold start per engine (module-scoped fixtures); (2) captures the container (1) restored.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from containers_fixture import (
    RUNTIME,
    VethNetNS,
    healthy_at,
    make_engine_bundle,
    make_rootfs,
    module_lab,
    receipt,
    run_detached,
    runc,
    state,
    unique,
    wait_for,
)
from test_engine_sglang import SGLANG_VENV
from test_engine_vllm import FIXTURE_MODEL, PROMPTS, VLLM_VENV, completions, ensure_engine

from coldsnap.base.paths import settings
from coldsnap.contracts import CaptureRequest
from coldsnap.contracts import capsule as mt
from coldsnap.engines import get_adapter
from coldsnap.engines.base import PreparedLaunch

pytestmark = [pytest.mark.root, pytest.mark.slow]

PORT = 8000
VLLM_OPTIONS = {"venv": VLLM_VENV, "model": FIXTURE_MODEL, "enforce_eager": True, "max_model_len": 2048}
SGLANG_OPTIONS = {"venv": SGLANG_VENV, "model": FIXTURE_MODEL}
STREAMS = 16
STREAM_TOKENS = 1900  # with ignore_eos: every stream runs the whole way (~10 s for 16 on this 2-core machine)
STREAM_PACE = 80  # tokens/s a client reads: in flight for ≥ 24 s whatever the machine's speed (capture takes ~10 s)
STREAM_PROMPTS = [f"{p} (stream {i})" for i, p in enumerate(PROMPTS + PROMPTS[:STREAMS - len(PROMPTS)])]
CLIENTS = Path(__file__).with_name("stream_clients.py")
MEASURED: dict[str, dict] = {}  # printed at the end of each engine's tests: what the README reports


class Lab:
    def __init__(self, base: Path):
        self.base = base
        self.rootfs = make_rootfs(base / "rootfs")
        self.runc_root = base / "runc-root"
        self.netns: list[VethNetNS] = []

    def network(self) -> VethNetNS:
        ns = VethNetNS("cseng")
        self.netns.append(ns)
        return ns

    def shim(self, *args: str) -> subprocess.CompletedProcess:
        """coldsnap-runtime as a container engine calls it: --root, /dev/null stdin, files for stdout/stderr (a
        container started cold inherits them, and would hold a pipe open)."""
        out, err = (self.base / f"shim-{uuid.uuid4().hex}.{n}" for n in ("out", "err"))
        with open(os.devnull, "rb") as null, open(out, "w") as o, open(err, "w") as e:
            r = subprocess.run([str(RUNTIME), "--root", str(self.runc_root), *args], stdin=null, stdout=o, stderr=e,
                               timeout=900)
        r.stdout, r.stderr = out.read_text(), err.read_text()
        out.unlink()
        err.unlink()
        return r

    def remove(self, cid: str) -> None:
        runc(self.runc_root, "delete", "-f", cid)

    def cleanup(self) -> None:
        for cid in runc(self.runc_root, "list", "-q").stdout.split():
            self.remove(cid)
        for ns in self.netns:
            ns.delete()
        for big in (self.base / "home" / "staged", self.base / "home" / "store"):  # GBs of images; receipts stay
            shutil.rmtree(big, ignore_errors=True)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with module_lab(tmp_path_factory, "engines-in-containers", Lab) as made:
        yield made


class EngineContainer:
    """One engine's container as the tests drive it: its launch, network namespace and the container serving now."""

    def __init__(self, lab: Lab, engine: str, options: dict):
        self.lab, self.engine = lab, engine
        self.launch = get_adapter(engine).prepare_container(
            CaptureRequest(operation="capture", engine={"name": engine, "options": options}))
        self.served = self.launch.model_id
        self.ns = lab.network()
        self.address = self.ns.address
        self.cid: str | None = None

    def bundle(self, name: str, capsule: str | None = None) -> Path:
        ann = {mt.ANNOTATION_CAPSULE: capsule} if capsule else None
        return make_engine_bundle(self.lab.base / "bundles" / name, self.lab.rootfs, self.launch, self.ns.name, ann)

    def completions(self) -> list[str]:
        return completions(self.address, PORT, self.served)

    def cold_start(self) -> dict:
        """Unannotated `run -d` through the shim: runc's own path. Returns the times it took."""
        bundle = self.bundle(f"{self.engine}-cold")
        self.cid = unique(f"{self.engine}-cold")
        t0 = time.monotonic()
        r = run_detached(str(RUNTIME), self.lab.runc_root, bundle, self.cid)
        assert r.returncode == 0, r.stderr
        assert not (settings().run / "shim" / f"{self.cid}.json").exists()  # the shim let runc do it all
        wait_for(lambda: healthy_at(self.address, PORT)
                 or (state(self.lab.runc_root, self.cid) or {}).get("status") != "running",
                 900, f"{self.engine} to answer /health")
        assert healthy_at(self.address, PORT), f"the {self.engine} container stopped before it served"
        ready = time.monotonic() - t0
        completions(self.address, PORT, self.served, prompts=PROMPTS[:1])
        return {"cold_ready_s": round(ready, 1), "cold_first_completion_s": round(time.monotonic() - t0, 1)}

    def capture(self, tag: str, **kw):
        from coldsnap.flows.container_capture import capture_container

        t0 = time.monotonic()
        res = capture_container(self.cid, self.lab.runc_root, engine=self.engine, tag=tag, **kw)
        return res, time.monotonic() - t0

    def restore(self, capsule: str, name: str) -> dict:
        """Annotated create + start through the shim, in the same network namespace (the pod's, kept)."""
        bundle = self.bundle(name, capsule)
        cid = unique(name)
        t0 = time.monotonic()
        created = self.lab.shim("create", "--bundle", str(bundle), "--pid-file", str(self.lab.base / f"{cid}.pid"),
                                cid)
        assert created.returncode == 0, created.stderr
        self.cid = cid
        started = self.lab.shim("start", cid)
        wall = time.monotonic() - t0
        assert started.returncode == 0, started.stderr
        return {"id": cid, "create": created, "start": started, "wall_s": wall, "receipt": receipt(cid)}


def check_capture(res, engine: str, launch, quiesce: str) -> None:
    rec = res.receipt.model_dump(mode="json")
    assert rec["state"] == "succeeded" and rec["operation"] == "capture", rec.get("error")
    p = res.profile
    assert p.snapshot_driver == "criu-runc" and p.engine.name == engine and p.weights_mode == "native"
    assert p.launch.command == launch.argv  # the container's process is the adapter's launch, unchanged
    assert "--tcp-established" in p.criu_options and "--link-remap" in p.criu_options
    spans = {s["name"] for s in rec["spans"]}
    assert {"validate", "criu-dump", "pack"} <= spans
    if quiesce == "drain":
        assert {"release", "quiesce"} <= spans and "--network-lock=skip" in p.criu_options
    else:
        assert not {"release", "quiesce"} & spans and "--network-lock=nftables" in p.criu_options
        assert p.kv_discarded is False and rec["result"]["quiesce"] == "none"


def check_restored(restored: dict, expected_text: str) -> None:
    rec = restored["receipt"]
    assert rec["state"] == "succeeded" and rec["operation"] == "restore", rec  # restored, not fell-back
    assert "fallback_reason" not in rec["result"]
    assert [s["name"] for s in rec["spans"]] == ["admit", "stage", "criu-restore", "hydrate", "validate"]
    assert rec["result"]["validated_text"] == expected_text
    assert "validated" in restored["start"].stderr  # coldsnap-hook's one line at poststart


def summary(engine: str) -> None:
    print(f"\n[measured] {engine} in a container through coldsnap-runtime: {json.dumps(MEASURED[engine])}")


# --- vLLM -------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_cold(lab):
    """The vLLM container started cold through the shim, its 10 completions and the 16 streams' reference texts
    (uninterrupted, the same concurrency as the in-flight run)."""
    ensure_engine("vllm", VLLM_VENV)
    ctr = EngineContainer(lab, "vllm", VLLM_OPTIONS)
    MEASURED["vllm"] = ctr.cold_start()
    before = ctr.completions()
    assert len(set(before)) > 1, before  # not degenerate
    t0 = time.monotonic()
    reference = StreamClients(ctr).finish()
    MEASURED["vllm"]["uninterrupted_16_streams_s"] = round(time.monotonic() - t0, 1)
    assert all(r["error"] is None and r["text"] for r in reference), [r["error"] for r in reference]
    return {"ctr": ctr, "before": before, "reference": [r["text"] for r in reference]}


@pytest.fixture(scope="module")
def vllm_restored(lab, vllm_cold):
    """(1): capture the cold container (drain), restore it through the shim."""
    ctr = vllm_cold["ctr"]
    cold_cid = ctr.cid
    res, took = ctr.capture("ctr-vllm")
    gone = state(lab.runc_root, cold_cid) is None
    restored = ctr.restore(res.capsule, "vllm-restored")
    after = ctr.completions()
    m = MEASURED["vllm"]
    m.update(capture_s=round(took, 1), capsule_mib=round(res.receipt.result.capsule_bytes / 2**20),
             criu_dump_s=_span(res.receipt.model_dump(), "criu-dump"),
             restore_create_start_s=round(restored["wall_s"], 2),
             restore_ttft_s=restored["receipt"]["result"]["time_to_first_token_s"],
             restore_criu_s=_span(restored["receipt"], "criu-restore"), stage_s=_span(restored["receipt"], "stage"))
    return {"capture": res, "gone": gone, "restored": restored, "after": after}


def _span(rec: dict, name: str) -> float:
    return next(round(s["duration_s"], 2) for s in rec["spans"] if s["name"] == name)


@pytest.mark.timeout(3600)
def test_vllm_cold_capture_restore_through_the_shim(lab, vllm_cold, vllm_restored):
    ctr = vllm_cold["ctr"]
    res = vllm_restored["capture"]
    check_capture(res, "vllm", ctr.launch, "drain")
    assert vllm_restored["gone"]  # captured and stopped, as in process mode
    assert not list((settings().run / "capture").iterdir())  # no temporary images left
    restored = vllm_restored["restored"]
    check_restored(restored, res.profile.expected_text)
    assert state(lab.runc_root, restored["id"])["status"] == "running"
    assert vllm_restored["after"] == vllm_cold["before"]  # token for token


class StreamClients:
    """The 16 streaming clients, in their own process on the host (outside every container namespace)."""

    def __init__(self, ctr: EngineContainer, pace: float = 0):
        self.proc = subprocess.Popen([sys.executable, str(CLIENTS), ctr.address, str(PORT), ctr.served,
                                      str(STREAM_TOKENS), str(pace), *STREAM_PROMPTS],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_started(self, timeout: float = 300) -> None:
        """Until every stream has its first token."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        assert line.startswith("started"), f"the streams did not start: {line!r} {self.proc.poll()}"

    def finish(self, timeout: float = 900) -> list[dict]:
        out, err = self.proc.communicate(timeout=timeout)
        lines = [ln for ln in out.splitlines() if ln.startswith("[")]
        assert self.proc.returncode == 0 and lines, f"stream clients failed: {err[-2000:]}"
        return json.loads(lines[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.mark.timeout(3600)
def test_vllm_capture_with_16_streams_in_flight(lab, vllm_cold, vllm_restored):
    from coldsnap.net.lock import criu_lock_tables

    ctr = vllm_cold["ctr"]
    netns = f"/var/run/netns/{ctr.ns.name}"
    serving = ctr.cid
    clients = StreamClients(ctr, pace=STREAM_PACE)
    try:
        clients.wait_started()
        t_capture = time.monotonic()
        res, took = ctr.capture("ctr-vllm-in-flight", quiesce="none")
        t_captured = time.monotonic()
        check_capture(res, "vllm", ctr.launch, "none")
        # Every stream's connection (the capture's own validation connection may still be closing: ≥)
        assert res.receipt.result.connections_in_flight >= STREAMS
        assert state(lab.runc_root, serving) is None
        # Until the restore, CRIU's lock holds the namespace: the clients' packets meet silence, not a reset.
        assert criu_lock_tables(netns), "no network lock between the dump and the restore"
        restored = ctr.restore(res.capsule, "vllm-in-flight")
        check_restored(restored, res.profile.expected_text)
        assert criu_lock_tables(netns) == []  # the restore unlocked it
        results = clients.finish()
    finally:
        clients.kill()
    m = MEASURED["vllm"]
    m.update(in_flight_capture_s=round(took, 1), in_flight_criu_dump_s=_span(res.receipt.model_dump(), "criu-dump"),
             in_flight_capsule_mib=round(res.receipt.result.capsule_bytes / 2**20),
             in_flight_restore_create_start_s=round(restored["wall_s"], 2),
             in_flight_restore_ttft_s=restored["receipt"]["result"]["time_to_first_token_s"],
             streams_longest_pause_s=round(max(longest_gap(r["times"]) for r in results), 1))
    for i, (r, want) in enumerate(zip(results, vllm_cold["reference"])):
        assert r["error"] is None, f"stream {i}: {r['error']}"
        assert any(t < t_capture for t in r["times"]), f"stream {i} had not started when the capture began"
        assert any(t > t_captured for t in r["times"]), f"stream {i} was not in flight: it finished before the restore"
        assert r["text"] == want, f"stream {i} differs from its uninterrupted run"  # all STREAM_TOKENS of it
    assert ctr.completions() == vllm_cold["before"]  # and it serves on as before
    summary("vllm")
    lab.remove(ctr.cid)  # before SGLang starts: one engine at a time on this machine


def longest_gap(times: list[float]) -> float:
    """A stream's longest wait between two tokens: what its client saw of the capture and the restore."""
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


# --- SGLang -----------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(3600)
def test_sglang_cold_capture_restore_through_the_shim(lab):
    ensure_engine("sglang", SGLANG_VENV)
    ctr = EngineContainer(lab, "sglang", SGLANG_OPTIONS)
    MEASURED["sglang"] = ctr.cold_start()
    before = ctr.completions()
    assert len(set(before)) > 1, before
    cold_cid = ctr.cid
    res, took = ctr.capture("ctr-sglang")
    check_capture(res, "sglang", ctr.launch, "drain")
    assert state(lab.runc_root, cold_cid) is None
    restored = ctr.restore(res.capsule, "sglang-restored")
    check_restored(restored, res.profile.expected_text)
    assert ctr.completions() == before
    MEASURED["sglang"].update(
        capture_s=round(took, 1), capsule_mib=round(res.receipt.result.capsule_bytes / 2**20),
        criu_dump_s=_span(res.receipt.model_dump(), "criu-dump"), restore_create_start_s=round(restored["wall_s"], 2),
        restore_ttft_s=restored["receipt"]["result"]["time_to_first_token_s"],
        restore_criu_s=_span(restored["receipt"], "criu-restore"), stage_s=_span(restored["receipt"], "stage"))
    summary("sglang")
    lab.remove(ctr.cid)


# --- what the in-flight mode leaves behind, and bad input -------------------------------------------------------------
def answer(address: str, port: int = 9) -> str:
    """What a TCP connect from the host to the namespace meets."""
    import socket

    try:
        socket.create_connection((address, port), timeout=1.5).close()
        return "accepted"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silence"


def test_a_cold_fallback_removes_a_network_lock_left_for_a_restore(lab):
    """An in-flight capture leaves CRIU's lock in the namespace for the restore; when the shim falls back to a cold
    start there instead, it removes the lock first (else the cold start would serve nobody)."""
    from coldsnap.net.lock import criu_lock_tables

    ns = lab.network()
    netns = f"/var/run/netns/{ns.name}"
    subprocess.run(["ip", "netns", "exec", ns.name, "nft", "add", "table", "inet", "CRIU-test-lock"], check=True)
    subprocess.run(["ip", "netns", "exec", ns.name, "nft", "add", "chain", "inet", "CRIU-test-lock", "input",
                    "{ type filter hook input priority 0 ; policy drop ; }"], check=True)
    assert criu_lock_tables(netns) == [("inet", "CRIU-test-lock")]
    assert answer(ns.address) == "silence"  # locked: even a closed port does not answer
    launch = PreparedLaunch(argv=["/bin/sh", "-c", "sleep 1000"], env={}, weights_mode="native", model=None)
    bundle = make_engine_bundle(lab.base / "bundles" / "locked", lab.rootfs, launch, ns.name,
                                {mt.ANNOTATION_CAPSULE: "sha256:" + "0" * 64})  # no such capsule: fall back
    cid = unique("locked")
    r = lab.shim("create", "--bundle", str(bundle), cid)
    assert r.returncode == 0, r.stderr
    rec = receipt(cid)
    assert rec["state"] == "fell-back" and rec["result"]["network_lock_removed"] == ["inet CRIU-test-lock"]
    assert criu_lock_tables(netns) == []
    assert answer(ns.address) == "refused"  # the namespace answers again (nothing listens: a reset)
    lab.remove(cid)


def test_in_flight_capture_is_for_containers_and_bad_input_is_one_line(lab):
    coldsnap = str(Path(sys.executable).with_name("coldsnap"))
    r = subprocess.run([coldsnap, "capture", "--quiesce", "none"], capture_output=True, text=True)
    assert r.returncode == 2 and "container capture only" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    from coldsnap.contracts import ColdSnapError, ErrorCode
    from coldsnap.flows.container_capture import capture_container

    with pytest.raises(ColdSnapError) as e:
        capture_container("whatever", lab.runc_root, quiesce="sometimes")
    assert e.value.code == ErrorCode.INVALID_REQUEST and "quiesce" in e.value.message
