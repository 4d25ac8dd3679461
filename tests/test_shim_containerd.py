"""coldsnap-runtime under containerd 1.6 (runc v2 shim), for real: a private containerd (own root, state and
socket), the tests' rootfs imported as an OCI archive, `ctr run --runc-binary <coldsnap-runtime> --annotation
io.coldsnap.capsule=…` restoring a captured reference-engine container, and a cold fallback; real vLLM and SGLang
containers come back with the same completions."""

from __future__ import annotations

import subprocess
import time

import pytest
from containers_fixture import (
    ENGINE_ARGS,
    RUNTIME,
    SETUP,
    completion_in,
    completions_in,
    engine_launch,
    ensure,
    healthy_in,
    launch_binds,
    make_rootfs,
    needs_root,
    oci_archive,
    private_coldsnap,
    receipt,
    shared_binds,
    unique,
    wait_for,
)

from coldsnap.base.paths import settings
from coldsnap.capsule import CapsuleStore
from coldsnap.contracts import capsule as mt

pytestmark = [pytest.mark.root, pytest.mark.slow]
IMAGE = "localhost/coldsnap-shim-test:1"
RUNC_ROOT = "/run/containerd/runc/default"  # the runc v2 shim's root for namespace "default"


class Ctr:
    def __init__(self, base):
        self.base = base
        self.dir = base / "containerd"
        self.models = base / "models"
        self.models.mkdir()
        self.cli = ["ctr", "-a", str(self.dir / "containerd.sock")]
        self.ids: list[str] = []
        self.shm: list = []  # host tmpfs mounts bound as containers' /dev/shm

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.cli, *args], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args[:2])}… failed ({r.returncode}): {r.stderr.strip()[-800:]}")
        return r

    def run_engine(self, cid: str, *extra: str) -> subprocess.CompletedProcess:
        mounts = [a for b in shared_binds() for a in
                  ("--mount", f"type=bind,src={b['source']},dst={b['destination']},options=rbind:ro")]
        mounts += ["--mount", f"type=bind,src={self.models},dst=/models,options=rbind:rw"]
        self.ids.append(cid)
        return self("run", "-d", "--null-io", "--runc-binary", str(RUNTIME), "--env", "PYTHONDONTWRITEBYTECODE=1",
                    *mounts, *extra, IMAGE, cid, *ENGINE_ARGS, check=False)

    def run_launch(self, cid: str, launch, *extra: str) -> subprocess.CompletedProcess:
        """`ctr run` of an engine adapter's container launch: its read-only binds, environment and working directory,
        private tmpfs for /tmp and $HOME, ctr's own 64 MiB /dev/shm and network namespace (loopback only)."""
        # The tmpfs first: ctr mounts in order, and the interpreter may live under /root (pyenv).
        mounts = [a for dst, mode in (("/tmp", "1777"), ("/root", "700")) for a in
                  ("--mount", f"type=tmpfs,src=tmpfs,dst={dst},options=nosuid:nodev:mode={mode}")]
        mounts += [a for m in launch_binds(launch) for a in
                   ("--mount", f"type=bind,src={m['source']},dst={m['destination']},options=rbind:{m['options'][-1]}")]
        # A /dev/shm bound from a host tmpfs, as the CRI plugin gives a pod's containers (ctr's own is 64 MiB and
        # vLLM wants more).
        shm = self.base / f"shm-{cid}"
        shm.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g,mode=1777", "tmpfs", str(shm)], check=True)
        self.shm.append(shm)
        mounts += ["--mount", f"type=bind,src={shm},dst=/dev/shm,options=rbind:rw"]
        env = [a for k, v in {**launch.env, "HOME": "/root"}.items() for a in ("--env", f"{k}={v}")]
        self.ids.append(cid)
        return self("run", "-d", "--log-uri", f"file://{self.base}/{cid}.log", "--runc-binary", str(RUNTIME), *env,
                    *(["--cwd", launch.cwd] if launch.cwd else []), *mounts, *extra, IMAGE, cid, *launch.argv,
                    check=False)

    def pid(self, cid: str) -> int:
        for line in self("task", "ls").stdout.splitlines()[1:]:
            name, pid, status = line.split()
            if name == cid:
                return int(pid)
        raise AssertionError(f"no task {cid}")

    def status(self, cid: str) -> str:
        for line in self("task", "ls").stdout.splitlines()[1:]:
            name, _, status = line.split()
            if name == cid:
                return status
        return "gone"

    def remove(self, cid: str) -> None:
        self("task", "kill", "-s", "KILL", cid, check=False)
        wait_for(lambda: self.status(cid) in ("STOPPED", "gone"), 30, f"task {cid} to stop")
        self("task", "rm", cid, check=False)
        self("container", "rm", cid, check=False)


