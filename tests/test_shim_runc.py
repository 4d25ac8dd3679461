"""coldsnap-runtime under plain runc, for real (runc 1.1 + CRIU 4.2, no mocks).

(a) a bundle without the annotation goes through the shim exactly as through runc;
(b) a reference-engine container captured with capture_container is restored by `create` + `start` of an
    annotated bundle, validated at create against the captured text, with a receipt;
(c) a capsule that is incompatible, corrupt, fails to restore or to validate falls back to a cold start that serves,
    and says why in the receipt; with fallback off the create fails cleanly, in runc's log format.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from containers_fixture import (
    ENGINE_ARGS,
    RUNTIME,
    SETUP,
    NetNS,
    make_bundle,
    make_rootfs,
    module_lab,
    netns_http,
    receipt,
    run_detached,
    runc,
    state,
    unique,
    wait_for,
)
from registry_fixture import registry  # noqa: F401  (fixture)

from coldsnap.base.paths import settings
from coldsnap.capsule import CapsuleStore, Descriptor
from coldsnap.contracts import capsule as mt

pytestmark = [pytest.mark.root, pytest.mark.slow]


class Lab:
    def __init__(self, base: Path):
        self.base = base
        self.rootfs = make_rootfs(base / "rootfs")
        self.runc_root = base / "runc-root"
        self.models = base / "models"
        self.models.mkdir()
        self.netns: list[NetNS] = []

    def bundle(self, name: str, args: list[str] = ENGINE_ARGS, annotations: dict | None = None,
               models: bool = True) -> tuple[Path, str]:
        ns = NetNS("cstest")
        self.netns.append(ns)
        mounts = [{"destination": "/models", "type": "bind", "source": str(self.models), "options": ["rbind", "rw"]}]
        path = make_bundle(self.base / "bundles" / name, self.rootfs, args, netns=ns.name, annotations=annotations,
                           extra_mounts=mounts if models else [])
        return path, ns.name

    def shim(self, *args: str, log: Path | None = None) -> subprocess.CompletedProcess:
        """coldsnap-runtime as a container engine calls it: --root, optional --log json, /dev/null stdin/stdout."""
        glob = ["--root", str(self.runc_root)] + (["--log", str(log), "--log-format", "json"] if log else [])
        # Files, not pipes: a container created cold inherits the caller's stdio and would hold a pipe open.
        out, err = (self.base / f"shim-{uuid.uuid4().hex}.{n}" for n in ("out", "err"))
        with open(os.devnull, "rb") as null, open(out, "w") as o, open(err, "w") as e:
            r = subprocess.run([str(RUNTIME), *glob, *args], stdin=null, stdout=o, stderr=e, timeout=600)
        r.stdout, r.stderr = out.read_text(), err.read_text()
        out.unlink()
        err.unlink()
        return r

    def cleanup(self) -> None:
        r = runc(self.runc_root, "list", "-q")
        for cid in r.stdout.split():
            runc(self.runc_root, "delete", "-f", cid)
        for ns in self.netns:
            ns.delete()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with module_lab(tmp_path_factory, "shim-runc", Lab) as made:
        yield made


def shim_record(cid: str) -> Path:
    return settings().run / "shim" / f"{cid}.json"


def wait_healthy(netns: str, timeout: float = 120) -> None:
    wait_for(lambda: netns_http(netns, "/health", timeout=2)[0] == 200, timeout, f"the engine in {netns}")


def complete(netns: str) -> str:
    r = subprocess.run(["ip", "netns", "exec", netns, "curl", "-s", "-m", "60", "http://127.0.0.1:8000/v1/completions",
                        "-d", json.dumps({"prompt": "ColdSnap says", "max_tokens": 16, "temperature": 0})],
                       capture_output=True, text=True)
    return json.loads(r.stdout)["choices"][0]["text"]


def without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


# --- (a) pass-through ---------------------------------------------------------------------------------------------
def test_unannotated_bundle_behaves_exactly_as_runc(lab):
    sleeper = ["/bin/sh", "-c", "sleep 1000"]
    b_runc, _ = lab.bundle("plain-runc", sleeper)
    b_shim, _ = lab.bundle("plain-shim", sleeper)
    config_before = (b_shim / "config.json").read_bytes()
    c_runc, c_shim = unique("pt-runc"), unique("pt-shim")
    assert run_detached("runc", lab.runc_root, b_runc, c_runc).returncode == 0
    assert run_detached(str(RUNTIME), lab.runc_root, b_shim, c_shim).returncode == 0
    via_runc = json.loads(runc(lab.runc_root, "state", c_shim).stdout)
    via_shim = json.loads(lab.shim("state", c_shim).stdout)
    assert via_shim == via_runc and via_shim["status"] == "running"
    other = json.loads(lab.shim("state", c_runc).stdout)
    assert without(other, "id", "pid", "created", "bundle") == without(via_shim, "id", "pid", "created", "bundle")
    assert (b_shim / "config.json").read_bytes() == config_before  # never touched
    assert not shim_record(c_shim).exists()

    # errors: same exit status, same message (runc's own)
    a, b = runc(lab.runc_root, "state", "no-such"), lab.shim("state", "no-such")
    assert a.returncode == b.returncode == 1
    assert a.stderr.split("msg=")[-1] == b.stderr.split("msg=")[-1]
    v1 = subprocess.run(["runc", "--version"], capture_output=True, text=True)
    v2 = subprocess.run([str(RUNTIME), "--version"], capture_output=True, text=True)
    assert (v1.returncode, v1.stdout) == (v2.returncode, v2.stdout)

    # a foreground run's exit status is the container's
    b_fail, _ = lab.bundle("exit7", ["/bin/sh", "-c", "exit 7"])
    assert lab.shim("run", "--bundle", str(b_fail), unique("pt-exit7")).returncode == 7
    assert runc(lab.runc_root, "run", "--bundle", str(b_fail), unique("pt-exit7")).returncode == 7

    # kill / delete pass through
    assert lab.shim("kill", c_shim, "KILL").returncode == 0
    wait_for(lambda: (state(lab.runc_root, c_shim) or {}).get("status") == "stopped", 10, "the container to stop")
    assert lab.shim("delete", c_shim).returncode == 0
    assert state(lab.runc_root, c_shim) is None
    assert lab.shim("delete", "-f", c_runc).returncode == 0


# --- (b) capture + restore ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def captured(lab):
    from coldsnap.flows.container_capture import capture_container

    bundle, netns = lab.bundle("engine-cold")
    cid = unique("engine-cold")
    r = run_detached("runc", lab.runc_root, bundle, cid)
    assert r.returncode == 0, r.stderr
    wait_healthy(netns)
    cold_text = complete(netns)
    res = capture_container(cid, lab.runc_root, tag="shim-test")
    return {"result": res, "cold_text": cold_text, "netns": netns, "id": cid}


def test_capture_container_writes_a_criu_runc_capsule_and_stops_the_container(lab, captured):
    res = captured["result"]
    assert res.receipt.state == "succeeded" and res.receipt.operation == "capture"
    assert {"validate", "release", "quiesce", "criu-dump", "pack"} <= {s.name for s in res.receipt.spans}
    p = res.profile
    assert p.snapshot_driver == "criu-runc" and p.network is None and p.weights_mode == "native"
    assert p.expected_text == captured["cold_text"] and p.launch.command == ENGINE_ARGS and p.launch.port == 8000
    assert "--network-lock=skip" in p.criu_options and "--tcp-established" in p.criu_options
    store = CapsuleStore(settings().store)
    cap = store.load(res.capsule)
    store.verify(cap)
    assert cap.layer(mt.LAYER_CRIU) is not None
    assert state(lab.runc_root, captured["id"]) is None  # stopped and gone, as in process mode
    assert not list((settings().run / "capture").iterdir())  # no temporary images left


def test_annotated_create_and_start_restore_and_validate(lab, captured):
    digest = captured["result"].capsule
    bundle, netns = lab.bundle("engine-restored", annotations={mt.ANNOTATION_CAPSULE: digest})
    cid = unique("restored")
    pid_file = lab.base / f"{cid}.pid"
    r = lab.shim("create", "--bundle", str(bundle), "--pid-file", str(pid_file), cid)
    assert r.returncode == 0, r.stderr
    st = state(lab.runc_root, cid)
    assert st["status"] == "running" and int(pid_file.read_text()) == st["pid"]
    record = json.loads(shim_record(cid).read_text())
    assert record["outcome"] == "restored" and record["started"] is False
    spec = json.loads((bundle / "config.json").read_text())
    assert [h["args"] for h in spec["hooks"]["poststart"]] == [["coldsnap-hook", "poststart"]]
    assert spec["x-coldsnap-test"] == {"unknown": ["fields", "are", "kept"]}

    r = lab.shim("start", cid)
    assert r.returncode == 0, r.stderr
    assert "validated" in r.stderr and cid in r.stderr  # the hook's one-line summary
    rec = receipt(cid)
    assert rec["state"] == "succeeded" and rec["operation"] == "restore" and rec["operation_id"] == cid
    assert rec["result"]["validated_text"] == captured["cold_text"]
    assert 0 < rec["result"]["time_to_first_token_s"] < 60
    assert ["admit", "stage", "criu-restore", "hydrate", "validate"] == [s["name"] for s in rec["spans"]]
    assert complete(netns) == captured["cold_text"]  # and it keeps serving

    again = lab.shim("start", cid)
    assert again.returncode == 1 and "already running" in again.stderr
    assert lab.shim("kill", cid, "KILL").returncode == 0
    wait_for(lambda: (state(lab.runc_root, cid) or {}).get("status") == "stopped", 10, "the container to stop")
    assert lab.shim("delete", cid).returncode == 0
    assert state(lab.runc_root, cid) is None and not shim_record(cid).exists()


def test_run_detached_restores_a_second_time_from_the_same_capsule(lab, captured):
    bundle, netns = lab.bundle("engine-restored-2", annotations={mt.ANNOTATION_CAPSULE: captured["result"].capsule})
    cid = unique("restored")
    r = run_detached(str(RUNTIME), lab.runc_root, bundle, cid)
    assert r.returncode == 0, r.stderr
    assert receipt(cid)["state"] == "succeeded"
    assert complete(netns) == captured["cold_text"]
    assert lab.shim("delete", "-f", cid).returncode == 0 and not shim_record(cid).exists()


def test_a_node_without_the_capsule_pulls_its_registry_reference_at_create(lab, captured, registry, tmp_path,
                                                                             monkeypatch):  # noqa: F811
    """The annotation names the capsule in a registry; this node's store and staging area are empty: create pulls
    it (plain HTTP only because the node's operator lists the registry), then restores; the receipt says so."""
    from coldsnap.capsule.registry import push

    digest = captured["result"].capsule
    push(CapsuleStore(settings().store), digest, f"{registry}/coldsnap/shim:v1", insecure=True)
    node = tmp_path / "node"
    monkeypatch.setenv("COLDSNAP_STORE", str(node / "store"))
    monkeypatch.setenv("COLDSNAP_STAGED", str(node / "staged"))
    ref = f"{registry}/coldsnap/shim@{digest}"
    bundle, netns = lab.bundle("engine-pulled", annotations={mt.ANNOTATION_CAPSULE: ref})

    cid = unique("pulled-http")  # not listed as insecure: the HTTPS pull fails and the container starts cold
    r = run_detached(str(RUNTIME), lab.runc_root, bundle, cid)
    assert r.returncode == 0, r.stderr
    rec = receipt(cid)
    assert rec["state"] == "fell-back" and "registry" in rec["result"]["fallback_reason"].lower()
    wait_healthy(netns)
    assert lab.shim("delete", "-f", cid).returncode == 0

    monkeypatch.setenv("COLDSNAP_INSECURE_REGISTRIES", f"example.invalid:5000, {registry}")
    cid = unique("pulled")
    r = run_detached(str(RUNTIME), lab.runc_root, bundle, cid)
    assert r.returncode == 0, r.stderr
    rec = receipt(cid)
    assert rec["state"] == "succeeded" and rec["result"]["validated_text"] == captured["cold_text"]
    assert [s["name"] for s in rec["spans"]][:3] == ["pull", "admit", "stage"]
    assert CapsuleStore(node / "store").has_blob(digest) and (node / "staged").is_dir()
    assert complete(netns) == captured["cold_text"]
    assert lab.shim("delete", "-f", cid).returncode == 0


# --- (c) fallback ---------------------------------------------------------------------------------------------------
def _variant(captured, **host_changes) -> str:
    """A capsule like the captured one but recorded on a different host."""
    store = CapsuleStore(settings().store)
    cap = store.load(captured["result"].capsule)
    profile = cap.profile.model_copy(update={"host": cap.profile.host.model_copy(update=host_changes)})
    return store.write_capsule(profile, cap.layers, {})


def _corrupt(captured) -> str:
    """A capsule whose CRIU layer blob does not hash to its digest (bit rot, a truncated copy)."""
    store = CapsuleStore(settings().store)
    cap = store.load(captured["result"].capsule)
    data = b"not the images you are looking for"
    fake = Descriptor(mt.LAYER_CRIU, "sha256:" + "e" * 64, len(data))
    store.blob_path(fake.digest).write_bytes(data)
    layers = [fake] + [d for d in cap.layers if d.media_type != mt.LAYER_CRIU]  # in place of all its images' layers
    return store.write_capsule(cap.profile, layers, {})


def _unstageable(captured) -> tuple[str, Path, Path]:
    """The captured capsule, staged, with one of its CRIU images moved away: CRIU itself fails to restore it."""
    from coldsnap.flows.admission import load_capsule
    from coldsnap.flows.staging import stage

    staged = stage(load_capsule(captured["result"].capsule, False))
    image = next(staged.images.glob("pstree.img"))
    aside = image.with_name("pstree.img.aside")
    image.rename(aside)
    return captured["result"].capsule, image, aside


@pytest.mark.parametrize("case", ["incompatible", "corrupt", "mounts-differ", "restore-fails", "fails-validation"])
def test_refused_or_failed_restore_falls_back_to_a_cold_start(lab, captured, case):
    moved = None
    if case == "restore-fails":
        digest, *moved = _unstageable(captured)
    else:
        digest = {"incompatible": lambda: _variant(captured, kernel="0.0.0-elsewhere"),
                  "corrupt": lambda: _corrupt(captured),
                  "mounts-differ": lambda: captured["result"].capsule,
                  "fails-validation": lambda: captured["result"].capsule}[case]()
    annotations = {mt.ANNOTATION_CAPSULE: digest}
    if case == "fails-validation":  # restored, but another prompt cannot give the captured completion
        annotations[mt.ANNOTATION_VALIDATION] = json.dumps({"prompt": "Something else entirely"})
    # mounts-differ: the bundle lacks the /models bind the captured container had: refused before CRIU runs
    bundle, netns = lab.bundle(f"fallback-{case}", annotations=annotations, models=case != "mounts-differ")
    cid = unique(f"fb-{case}")
    log = lab.base / f"{cid}.log"
    try:
        r = lab.shim("create", "--bundle", str(bundle), cid, log=log)
    finally:
        if moved:
            moved[1].rename(moved[0])
    assert r.returncode == 0, r.stderr
    assert state(lab.runc_root, cid)["status"] == "created"  # a plain runc create: cold
    rec = receipt(cid)
    assert rec["state"] == "fell-back" and rec["result"]["started"] == "cold"
    want = {"incompatible": "incompatible: capsule refused on this host: kernel",
            "corrupt": "capsule-corrupt", "restore-fails": "criu-failed", "fails-validation": "validation-failed",
            "mounts-differ": "incompatible: capsule refused on this host: /models was mounted (bind) at capture and "
                             "is not in this container"}[case]
    assert rec["result"]["fallback_reason"].startswith(want), rec["result"]["fallback_reason"]
    kept_log = settings().receipts / f"{cid}.restore.log"
    if case == "restore-fails":  # CRIU's log outlives the container, beside its receipt
        assert "pstree" in kept_log.read_text()
    if case == "mounts-differ":  # refused before CRIU ran at all
        assert not kept_log.exists() and "criu-restore" not in [s["name"] for s in rec["spans"]]
    if case == "fails-validation":  # restored, asked, found wrong: the restored container went before the cold one
        assert [s["name"] for s in rec["spans"]][-3:] == ["hydrate", "validate", "cold-start"]
    line = json.loads(log.read_text().splitlines()[-1])
    assert line["level"] == "warning" and "cold" in line["msg"] and line["time"]
    assert lab.shim("start", cid).returncode == 0
    wait_healthy(netns)
    assert complete(netns) == captured["cold_text"]  # the cold start serves the same model
    assert lab.shim("delete", "-f", cid).returncode == 0
    assert not shim_record(cid).exists() and state(lab.runc_root, cid) is None


def test_without_fallback_a_refusal_fails_create_in_runc_log_format(lab, captured):
    digest = _variant(captured, arch="sparc64")
    bundle, _ = lab.bundle("no-fallback", annotations={mt.ANNOTATION_CAPSULE: digest,
                                                        mt.ANNOTATION_POLICY: '{"fallback_to_cold": false}'})
    cid = unique("nofb")
    log = lab.base / f"{cid}.log"
    r = lab.shim("create", "--bundle", str(bundle), cid, log=log)
    assert r.returncode == 1
    assert "incompatible" in r.stderr and "architecture" in r.stderr
    line = json.loads(log.read_text().splitlines()[-1])
    assert set(line) == {"level", "msg", "time"} and line["level"] == "error" and "architecture" in line["msg"]
    assert receipt(cid)["state"] == "refused" and receipt(cid)["error"]["code"] == "incompatible"
    assert state(lab.runc_root, cid) is None and not shim_record(cid).exists()  # nothing left behind


def _tampered(captured, tmp: Path) -> str:
    """The captured capsule with every task's capabilities raised to all of them (its core images decoded and
    re-encoded with pycriu), re-packed and signed with this host's key: a capsule a trusted key vouches for whose
    processes would hold more than the container grants."""
    from coldsnap.capsule import pack_dir
    from coldsnap.capsule.trust import adopt_capture
    from coldsnap.criu.driver import _pycriu
    from coldsnap.flows.admission import load_capsule
    from coldsnap.flows.staging import stage

    pycriu = _pycriu()
    store = CapsuleStore(settings().store)
    cap = load_capsule(captured["result"].capsule, False)
    images = tmp / "images"
    shutil.copytree(stage(cap).images, images)
    for core in images.glob("core-*.img"):
        with open(core, "rb") as f:
            img = pycriu.images.load(f)
        creds = img["entries"][0]["thread_core"]["creds"]
        for field in ("cap_bnd", "cap_prm", "cap_eff"):
            creds[field] = [0xFFFFFFFF, 0x1FF]
        with open(core, "wb") as f:
            pycriu.images.dump(img, f)
    pack_dir(images, tmp / "criu.tar.zst", skip=("dump.log",))
    criu = store.put_file(tmp / "criu.tar.zst", mt.LAYER_CRIU, {mt.ANNOTATION_TITLE: "criu-images"}, move=True)
    layers = [criu] + [d for d in cap.layers if d.media_type != mt.LAYER_CRIU]  # in place of all its images' layers
    digest = store.write_capsule(cap.profile, layers, dict(cap.manifest.get("annotations") or {}))
    adopt_capture(store, digest)
    return digest


def test_a_capsule_that_would_raise_capabilities_is_refused_before_anything_starts(lab, captured, tmp_path):
    digest = _tampered(captured, tmp_path)
    bundle, _ = lab.bundle("tampered", annotations={mt.ANNOTATION_CAPSULE: digest,
                                                    mt.ANNOTATION_POLICY: '{"fallback_to_cold": false}'})
    cid = unique("tampered")
    r = lab.shim("create", "--bundle", str(bundle), cid, log=lab.base / f"{cid}.log")
    assert r.returncode == 1
    assert "untrusted" in r.stderr and "CAP_SYS_ADMIN" in r.stderr and "bounding set" in r.stderr, r.stderr
    rec = receipt(cid)
    assert rec["error"]["code"] == "untrusted" and "criu-restore" not in [s["name"] for s in rec["spans"]]
    assert state(lab.runc_root, cid) is None and not shim_record(cid).exists()  # nothing started, nothing left


def test_malformed_annotation_fails_create_without_starting_anything(lab):
    bundle, _ = lab.bundle("malformed", annotations={mt.ANNOTATION_CAPSULE: "sha256:" + "1" * 64,
                                                      mt.ANNOTATION_POLICY: '{"fallback_to_cold": "perhaps"}'})
    cid = unique("bad")
    r = lab.shim("create", "--bundle", str(bundle), cid)
    assert r.returncode == 1 and "invalid-request" in r.stderr and "fallback_to_cold" in r.stderr
    assert state(lab.runc_root, cid) is None


# --- the pass-through's cost, and the fast launcher ------------------------------------------------------------------
def _median_ms(argv: list[str], env: dict, n: int = 20) -> float:
    import statistics
    import time

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def test_pass_through_adds_little_to_runc(lab, tmp_path):
    r = subprocess.run([str(SETUP), "install-launchers", str(tmp_path / "bin"), "-"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as installed: bytecode cached
    report = []
    fast = str(tmp_path / "bin" / "coldsnap-runtime")
    for label, wrapper in (("console script", str(RUNTIME)), ("fast launcher", fast)):
        for args in (["--version"], ["--root", str(lab.runc_root), "state", "no-such"]):
            subprocess.run([wrapper, *args], capture_output=True, env=env)  # warm the bytecode cache
            added = _median_ms([wrapper, *args], env) - _median_ms(["runc", *args], env)
            report.append(f"{label} {args[-1]}: +{added:.1f} ms")
            assert added < 100, report  # target ≤ 30 ms on an idle machine; generous here (shared CI cores)
    print("pass-through overhead (median of 20):", "; ".join(report))


def test_fast_launcher_restores_too(lab, captured, tmp_path):
    subprocess.run([str(SETUP), "install-launchers", str(tmp_path / "bin"), "-"], check=True, capture_output=True)
    bundle, netns = lab.bundle("engine-fast", annotations={mt.ANNOTATION_CAPSULE: captured["result"].capsule})
    cid = unique("fast")
    r = run_detached(str(tmp_path / "bin" / "coldsnap-runtime"), lab.runc_root, bundle, cid)
    assert r.returncode == 0, r.stderr
    assert receipt(cid)["state"] == "succeeded"
    assert complete(netns) == captured["cold_text"]
    assert lab.shim("delete", "-f", cid).returncode == 0


def test_a_failed_capture_leaves_the_container_serving_and_no_capsule(lab, tmp_path):
    """CRIU cannot dump a container whose stderr is a host file: the capture fails, nothing is half-written."""
    from coldsnap.contracts import ColdSnapError, ErrorCode
    from coldsnap.flows.container_capture import capture_container

    bundle, netns = lab.bundle("engine-unfit")
    cid = unique("unfit")
    with open(os.devnull, "rb") as null, open(tmp_path / "stderr.log", "w") as err:
        r = subprocess.run(["runc", "--root", str(lab.runc_root), "run", "-d", "--bundle", str(bundle), cid],
                           stdin=null, stdout=err, stderr=err)
    assert r.returncode == 0
    wait_healthy(netns)
    text = complete(netns)
    store = CapsuleStore(settings().store).init()
    before = store.index()
    with pytest.raises(ColdSnapError) as e:
        capture_container(cid, lab.runc_root, tag="unfit")
    assert e.value.code == ErrorCode.CRIU_FAILED and "Can't lookup mount" in e.value.message
    assert store.index() == before
    assert state(lab.runc_root, cid)["status"] == "running"
    assert complete(netns) == text  # resumed: KV back, serving as before
    assert not list((settings().run / "capture").iterdir())
    runc(lab.runc_root, "delete", "-f", cid)


@pytest.mark.parametrize("looker", ["start", "gc"])
def test_a_shim_killed_during_runc_restore_leaves_no_unvalidated_container(lab, captured, looker):
    import signal
    import sys
    import time

    bundle, _ = lab.bundle(f"killed-{looker}", annotations={mt.ANNOTATION_CAPSULE: captured["result"].capsule})
    cid = unique("killed")
    with open(os.devnull, "rb") as null, open(lab.base / f"{cid}.err", "w") as err:
        shim = subprocess.Popen([str(RUNTIME), "--root", str(lab.runc_root), "create", "--bundle", str(bundle), cid],
                                stdin=null, stdout=err, stderr=err)

    def restoring() -> bool:  # synchronised on the shim's own progress: its record, then runc restore running
        rec = json.loads(shim_record(cid).read_text()) if shim_record(cid).exists() else {}
        runs = subprocess.run(["pgrep", "-f", f"restore --detach .* {cid}$"], capture_output=True).returncode == 0
        return rec.get("outcome") == "restoring" and runs

    wait_for(restoring, 120, "the shim to start runc restore")
    shim.send_signal(signal.SIGKILL)
    shim.wait()
    wait_for(lambda: subprocess.run(["pgrep", "-f", f"restore --detach .* {cid}$"]).returncode != 0, 120,
             "runc restore to finish on its own")
    assert json.loads(shim_record(cid).read_text())["outcome"] == "restoring"  # what the next look finds
    if looker == "start":  # the caller's next call for this id
        r = lab.shim("start", cid)
        assert r.returncode == 1 and "interrupted" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    else:  # coldsnap gc (or any coldsnap command that looks)
        r = subprocess.run([sys.executable, "-m", "coldsnap.cli", "gc", "--json"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0 and any(cid in line for line in json.loads(r.stdout)["recovered"]), r.stdout
    deadline = time.monotonic() + 30
    while state(lab.runc_root, cid) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state(lab.runc_root, cid) is None and not shim_record(cid).exists()  # nothing unvalidated runs
