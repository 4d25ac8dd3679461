"""coldsnap-runtime under rootful podman 4.3, for real: `podman run --runtime <coldsnap-runtime> --annotation
io.coldsnap.capsule=…` restores a captured reference-engine container (validated by coldsnap-hook, injected
by podman from an oci-hooks.d file) and falls back to a cold start when the capsule is refused; and a real vLLM
(CPU build) container, run from its adapter's container launch in a pod-style network namespace, is captured and
restored the same way with identical completions.

Podman runs with private storage/run/tmp dirs and --network none (the runc-created netns: the shim brings lo
up after the restore). The image is `podman import` of the tests' rootfs; /usr, the repository and the
interpreter are bound read-only, as for the runc tests."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from containers_fixture import (
    ENGINE_ARGS,
    REPO,
    VethNetNS,
    coldsnap_env,
    completion_in,
    engine_launch,
    ensure,
    env_wrapper,
    healthy_at,
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
from coldsnap.contracts import capsule as mt

pytestmark = [pytest.mark.root, pytest.mark.slow]
IMAGE = "localhost/coldsnap-shim-test:1"
LIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]  # podman's defaults exceed ours
# In a network namespace made beforehand podman leaves the container's hostname unresolvable, and every gloo group
# vLLM makes on CPU waits 10 s for DNS on it (130 s a start): a hosts entry, as a pod's network would give.
NAMED = ["--hostname", "coldsnap-pod", "--add-host", "coldsnap-pod:127.0.0.1"]


class Podman:
    def __init__(self, base: Path):
        self.base = base
        self.models = base / "models"
        self.models.mkdir()
        self.glob = ["podman", "--root", str(base / "storage"), "--runroot", str(base / "runroot"),
                     "--tmpdir", str(base / "tmp"), "--cgroup-manager", "cgroupfs", "--events-backend", "file"]
        self.runtime = env_wrapper(base / "coldsnap-runtime", coldsnap_env(base))
        self.hooks_dir = base / "hooks.d"
        self.hooks_dir.mkdir()
        for name in ("coldsnap.json", "coldsnap-poststop.json"):  # the packaged files, pointed at this venv
            hook = json.loads((REPO / "packaging" / "oci-hooks.d" / name).read_text())
            hook["hook"]["path"] = str(Path(str(self.runtime)).parent / "coldsnap-hook")
            hook["hook"]["env"] = [f"{k}={v}" for k, v in coldsnap_env(base).items()]
            (self.hooks_dir / name).write_text(json.dumps(hook))
        env_wrapper(base / "coldsnap-hook", coldsnap_env(base), target=REPO / ".venv" / "bin" / "coldsnap-hook")

    def __call__(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.glob, *args], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise AssertionError(f"podman {' '.join(args[:3])}… failed ({r.returncode}): {r.stderr.strip()[-800:]}")
        return r

    def run_engine(self, name: str, *extra: str) -> subprocess.CompletedProcess:
        volumes = [a for b in shared_binds() for a in ("-v", f"{b['source']}:{b['destination']}:ro")]
        return self("run", "-d", "--name", name, "--runtime", str(self.runtime), "--network", "none", *LIMITS,
                    "-e", "PYTHONDONTWRITEBYTECODE=1", *volumes, "-v", f"{self.models}:/models", *extra,
                    IMAGE, *ENGINE_ARGS, check=False)

    def inspect(self, name: str) -> dict:
        return json.loads(self("inspect", name).stdout)[0]


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    needs_root()
    ensure("podman")
    base = tmp_path_factory.mktemp("podman")
    p = Podman(base)
    rootfs = make_rootfs(base / "rootfs")
    with tarfile.open(base / "rootfs.tar", "w") as tar:
        tar.add(rootfs, arcname=".")
    p("import", "--change", 'CMD ["/bin/sh"]', str(base / "rootfs.tar"), IMAGE)
    with private_coldsnap(base):
        try:
            yield p
        finally:
            p("rm", "-a", "-f", "-t", "0", check=False)
            p("rmi", "-a", "-f", check=False)


@pytest.fixture(scope="module")
def captured(podman):
    from coldsnap.flows.container_capture import capture_container

    name = unique("cold")
    r = podman.run_engine(name)
    assert r.returncode == 0, r.stderr
    info = podman.inspect(name)
    wait_for(lambda: healthy_in(info["State"]["Pid"]), 120, "the cold engine")
    text = completion_in(info["State"]["Pid"])
    res = capture_container(info["Id"], "/run/runc", tag="podman-test")  # podman's runc keeps state in /run/runc
    wait_for(lambda: podman.inspect(name)["State"]["Status"] == "exited", 30, "podman to see the capture's stop")
    podman("rm", name)
    return {"capsule": res.capsule, "text": text, "profile": res.profile}


def test_podman_run_restores_from_the_annotated_capsule(podman, captured):
    assert captured["profile"].snapshot_driver == "criu-runc"
    name = unique("restored")
    r = podman.run_engine(name, "--annotation", f"{mt.ANNOTATION_CAPSULE}={captured['capsule']}",
                          "--hooks-dir", str(podman.hooks_dir))
    assert r.returncode == 0, r.stderr
    info = podman.inspect(name)
    assert info["State"]["Status"] == "running"
    rec = receipt(info["Id"])
    assert rec["state"] == "succeeded", rec
    assert rec["result"]["validated_text"] == captured["text"]
    assert ["admit", "stage", "criu-restore", "hydrate", "validate"] == [s["name"] for s in rec["spans"]]
    assert completion_in(info["State"]["Pid"]) == captured["text"]
    # podman injected the hook from hooks.d; the shim added no second one
    spec = json.loads((Path(info["StaticDir"]) / "config.json").read_text())
    assert len(spec["hooks"]["poststart"]) == 1
    podman("rm", "-f", "-t", "0", name)
    assert not (settings().run / "shim" / f"{info['Id']}.json").exists()


def test_podman_run_falls_back_cold_when_the_capsule_is_refused(podman, captured):
    store = CapsuleStore(settings().store)
    cap = store.load(captured["capsule"])
    other = store.write_capsule(cap.profile.model_copy(update={"host": cap.profile.host.model_copy(
        update={"cpu_flags": cap.profile.host.cpu_flags + ["imaginary_flag"]})}), cap.layers, {})
    name = unique("fallback")
    r = podman.run_engine(name, "--annotation", f"{mt.ANNOTATION_CAPSULE}={other}")
    assert r.returncode == 0, r.stderr
    info = podman.inspect(name)
    rec = receipt(info["Id"])
    assert rec["state"] == "fell-back" and "imaginary_flag" in rec["result"]["fallback_reason"]
    wait_for(lambda: healthy_in(info["State"]["Pid"]), 120, "the cold engine")
    assert completion_in(info["State"]["Pid"]) == captured["text"]
    podman("rm", "-f", "-t", "0", name)


# --- vLLM ---------------------------------------------------------------------------------------------------------
def run_launch(podman: Podman, name: str, launch, netns: str, *extra: str) -> subprocess.CompletedProcess:
    """`podman run -d` of an engine adapter's container launch in a network namespace made beforehand (a pod's):
    clients reach it from the host."""
    return podman("run", "-d", "--name", name, "--runtime", str(podman.runtime),
                  "--network", f"ns:/var/run/netns/{netns}",
                  *LIMITS, *NAMED, *launch_run_args(launch), *extra, IMAGE, *launch.argv, check=False)


@pytest.fixture(scope="module")
def pod_network():
    ns = VethNetNS("cspod")
    try:
        yield ns
    finally:
        ns.delete()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_podman_restores_an_engine_container_with_the_same_completions(podman, pod_network, engine):
    from test_engine_vllm import completions

    from coldsnap.flows.container_capture import capture_container

    launch, ns = engine_launch(engine), pod_network
    model = launch.model_id
    name = unique(f"{engine}-cold")
    r = run_launch(podman, name, launch, ns.name)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: healthy_at(ns.address, 8000) or podman.inspect(name)["State"]["Status"] != "running", 600,
             f"{engine} to answer /health")
    assert healthy_at(ns.address, 8000), \
        f"the {engine} container stopped: {podman('logs', name, check=False).stderr[-800:]}"
    before = completions(ns.address, 8000, model)
    assert len(set(before)) > 1, before  # not degenerate
    res = capture_container(podman.inspect(name)["Id"], "/run/runc", engine=engine, tag=f"podman-{engine}",
                            image=IMAGE)
    assert res.receipt.state == "succeeded" and res.profile.engine.name == engine
    assert res.profile.snapshot_driver == "criu-runc" and res.profile.launch.command == launch.argv
    wait_for(lambda: podman.inspect(name)["State"]["Status"] == "exited", 30, "podman to see the capture's stop")
    podman("rm", name)

    # The restore runs exactly what `coldsnap run-args` prints (podman's private storage options put in front, and
    # this VM's ulimits, which podman's defaults exceed: host set-up, not restore options).
    restored = unique(f"{engine}-restored")
    printed = subprocess.run([sys.executable, "-m", "coldsnap.cli", "run-args", res.capsule, "--for", "podman",
                              "--name", restored, "--runtime-path", str(podman.runtime), "--json"],
                             capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    argv = json.loads(printed.stdout)["argv"]
    assert argv[:3] == ["podman", "run", "-d"] and f"{mt.ANNOTATION_CAPSULE}={res.capsule}" in argv
    assert argv[-len(launch.argv):] == launch.argv and IMAGE in argv
    r = podman(*argv[1:3], *LIMITS, *NAMED, *argv[3:], check=False)
    assert r.returncode == 0, r.stderr
    info = podman.inspect(restored)
    rec = receipt(info["Id"])
    assert rec["state"] == "succeeded" and "fallback_reason" not in rec["result"], (rec["state"], rec["result"].get(
        "fallback_reason"), rec.get("error"))  # restored, not fell back
    assert [s["name"] for s in rec["spans"]] == ["admit", "stage", "criu-restore", "hydrate", "validate"]
    assert rec["result"]["validated_text"] == res.profile.expected_text
    assert completions(ns.address, 8000, model) == before
    shm = [f.path for f in res.profile.files if f.path.startswith("/dev/shm/")]
    print(f"\n[measured] {engine} under podman: restore → first token {rec['result'].get('time_to_first_token_s')} s; "
          f"{len(shm)} /dev/shm file(s) carried; "
          f"capture {[(s.name, round(s.duration_s, 2)) for s in res.receipt.spans]}")
    podman("rm", "-f", "-t", "0", restored)