@pytest.fixture(scope="module")
def ctr(tmp_path_factory):
    needs_root()
    ensure("containerd")
    base = tmp_path_factory.mktemp("containerd")
    c = Ctr(base)
    with private_coldsnap(base):
        r = subprocess.run([str(SETUP), "start-containerd", str(c.dir)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        try:
            c("images", "import", str(oci_archive(make_rootfs(base / "rootfs"), base / "image.tar", IMAGE)))
            yield c
        finally:
            for cid in c.ids:
                c.remove(cid)
            for shm in c.shm:
                subprocess.run(["umount", "-l", str(shm)], capture_output=True)
            subprocess.run([str(SETUP), "stop-containerd", str(c.dir)], capture_output=True)


@pytest.fixture(scope="module")
def captured(ctr):
    from coldsnap.flows.container_capture import capture_container

    cid = unique("cold")
    r = ctr.run_engine(cid)
    assert r.returncode == 0, r.stderr
    pid = ctr.pid(cid)
    wait_for(lambda: healthy_in(pid), 120, "the cold engine")
    text = completion_in(pid)
    res = capture_container(cid, RUNC_ROOT, tag="containerd-test")
    ctr.remove(cid)
    return {"capsule": res.capsule, "text": text}


def test_ctr_run_restores_from_the_annotated_capsule(ctr, captured):
    cid = unique("restored")
    t0 = time.monotonic()
    r = ctr.run_engine(cid, "--annotation", f"{mt.ANNOTATION_CAPSULE}={captured['capsule']}")
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 60
    assert ctr.status(cid) == "RUNNING"
    rec = receipt(cid)
    assert rec["state"] == "succeeded", rec
    assert rec["result"]["validated_text"] == captured["text"]
    assert completion_in(ctr.pid(cid)) == captured["text"]
    ctr.remove(cid)
    assert not (settings().run / "shim" / f"{cid}.json").exists()


def test_ctr_run_falls_back_cold_when_the_capsule_is_corrupt(ctr, captured):
    store = CapsuleStore(settings().store)
    cap = store.load(captured["capsule"])
    layer = cap.layer(mt.LAYER_CRIU)
    # A capsule naming a CRIU layer that is not in the store (a partial copy).
    missing = layer.__class__(layer.media_type, "sha256:" + "d" * 64, layer.size)
    other = store.write_capsule(cap.profile, [missing if d is layer else d for d in cap.layers], {})
    cid = unique("fallback")
    r = ctr.run_engine(cid, "--annotation", f"{mt.ANNOTATION_CAPSULE}={other}")
    assert r.returncode == 0, r.stderr
    rec = receipt(cid)
    assert rec["state"] == "fell-back" and rec["result"]["fallback_reason"].startswith("capsule-corrupt")
    pid = ctr.pid(cid)
    wait_for(lambda: healthy_in(pid), 120, "the cold engine")
    assert completion_in(pid) == captured["text"]
    ctr.remove(cid)


# One real engine per runtime beyond podman's two (containerd: SGLang; docker: vLLM; vLLM also under runc and CRI):
# what the runtime changes is the container around the engine, and the suite has a time budget (~35 min).
@pytest.mark.parametrize("engine", ["sglang"])
def test_ctr_restores_an_engine_container_with_the_same_completions(ctr, engine):
    """An engine adapter's container launch under `ctr run --runc-binary coldsnap-runtime`: started cold, captured,
    then restored from the annotated capsule, validated, answering the same 10 greedy completions."""
    from coldsnap.flows.container_capture import capture_container

    launch = engine_launch(engine)
    model = launch.model_id
    cid = unique(f"{engine}-cold")
    r = ctr.run_launch(cid, launch)
    assert r.returncode == 0, r.stderr
    pid = ctr.pid(cid)
    wait_for(lambda: healthy_in(pid) or ctr.status(cid) != "RUNNING", 600, f"{engine} to answer /health")
    assert healthy_in(pid), f"the {engine} container stopped: {(ctr.base / f'{cid}.log').read_text()[-1500:]}"
    before = completions_in(pid, model)
    assert len(set(before)) > 1, before  # not degenerate
    res = capture_container(cid, RUNC_ROOT, engine=engine, tag=f"containerd-{engine}")
    assert res.receipt.state == "succeeded" and res.profile.engine.name == engine
    assert res.profile.launch.command == launch.argv
    ctr.remove(cid)

    cid = unique(f"{engine}-restored")
    r = ctr.run_launch(cid, launch, "--annotation", f"{mt.ANNOTATION_CAPSULE}={res.capsule}")
    assert r.returncode == 0, r.stderr
    rec = receipt(cid)
    assert rec["state"] == "succeeded" and "fallback_reason" not in rec["result"], (rec["state"], rec["result"].get(
        "fallback_reason"), rec.get("error"))  # restored, not fell back
    assert [s["name"] for s in rec["spans"]] == ["admit", "stage", "criu-restore", "hydrate", "validate"]
    assert rec["result"]["validated_text"] == res.profile.expected_text
    assert completions_in(ctr.pid(cid), model) == before
    print(f"\n[measured] {engine} under containerd: restore → first token "
          f"{rec['result'].get('time_to_first_token_s')} s")
    ctr.remove(cid)
    assert not (settings().run / "shim" / f"{cid}.json").exists()
