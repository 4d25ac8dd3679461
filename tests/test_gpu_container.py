"""The reference engine inside a runc container, through coldsnap-runtime, on a GPU and on the CPU (no mocks).

Cold start (unannotated: runc's own path) → two greedy completions → capture_container in recovery mode (the
engine releases weights and KV, the CUDA state of the container's processes is checkpointed by host PID, then
`runc checkpoint`) → the container is gone → an annotated create + start through the shim restores it, the CUDA
state comes back, the engine reloads its weights → coldsnap-hook validates → the same completion text.
A node that never saw the capsule (empty store, no weights file) restores it from a registry the same way, the
container restored while its weights stream in (coldsnap.flows.streaming).

The container runs the adapter's container launch (prepare_container: this interpreter, ColdSnap and the
PYTHONPATH read-only, the model directory read-write, all at their host paths). On a GPU it sees the GPUs as a device
plugin (CDI) would show them: every /dev/nvidia* character device, allowed in its device cgroup; the driver's
libraries come with the host /usr the rootfs borrows. The cuda case runs on the GPU machine
(packaging/device/gpu-container.sh) and skips elsewhere, saying so; the cpu case runs everywhere."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
from containers_fixture import (
    RUNTIME,
    VethNetNS,
    ensure,
    healthy_at,
    make_engine_bundle,
    make_rootfs,
    needs_root,
    private_coldsnap,
    receipt,
    run_detached,
    runc,
    state,
    unique,
    wait_for,
)
from registry_fixture import Throttle, registry  # noqa: F401  (fixture)
from test_engine_vllm import completions

from coldsnap.contracts import CaptureRequest
from coldsnap.contracts import capsule as mt
from coldsnap.engines import get_adapter
from coldsnap.engines.reference import MODEL_ID

pytestmark = [pytest.mark.root, pytest.mark.slow]

PORT = 8000
# COLDSNAP_TEST_CONTAINER_SHAPE=bench: the cuda case at the GPU bench's 10.9 GB shape (packaging/device/gpu-bench.sh)
SHAPES = {"bench": {"layers": 6, "hidden": 6144, "heads": 48, "kv_mib": 4096}}
OPTIONS = {"cuda": SHAPES.get(os.environ.get("COLDSNAP_TEST_CONTAINER_SHAPE", ""),
                              {"layers": 4, "hidden": 2048, "heads": 16, "kv_mib": 1024}),
           "cpu": {"layers": 2, "hidden": 256, "heads": 4, "kv_mib": 4, "compile": False, "threads": 1}}
PROMPTS = ["The GPU in a container says", "Restored from a capsule:"]


def gpu_devices() -> list[dict]:
    devices = []
    for path in sorted(Path("/dev").glob("nvidia*")):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            devices.append({"path": str(path), "type": "c", "major": os.major(st.st_rdev),
                            "minor": os.minor(st.st_rdev), "fileMode": 0o666, "uid": 0, "gid": 0})
    return devices


def with_gpus(bundle: Path) -> Path:
    """Every /dev/nvidia* in the container and in its device cgroup, plus the host's linker cache (libcuda is found
    through it), as the NVIDIA container toolkit would add them."""
    path = bundle / "config.json"
    spec = json.loads(path.read_text())
    devices = gpu_devices()
    spec["linux"]["devices"] = devices
    spec["linux"]["resources"]["devices"] += [{"allow": True, "type": "c", "major": d["major"], "minor": d["minor"],
                                               "access": "rwm"} for d in devices]
    if Path("/etc/ld.so.cache").exists():
        spec["mounts"].append({"destination": "/etc/ld.so.cache", "type": "bind", "source": "/etc/ld.so.cache",
                               "options": ["rbind", "ro"]})
    path.write_text(json.dumps(spec, indent=1))
    return bundle


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    needs_root()
    if shutil.which("runc") is None:
        ensure("base")
    base = tmp_path_factory.mktemp("gpu-container")
    with private_coldsnap(base):
        runc_root, ns = base / "runc-root", VethNetNS("csgpu")
        try:
            yield {"base": base, "rootfs": make_rootfs(base / "rootfs"), "runc_root": runc_root, "ns": ns}
        finally:
            for cid in runc(runc_root, "list", "-q").stdout.split():
                runc(runc_root, "delete", "-f", cid)
            ns.delete()


def shim(lab, *args: str):
    import subprocess

    return subprocess.run([str(RUNTIME), "--root", str(lab["runc_root"]), *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=900)


@dataclass
class Captured:
    device: str
    capsule: str
    profile: object  # the capsule's profile
    before: list  # the cold container's completions
    cold_s: float
    bundle: Callable[..., Path]  # bundle(name, capsule reference or None): an engine bundle of this launch


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def captured(request, lab) -> Iterator[Captured]:
    """Cold start (unannotated: runc's own path) → two greedy completions → capture_container in recovery mode; the
    cold container is gone afterwards. On the CPU the weights are pinned by 1 MiB pieces (so that the small model
    has several, for the streamed restore); on a GPU by the default 256 MiB."""
    from coldsnap.flows.container_capture import capture_container

    device = request.param
    if device == "cuda" and not any(d["path"][len("/dev/nvidia"):].isdigit() for d in gpu_devices()):
        pytest.skip("no NVIDIA GPU here: the cuda case runs on the GPU machine (packaging/device/gpu-container.sh)")
    launch = get_adapter("reference").prepare_container(CaptureRequest(
        operation="capture", engine={"name": "reference", "options": OPTIONS[device]},
        launch={"devices": ["cuda:0"] if device == "cuda" else [], "port": PORT}, policy={"weights_mode": "recovery"}))
    assert launch.argv[launch.argv.index("--device") + 1] == device
    ns, root = lab["ns"], lab["runc_root"]

    def bundle(name: str, capsule: str | None = None) -> Path:
        ann = {mt.ANNOTATION_CAPSULE: capsule} if capsule else None
        made = make_engine_bundle(lab["base"] / "bundles" / f"{device}-{name}", lab["rootfs"], launch, ns.name, ann)
        return with_gpus(made) if device == "cuda" else made

    assert not healthy_at(ns.address, PORT), "another engine still answers in the lab's namespace"
    cid = unique(f"{device}-cold")
    t0 = time.monotonic()
    r = run_detached(str(RUNTIME), root, bundle("cold"), cid)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: healthy_at(ns.address, PORT) or (state(root, cid) or {}).get("status") != "running", 600,
             f"the engine on {device} to answer /health")
    assert healthy_at(ns.address, PORT), f"the {device} container stopped before it served"
    cold_s = time.monotonic() - t0
    before = completions(ns.address, PORT, MODEL_ID, prompts=PROMPTS)

    with pytest.MonkeyPatch.context() as mp:
        if device == "cpu":
            mp.setenv("COLDSNAP_PIN_PIECE_MIB", "1")
        made = capture_container(cid, root, engine="reference", weights_mode="recovery", tag=f"{device}-container")
    rec = made.receipt.model_dump(mode="json")
    assert rec["state"] == "succeeded", rec.get("error")
    # On a GPU, the container's CUDA state was checkpointed by host PID.
    assert (rec["result"]["cuda_processes"] >= 1) == (device == "cuda")
    assert made.profile.snapshot_driver == "criu-runc" and made.profile.weights_mode == "recovery"
    # the weights file it reloads, seen at its host path: pinned, so the restore checks it (and prefetches it)
    assert made.profile.model and made.profile.model.weights, "the container's weights file was not pinned"
    assert state(root, cid) is None or state(root, cid).get("status") != "running"
    runc(root, "delete", "-f", cid)
    print(f"\n[measured] {device} container: cold start to /health {cold_s:.1f} s; capture zero pages "
          f"{rec['result'].get('zero_pages')}")
    yield Captured(device, made.capsule, made.profile, before, cold_s, bundle)


def restored_through_the_shim(lab, captured: Captured, name: str, reference: str) -> dict:
    """An annotated create + start through the shim; the restored container's receipt, once it served the same
    completions as the cold one (and is deleted: the next case serves at the same address)."""
    ns, root = lab["ns"], lab["runc_root"]
    rid = unique(f"{captured.device}-{name}")
    created = shim(lab, "create", "--bundle", str(captured.bundle(name, reference)), rid)
    assert created.returncode == 0, created.stderr
    started = shim(lab, "start", rid)
    assert started.returncode == 0, started.stderr
    restored = receipt(rid)
    try:
        assert restored["state"] == "succeeded" and restored["operation"] == "restore", restored  # not fell-back
        assert restored["result"]["validated_text"] == captured.profile.expected_text
        after = completions(ns.address, PORT, MODEL_ID, prompts=PROMPTS)
    finally:
        runc(root, "delete", "-f", rid)
    assert after == captured.before
    print(f"\n[measured] {captured.device} container, {name}: restore receipt "
          f"{json.dumps({k: restored['result'].get(k) for k in ('time_to_first_token_s', 'hydrate', 'pull')})}; "
          f"spans {[(s['name'], round(s['start_s'], 2), round(s['duration_s'], 2)) for s in restored['spans']]}; "
          f"CRIU's own {restored['result'].get('criu_stats')}")
    return restored


def test_container_captured_and_restored_through_the_shim(lab, captured):
    restored = restored_through_the_shim(lab, captured, "restored", captured.capsule)
    if captured.device == "cuda":  # the weights came onto the GPU while CRIU and the driver restored
        assert restored["result"]["hydrate"]["prefetch"].get("served"), restored["result"]["hydrate"]


def a_fresh_node(captured: Captured, registry, repo: str, tmp_path: Path, monkeypatch,
                 weights_s: int | None) -> tuple:
    """The capsule pushed to registry/coldsnap/REPO; this process then a node with an empty store and staging area
    and no weights file (renamed to PATH.gone: the caller puts it back), its weights spooled in memory as they
    arrive. weights_s: the weights throttled to take about that long (the rest at full speed). Returns (the
    weights file, the node's directory, the throttling proxy or None); both addresses are insecure registries."""
    from coldsnap.base.paths import settings
    from coldsnap.capsule import CapsuleStore
    from coldsnap.capsule.registry import push

    push(CapsuleStore(settings().store), captured.capsule, f"{registry}/coldsnap/{repo}:{captured.device}",
         insecure=True)
    weights = captured.profile.model.weights[0]
    node = tmp_path / "node"
    monkeypatch.setenv("COLDSNAP_STORE", str(node / "store"))
    monkeypatch.setenv("COLDSNAP_STAGED", str(node / "staged"))
    monkeypatch.setenv("COLDSNAP_PULL_SPOOL", "1")
    upstream = Throttle(registry, rate=max(weights.size // weights_s, 1 << 20), only=weights.sha256) \
        if weights_s else None
    monkeypatch.setenv("COLDSNAP_INSECURE_REGISTRIES", ",".join([str(registry)] + ([upstream.address] if upstream
                                                                                     else [])))
    os.rename(weights.path, weights.path + ".gone")
    return weights, node, upstream


def test_a_fresh_node_restores_the_container_while_its_weights_stream_in(lab, captured, registry, tmp_path,
                                                                         monkeypatch):  # noqa: F811
    """The capsule pushed to a registry; a node with an empty store and staging area and no weights file: the
    shim pulls the annotation's reference, links the weights file to its blob's partial file and `runc restore`s
    the container while the pieces still arrive (on the CPU through a throttling proxy, so that they take ~3 s);
    the engine resumes once every piece is checked (on a GPU from the prefetched copy, else from its file); the
    container serves the cold container's completions, and the weights file is the store's listed blob."""
    from coldsnap.capsule import CapsuleStore

    # the weights take a few seconds, the rest comes at full speed
    weights, node, upstream = a_fresh_node(captured, registry, "stream", tmp_path, monkeypatch,
                                           weights_s=3 if captured.device == "cpu" else None)
    address = upstream.address if upstream else str(registry)
    try:
        restored = restored_through_the_shim(lab, captured, "streamed",
                                             f"{address}/coldsnap/stream@{captured.capsule}")
        result, names = restored["result"], [s["name"] for s in restored["spans"]]
        assert result["pull"]["streamed"] is True, result["pull"]
        assert "weights" not in names, names  # nothing waited for them before CRIU
        assert result["stage_parts"].get("unpack_early"), result["stage_parts"]  # the images unpacked as they came
        if upstream is not None:  # CRIU restored the container mid-stream
            criu = next(s for s in restored["spans"] if s["name"] == "criu-restore")
            assert criu["start_s"] + criu["duration_s"] < result["pull"]["seconds"], (restored["spans"], result)
            assert result["hydrate"]["weights_wait_s"] > 0, result["hydrate"]
        store = CapsuleStore(node / "store")
        assert any(m["digest"] == captured.capsule for m in store.index())
        assert os.path.samefile(weights.path, store.blob_path("sha256:" + weights.sha256))
    finally:
        if upstream is not None:
            upstream.close()
        os.replace(weights.path + ".gone", weights.path)


def test_a_shim_killed_while_the_weights_stream_leaves_nothing_and_the_next_restore_works(
        lab, captured, registry, tmp_path, monkeypatch):  # noqa: F811
    """The shim's annotated create on a fresh node, SIGKILLed once `runc restore` has the container and its
    weights are still streaming (linked at their path): whatever looks next (coldsnap.flows.recovery) deletes the
    half-restored container and removes the link; the store lists neither the capsule nor the weights blob; the
    next create restores and serves the cold container's completions. The CPU case only: a GPU's restore is too
    quick to be caught mid-stream without a throttle, which the GPU machine's run does not use."""
    import signal
    import subprocess

    from coldsnap.capsule import CapsuleStore
    from coldsnap.flows.recovery import recover
    from coldsnap.oci import records

    if captured.device != "cpu":
        pytest.skip("the kill is timed by a throttled stream, which only the CPU case uses")
    weights, node, upstream = a_fresh_node(captured, registry, "killed", tmp_path, monkeypatch, weights_s=6)
    assert upstream is not None
    rid = unique("cpu-killed")
    try:
        shim_cmd = [str(RUNTIME), "--root", str(lab["runc_root"]), "create", "--bundle",
                    str(captured.bundle("killed", f"{upstream.address}/coldsnap/killed@{captured.capsule}")), rid]
        proc = subprocess.Popen(shim_cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120

        def restoring() -> bool:  # runc has the container, the weights still on their way
            record = records.load(rid)
            return record is not None and record.outcome == records.Outcome.RESTORING and \
                (state(lab["runc_root"], rid) or {}).get("status") in ("created", "running")

        while not restoring():
            assert proc.poll() is None and time.monotonic() < deadline, "the shim ended before it restored"
            time.sleep(0.05)
        assert os.path.exists(weights.path)  # linked to the partial while the pieces arrive
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        done = recover()
        assert any(f"container {rid} was interrupted" in line for line in done), done
        assert any("interrupted" in line and "container-restore" in line for line in done), done
        assert state(lab["runc_root"], rid) is None and not os.path.exists(weights.path)
        store = CapsuleStore(node / "store")
        assert store.index() == [] and not store.has_blob("sha256:" + weights.sha256)
    finally:
        upstream.close()
        runc(lab["runc_root"], "delete", "-f", rid)
    try:  # the next create, at full speed: it pulls what is missing and serves
        restored_through_the_shim(lab, captured, "after-kill", f"{registry}/coldsnap/killed@{captured.capsule}")
        assert os.path.samefile(weights.path, CapsuleStore(node / "store").blob_path("sha256:" + weights.sha256))
    finally:
        os.replace(weights.path + ".gone", weights.path)


def test_vllm_on_a_gpu_in_a_container_through_the_shim(lab):
    """vLLM's CUDA build (API server and engine core, torch.compile, CUDA graphs) in a runc container: cold start,
    greedy completions with logprobs, capture_container in recovery mode (sleep level 2: weights and KV cache
    released before the checkpoint), restore through the shim's annotated create + start (weights reloaded by
    ColdSnap's worker extension from the pinned files), held to the cold container's tokens and logprobs."""
    from test_engine_vllm_gpu import MODEL, SITE, assert_same, greedy, needs_vllm_on_cuda

    from coldsnap.engines.venv_engine import describe_model_dir
    from coldsnap.flows.container_capture import capture_container

    needs_vllm_on_cuda()
    launch = get_adapter("vllm").prepare_container(CaptureRequest(
        operation="capture", engine={"name": "vllm", "options": {"model": MODEL, "site": SITE}},
        launch={"devices": ["cuda:0"], "port": PORT}, policy={"weights_mode": "recovery"}))
    assert {str(Path(SITE).resolve()), str(Path(MODEL).resolve())} <= {m.source for m in launch.mounts}
    ns, root = lab["ns"], lab["runc_root"]

    def bundle(name: str, capsule: str | None = None) -> Path:
        ann = {mt.ANNOTATION_CAPSULE: capsule} if capsule else None
        return with_gpus(make_engine_bundle(lab["base"] / "bundles" / f"vllm-{name}", lab["rootfs"], launch,
                                            ns.name, ann))

    assert not healthy_at(ns.address, PORT), "another engine still answers in the lab's namespace"
    cid = unique("vllm-cold")
    t0 = time.monotonic()
    r = run_detached(str(RUNTIME), root, bundle("cold"), cid)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: healthy_at(ns.address, PORT) or (state(root, cid) or {}).get("status") != "running", 900,
             "vLLM in its container to answer /health")
    assert healthy_at(ns.address, PORT), "the vLLM container stopped before it served"
    cold_s = time.monotonic() - t0
    url = f"http://{ns.address}:{PORT}"
    before = greedy(url, launch.model_id)

    captured = capture_container(cid, root, engine="vllm", weights_mode="recovery", tag="vllm-gpu-container",
                                 model=describe_model_dir(MODEL, launch.model_id))
    rec = captured.receipt.model_dump(mode="json")
    assert rec["state"] == "succeeded", rec.get("error")
    assert rec["result"]["cuda_processes"] >= 1
    assert state(root, cid) is None or state(root, cid).get("status") != "running"
    runc(root, "delete", "-f", cid)

    rid = unique("vllm-restored")
    created = shim(lab, "create", "--bundle", str(bundle("restored", captured.capsule)), rid)
    assert created.returncode == 0, created.stderr
    started = shim(lab, "start", rid)
    assert started.returncode == 0, started.stderr
    restored = receipt(rid)
    try:
        assert restored["state"] == "succeeded" and restored["operation"] == "restore", restored  # not fell back
        assert restored["result"]["validated_text"] == captured.profile.expected_text
        after = greedy(url, launch.model_id)
    finally:
        runc(root, "delete", "-f", rid)
    assert_same(after, before, "vLLM restored in its container")
    resumed = restored["result"]["hydrate"]["engine_resume"]  # reloaded by ColdSnap's extension, every file
    assert "reload_fallback" not in resumed and resumed["reload"]["files"] >= 1, resumed
    print(f"\n[measured] vllm cuda container: cold start to /health {cold_s:.1f} s; restore receipt "
          f"{json.dumps({k: restored['result'].get(k) for k in ('time_to_first_token_s', 'hydrate')})}; spans "
          f"{[(s['name'], round(s['start_s'], 2), round(s['duration_s'], 2)) for s in restored['spans']]}")
