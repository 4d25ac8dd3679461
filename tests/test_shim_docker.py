"""coldsnap-runtime under dockerd 20.10, for real: a private dockerd (its own data-root, exec-root and socket,
daemon.json from packaging/containers/) with the runtime registered as "coldsnap". A reference-engine container
captured with capture_container comes back restored from `docker run --runtime coldsnap`, and falls back cold
when its capsule is refused; real vLLM and SGLang containers come back with the same completions. Docker 20.10
has no `run --annotation`: the capsule is named by the container's COLDSNAP_CAPSULE environment variable (the
shim's stand-in for io.coldsnap.capsule)."""

from __future__ import annotations

import json
import subprocess
import tarfile

import pytest
from containers_fixture import (
    ENGINE_ARGS,
    SETUP,
    completion_in,
    completions_in,
    engine_launch,
    ensure,
    healthy_in,
    launch_run_args,
    make_rootfs,
    needs_root,
    private_coldsnap,
    receipt,
    shared_binds,
    unique,
    wait_for,
)

from coldsnap.base.paths import settings
from coldsnap.capsule import CapsuleStore

pytestmark = [pytest.mark.root, pytest.mark.slow]
IMAGE = "coldsnap-shim-test:1"


class Docker:
    def __init__(self, base):
        self.base = base
        self.dir = base / "docker"
        self.models = base / "models"
        self.models.mkdir()
        self.cli = ["/usr/bin/docker", "-H", f"unix://{self.dir}/docker.sock"]  # the engine's own client version

    @property
    def runc_root(self):
        return self.dir / "exec" / "runtime-runc" / "moby"

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.cli, *args], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise AssertionError(f"docker {' '.join(args[:2])}… failed ({r.returncode}): {r.stderr.strip()[-800:]}")
        return r

    def run_engine(self, name: str, *extra: str) -> subprocess.CompletedProcess:
        volumes = [a for b in shared_binds() for a in ("-v", f"{b['source']}:{b['destination']}:ro")]
        return self("run", "-d", "--name", name, "--runtime", "coldsnap", "--network", "none",
                    "-e", "PYTHONDONTWRITEBYTECODE=1", *volumes, "-v", f"{self.models}:/models", *extra,
                    IMAGE, *ENGINE_ARGS, check=False)

    def inspect(self, name: str) -> dict:
        return json.loads(self("inspect", name).stdout)[0]


