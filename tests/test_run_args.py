"""From capture to restore without reading the tests: what a container capture records of its launch, the
command `coldsnap run-args` prints from it, the admission that refuses a container whose mounts differ (before
CRIU), and every `coldsnap` command line of the README parsed as written. No root: the real restores from what
run-args printed are in test_shim_podman.py."""

import re
import shlex
from pathlib import Path

import pytest

from coldsnap.cli.main import build_parser
from coldsnap.contracts import CapsuleProfile, ColdSnapError, HostProfile
from coldsnap.flows.admission import container_differences
from coldsnap.flows.container_capture import container_launch
from coldsnap.host.run_args import run_args

DIGEST = "sha256:" + "d" * 64
SPEC = {
    "process": {"args": ["python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"],
                "env": ["PATH=/usr/bin", "HF_TOKEN=secret-value", "HOME=/root"], "cwd": "/work"},
    "mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
        {"destination": "/etc/resolv.conf", "type": "bind", "source": "/run/x/resolv.conf", "options": ["rbind"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "size=1073741824"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["rw", "rprivate", "nosuid",
                                                                                  "mode=1777", "tmpcopyup"]},
        {"destination": "/opt/venv", "type": "bind", "source": "/var/lib/venvs/vllm", "options": ["rbind", "ro"]},
        {"destination": "/models/", "type": "bind", "source": "/srv/models", "options": ["rbind", "rw"]},
    ],
    "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "network", "path": "/run/netns/pod1"}]},
}


def profile(launch):
    return CapsuleProfile(
        created="2026-12-01T00:00:00Z", snapshot_driver="criu-runc",
        host=HostProfile(arch="x86_64", cpu_model="c", cpu_flags=[], kernel="k", criu_version="4.2.1"),
        engine={"name": "vllm"}, weights_mode="native", kv_discarded=False, launch={}, validation={},
        expected_text="t", container=launch)


def test_a_capture_records_the_launch_without_environment_values():
    launch = container_launch(SPEC, "localhost/vllm:1", "sha256:" + "e" * 64)
    assert launch.args == SPEC["process"]["args"] and launch.cwd == "/work" and launch.image == "localhost/vllm:1"
    assert launch.env_names == ["HF_TOKEN", "HOME", "PATH"] and "secret-value" not in launch.model_dump_json()
    assert launch.network == "path" and launch.network_path == "/run/netns/pod1"
    assert launch.namespaces == ["mount", "network", "pid"] and launch.shm_size == 1 << 30
    assert {m.destination for m in launch.mounts} >= {"/models", "/opt/venv", "/etc/resolv.conf"}


def test_run_args_repeat_the_captured_container():
    p = profile(container_launch(SPEC, "localhost/vllm:1", None))
    podman = run_args(p, DIGEST, "podman", "/usr/local/bin/coldsnap-runtime", name="r1").argv
    assert podman[:5] == ["podman", "run", "-d", "--name", "r1"]
    line = " ".join(podman)
    assert f"--annotation io.coldsnap.capsule={DIGEST}" in line and "--runtime /usr/local/bin/coldsnap-runtime" in line
    assert "--network ns:/run/netns/pod1" in line and "--shm-size 1073741824" in line
    assert "--tmpfs /tmp:rw,mode=1777" in line  # only options every engine takes back
    assert "-v /var/lib/venvs/vllm:/opt/venv:ro" in line and "-v /srv/models:/models:rw" in line
    assert "resolv.conf" not in line and "/proc" not in line  # what podman makes itself
    assert "-e HF_TOKEN" in line and "secret" not in line and "-e PATH" not in line  # names only
    assert podman[-6:] == ["localhost/vllm:1", *SPEC["process"]["args"]] and "-w /work" in line
    docker = run_args(p, DIGEST, "docker", "/x").argv
    assert ["--runtime", "coldsnap", "-e", f"COLDSNAP_CAPSULE={DIGEST}"] == docker[3:7]
    ctr = run_args(p, DIGEST, "ctr", "/x/coldsnap-runtime", name="c1")
    assert ctr.argv[:4] == ["ctr", "run", "-d", "--runc-binary"] and "--with-ns network:/run/netns/pod1" in ctr.line()
    assert "type=bind,src=/srv/models,dst=/models,options=rbind:rw" in ctr.line()
    assert shlex.split(ctr.line()) == ctr.argv
    with pytest.raises(ColdSnapError, match="not captured from a container"):
        run_args(profile(None), DIGEST, "podman", "/x")


def test_admission_names_the_first_mount_or_namespace_the_container_lacks():
    captured = container_launch(SPEC, None, None)
    assert container_differences(captured, SPEC) == []
    no_resolv = {**SPEC, "mounts": [m for m in SPEC["mounts"] if m["destination"] != "/etc/resolv.conf"]}
    assert container_differences(captured, no_resolv)[0] == ("/etc/resolv.conf was mounted (bind) at capture and is "
                                                              "not in this container")
    no_pid = {**SPEC, "linux": {"namespaces": [{"type": "mount"}, {"type": "network"}]}}
    assert container_differences(captured, no_pid) == ["the captured container had its own pid namespace and this "
                                                       "one has none"]
    host_net = {**SPEC, "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}]}}
    assert container_differences(captured, host_net) == [
        "the captured container had its own network namespace and this one has none",
        "the captured container ran in a named network namespace and this one in the host's network"]


README = Path(__file__).resolve().parents[1] / "README.md"
PLACEHOLDERS = {"sha256:…": DIGEST, "NAME@sha256:…": f"demo@{DIGEST}", "HOST[:PORT]/REPO:TAG": "127.0.0.1:5000/r:t",
                "HOST[:PORT]/REPO@sha256:…": f"127.0.0.1:5000/r@{DIGEST}", "NAME": "w1", "REF": DIGEST, "ID": "c1",
                "FILE": "req.json", "KEY=VALUE": "layers=2", "docker|containerd|podman": "docker",
                "podman|docker|ctr": "podman", "engine|cuda": "engine"}


def readme_command_lines() -> list[list[str]]:
    lines = []
    for block in re.findall(r"```(?:sh|bash)?\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("coldsnap "):
                for alternative in line.split(" | "):  # `inspect REF | rm REF | gc` lists several
                    words = alternative.strip().split()
                    words = words if words[0] == "coldsnap" else ["coldsnap", *words]
                    words = [w for w in (PLACEHOLDERS.get(w, w) for w in words[1:]) if not w.startswith("[")]
                    lines.append([w.strip("[]") for w in words])
    return lines


def test_every_coldsnap_line_of_the_readme_parses_as_written():
    parser = build_parser()
    lines = readme_command_lines()
    assert len(lines) >= 10
    for argv in lines:
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"README line does not parse: coldsnap {' '.join(argv)}")
        assert getattr(args, "fn", None), argv
