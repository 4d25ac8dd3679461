"""Registering coldsnap-runtime with docker, containerd and podman: existing keys kept, atomic writes, a diff in
dry-run, idempotent. Files only (no daemon needed); containerd's own default config is used when installed."""

import json
import os
import shutil
import stat
import subprocess
import tomllib

import pytest

from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.host.runtimes import RUNTIME_CLASS, configure

RT = "/opt/coldsnap/bin/coldsnap-runtime"


def run(runtime, path, **kw):
    lines = []
    res = configure(runtime, config=path, runtime_path=RT, out=lines.append, **kw)
    return res, "\n".join(lines)


def test_docker_keeps_existing_keys_and_runtimes(tmp_path):
    path = tmp_path / "daemon.json"
    path.write_text(json.dumps({"data-root": "/d", "runtimes": {"nvidia": {"path": "nvidia-container-runtime"}},
                                "log-opts": {"max-size": "10m"}}))
    path.chmod(0o600)
    res, _ = run("docker", path, set_default=True)
    data = json.loads(path.read_text())
    assert data["data-root"] == "/d" and data["log-opts"] == {"max-size": "10m"}
    assert data["runtimes"] == {"nvidia": {"path": "nvidia-container-runtime"}, "coldsnap": {"path": RT}}
    assert data["default-runtime"] == "coldsnap"
    assert res.written and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["daemon.json"]  # no temp file left
    again, _ = run("docker", path, set_default=True)
    assert not again.changed and not again.written


def test_dry_run_prints_the_diff_and_writes_nothing(tmp_path):
    path = tmp_path / "daemon.json"
    path.write_text('{"debug": true}\n')
    res, printed = run("docker", path, dry_run=True)
    assert res.changed and not res.written and path.read_text() == '{"debug": true}\n'
    assert '+    "coldsnap": {' in printed and printed.startswith("---")
    missing = tmp_path / "new" / "daemon.json"
    res, _ = run("docker", missing, dry_run=True)
    assert res.changed and not missing.exists()


def test_docker_refuses_to_clobber_an_invalid_file(tmp_path):
    path = tmp_path / "daemon.json"
    path.write_text("{not json")
    with pytest.raises(ColdSnapError) as e:
        run("docker", path)
    assert e.value.code == ErrorCode.ENVIRONMENT and path.read_text() == "{not json"


def _containerd_default() -> str:
    if shutil.which("containerd"):
        return subprocess.run(["containerd", "config", "default"], capture_output=True, text=True, check=True).stdout
    return 'version = 2\n\n[plugins."io.containerd.grpc.v1.cri".containerd]\n  default_runtime_name = "runc"\n'


CONTAINERD2 = "/var/lib/coldsnap/containerd2/bin/containerd"  # packaging/containers/containerd2.sh
V3_SAMPLE = ("version = 3\n\n[plugins]\n  [plugins.'io.containerd.cri.v1.runtime']\n"
             "    [plugins.'io.containerd.cri.v1.runtime'.containerd]\n      default_runtime_name = 'runc'\n"
             "      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n"
             "        runtime_type = 'io.containerd.runc.v2'\n")


def _containerd2_default() -> str:
    """containerd 2.x's default config (version 3, single-quoted keys): from the provisioned binary when there is
    one, else a sample of its shape."""
    if os.access(CONTAINERD2, os.X_OK):
        return subprocess.run([CONTAINERD2, "config", "default"], capture_output=True, text=True, check=True).stdout
    return V3_SAMPLE


@pytest.mark.parametrize("version,plugin", [(2, "io.containerd.grpc.v1.cri"), (3, "io.containerd.cri.v1.runtime")])
def test_containerd_runtime_binary_name_and_runtime_class(tmp_path, version, plugin):
    path = tmp_path / "config.toml"
    path.write_text(_containerd_default() if version == 2 else _containerd2_default())
    before = tomllib.loads(path.read_text())
    assert before["version"] == version
    rc_path = tmp_path / "runtimeclass.yaml"
    res, printed = run("containerd", path, set_default=True, runtime_class_path=rc_path)
    after = tomllib.loads(path.read_text())
    cri = after["plugins"][plugin]["containerd"]
    assert cri["runtimes"]["coldsnap"]["runtime_type"] == "io.containerd.runc.v2"
    assert cri["runtimes"]["coldsnap"]["options"]["BinaryName"] == RT
    assert cri["runtimes"]["coldsnap"]["pod_annotations"] == ["io.coldsnap.*"]
    assert cri["default_runtime_name"] == "coldsnap"
    # everything else as it was
    before_cri = before["plugins"][plugin]["containerd"]
    for key, value in before_cri.items():
        if key not in ("default_runtime_name", "runtimes"):
            assert cri[key] == value
    assert cri["runtimes"].get("runc") == before_cri.get("runtimes", {}).get("runc")
    assert {k: v for k, v in after.items() if k != "plugins"} == {k: v for k, v in before.items() if k != "plugins"}
    assert rc_path.read_text() == RUNTIME_CLASS and "kind: RuntimeClass" in printed and "handler: coldsnap" in printed
    assert not run("containerd", path, set_default=True)[0].changed  # idempotent


def test_containerd_config_version_1_is_refused_untouched(tmp_path):
    path = tmp_path / "config.toml"
    old = '[plugins.cri.containerd]\n  snapshotter = "overlayfs"\n'  # version 1: no version key
    path.write_text(old)
    with pytest.raises(ColdSnapError) as e:
        run("containerd", path)
    assert e.value.code == ErrorCode.ENVIRONMENT and "config migrate" in e.value.message and path.read_text() == old


def test_podman_engine_runtimes(tmp_path):
    path = tmp_path / "containers.conf"
    path.write_text('[containers]\nlog_size_max = -1\n\n[engine]\ncgroup_manager = "cgroupfs"\n')
    run("podman", path, set_default=True)
    data = tomllib.loads(path.read_text())
    assert data["engine"]["runtimes"]["coldsnap"] == [RT] and data["engine"]["runtime"] == "coldsnap"
    assert data["engine"]["cgroup_manager"] == "cgroupfs" and data["containers"]["log_size_max"] == -1
    fresh = tmp_path / "fresh.conf"
    run("podman", fresh)
    assert tomllib.loads(fresh.read_text()) == {"engine": {"runtimes": {"coldsnap": [RT]}}}


def test_unknown_runtime_is_an_invalid_request(tmp_path):
    with pytest.raises(ColdSnapError) as e:
        configure("cri-o", config=tmp_path / "x")
    assert e.value.code == ErrorCode.INVALID_REQUEST