@pytest.fixture(scope="module")
def docker(tmp_path_factory):
    needs_root()
    ensure("docker")
    base = tmp_path_factory.mktemp("docker")
    d = Docker(base)
    with private_coldsnap(base):
        r = subprocess.run([str(SETUP), "start-dockerd", str(d.dir)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        try:
            rootfs = make_rootfs(base / "rootfs")
            with tarfile.open(base / "rootfs.tar", "w") as tar:
                tar.add(rootfs, arcname=".")
            d("import", str(base / "rootfs.tar"), IMAGE)
            yield d
        finally:
            ids = d("ps", "-aq", check=False).stdout.split()
            if ids:
                d("rm", "-f", *ids, check=False)
            subprocess.run([str(SETUP), "stop-dockerd", str(d.dir)], capture_output=True)


@pytest.fixture(scope="module")
def captured(docker):
    from coldsnap.flows.container_capture import capture_container

    name = unique("cold")
    r = docker.run_engine(name)
    assert r.returncode == 0, r.stderr
    info = docker.inspect(name)
    wait_for(lambda: healthy_in(info["State"]["Pid"]), 120, "the cold engine")
    text = completion_in(info["State"]["Pid"])
    res = capture_container(info["Id"], docker.runc_root, tag="docker-test")
    wait_for(lambda: docker.inspect(name)["State"]["Status"] == "exited", 30, "docker to see the capture's stop")
    docker("rm", name)
    return {"capsule": res.capsule, "text": text}


def test_daemon_json_registers_the_runtime(docker):
    info = json.loads(docker("info", "--format", "{{json .Runtimes}}").stdout)
    assert info["coldsnap"]["path"].endswith("/bin/coldsnap-runtime")


def test_docker_run_restores_from_the_capsule(docker, captured):
    name = unique("restored")
    r = docker.run_engine(name, "-e", f"COLDSNAP_CAPSULE={captured['capsule']}")
    assert r.returncode == 0, r.stderr
    info = docker.inspect(name)
    rec = receipt(info["Id"])
    assert rec["state"] == "succeeded", rec
    assert rec["result"]["validated_text"] == captured["text"]
    assert completion_in(info["State"]["Pid"]) == captured["text"]
    assert docker("exec", name, "/bin/sh", "-c", "echo exec-ok").stdout.strip() == "exec-ok"  # a normal container
    docker("rm", "-f", name)
    assert not (settings().run / "shim" / f"{info['Id']}.json").exists()


def test_docker_run_falls_back_cold_when_the_capsule_is_refused(docker, captured):
    store = CapsuleStore(settings().store)
    cap = store.load(captured["capsule"])
    other = store.write_capsule(cap.profile.model_copy(update={"host": cap.profile.host.model_copy(
        update={"criu_version": "3.17.1"})}), cap.layers, {})
    name = unique("fallback")
    r = docker.run_engine(name, "-e", f"COLDSNAP_CAPSULE={other}")
    assert r.returncode == 0, r.stderr
    info = docker.inspect(name)
    rec = receipt(info["Id"])
    assert rec["state"] == "fell-back" and "CRIU 3.17.1" in rec["result"]["fallback_reason"]
    wait_for(lambda: healthy_in(info["State"]["Pid"]), 120, "the cold engine")
    assert completion_in(info["State"]["Pid"]) == captured["text"]
    docker("rm", "-f", name)


# One real engine per runtime beyond podman's two (docker: vLLM, containerd: SGLang; vLLM also under runc and CRI):
# what the runtime changes is the container around the engine, and the suite has a time budget (~35 min).
@pytest.mark.parametrize("engine", ["vllm"])
def test_docker_restores_an_engine_container_with_the_same_completions(docker, engine):
    """An engine adapter's container launch under `docker run --runtime coldsnap` (docker's own /dev/shm and network
    namespace): started cold, captured, then `docker run` with COLDSNAP_CAPSULE restores it, validated, and it
    answers the same 10 greedy completions."""
    from coldsnap.flows.container_capture import capture_container

    launch = engine_launch(engine)
    model = launch.model_id

    def run(name: str, *extra: str) -> dict:
        r = docker("run", "-d", "--name", name, "--runtime", "coldsnap", "--network", "none",
                   *launch_run_args(launch), *extra, IMAGE, *launch.argv, check=False)
        assert r.returncode == 0, r.stderr
        return docker.inspect(name)

    name = unique(f"{engine}-cold")
    info = run(name)
    pid = info["State"]["Pid"]
    wait_for(lambda: healthy_in(pid) or docker.inspect(name)["State"]["Status"] != "running", 600,
             f"{engine} to answer /health")
    assert healthy_in(pid), f"the {engine} container stopped: {docker('logs', name, check=False).stderr[-800:]}"
    before = completions_in(pid, model)
    assert len(set(before)) > 1, before  # not degenerate
    res = capture_container(info["Id"], docker.runc_root, engine=engine, tag=f"docker-{engine}")
    assert res.receipt.state == "succeeded" and res.profile.engine.name == engine
    assert res.profile.launch.command == launch.argv
    wait_for(lambda: docker.inspect(name)["State"]["Status"] == "exited", 30, "docker to see the capture's stop")
    docker("rm", name)

    restored = unique(f"{engine}-restored")
    info = run(restored, "-e", f"COLDSNAP_CAPSULE={res.capsule}")
    rec = receipt(info["Id"])
    assert rec["state"] == "succeeded" and "fallback_reason" not in rec["result"], (rec["state"], rec["result"].get(
        "fallback_reason"), rec.get("error"))  # restored, not fell back
    assert [s["name"] for s in rec["spans"]] == ["admit", "stage", "criu-restore", "hydrate", "validate"]
    assert rec["result"]["validated_text"] == res.profile.expected_text
    assert completions_in(info["State"]["Pid"], model) == before
    shm = [f.path for f in res.profile.files if f.path.startswith("/dev/shm/")]
    print(f"\n[measured] {engine} under docker: restore → first token {rec['result'].get('time_to_first_token_s')} s; "
          f"{len(shm)} /dev/shm file(s) carried")
    docker("rm", "-f", restored)
    assert not (settings().run / "shim" / f"{info['Id']}.json").exists()
