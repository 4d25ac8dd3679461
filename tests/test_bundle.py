"""coldsnap.bundle: runc's argv as runc parses it, config.json round trips, CRIU options as runc takes them,
and the shim's reading of a container's annotations. Pure functions: no root needed."""

import json
import os
import stat

import pytest

from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.criu import CriuOptions
from coldsnap.criu.runc import split_options
from coldsnap.flows.container_restore import request_from_annotations
from coldsnap.oci.argv import parse_runc_argv
from coldsnap.oci.spec import annotations_of, ensure_hook, hooks, load_spec, netns_path, write_spec


# --- argv ------------------------------------------------------------------------------------------------------
def test_containerd_create_argv():
    argv = ["--root", "/run/containerd/runc/default", "--log", "/run/x/log.json", "--log-format", "json",
            "--systemd-cgroup", "create", "--bundle", "/run/b", "--pid-file", "/run/b/init.pid",
            "--console-socket", "/tmp/pty.sock", "abc"]
    p = parse_runc_argv(argv)
    assert p.argv == tuple(argv)  # kept verbatim
    assert p.command == "create" and p.container_id == "abc"
    assert p.root == "/run/containerd/runc/default"
    assert p.log == "/run/x/log.json" and p.log_format == "json"
    assert p.globals["systemd-cgroup"] is True
    assert p.bundle == "/run/b" and p.pid_file == "/run/b/init.pid" and p.console_socket == "/tmp/pty.sock"
    assert p.global_argv() == argv[:7]


def test_podman_style_equals_and_single_dash_flags():
    p = parse_runc_argv(["--root=/run/runc", "-log-format=json", "--criu", "/opt/criu", "create", "-b", "/b",
                         "--pid-file=/p", "--no-pivot", "--no-new-keyring", "--preserve-fds", "2", "id1"])
    assert p.root == "/run/runc" and p.log_format == "json" and p.globals["criu"] == "/opt/criu"
    assert p.bundle == "/b" and p.pid_file == "/p" and p.container_id == "id1"
    assert p.flag("no-pivot") is True and p.flag("no-new-keyring") is True and p.flags["preserve-fds"] == "2"
    # dropping globals keeps the rest in order, values included
    assert p.global_argv(drop=("criu",)) == ["--root=/run/runc", "-log-format=json"]
    assert p.global_argv(drop=("root", "log-format")) == ["--criu", "/opt/criu"]


def test_defaults_bundle_is_cwd_root_is_run_runc(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = parse_runc_argv(["run", "-d", "c1"])
    assert p.bundle == str(tmp_path) and p.root == "/run/runc" and p.detach and p.log is None
    assert p.log_format == "text" and p.pid_file is None
    assert parse_runc_argv(["run", "--detach=false", "c1"]).detach is False


def test_exec_arguments_after_the_id_are_positional():
    p = parse_runc_argv(["--root", "/r", "exec", "-e", "A=1", "--tty", "c1", "sh", "-c", "--not-a-flag"])
    assert p.command == "exec" and p.flags == {"e": "A=1", "tty": True}
    assert p.args == ("c1", "sh", "-c", "--not-a-flag")


def test_no_subcommand_and_double_dash():
    assert parse_runc_argv(["--version"]).command is None
    assert parse_runc_argv(["--version"]).globals == {"version": True}
    assert parse_runc_argv([]).command is None
    p = parse_runc_argv(["kill", "--all", "--", "c1", "TERM"])
    assert p.command == "kill" and p.flags == {"all": True} and p.args == ("c1", "TERM")
    p = parse_runc_argv(["--root", "/r", "delete", "--force", "c9"])
    assert p.command == "delete" and p.container_id == "c9" and p.flag("force", "f") is True


# --- config.json -----------------------------------------------------------------------------------------------
SPEC = {
    "ociVersion": "1.0.2-dev",
    "process": {"args": ["/bin/sh"], "x-vendor": {"deep": [1, 2, {"k": None}]}},
    "root": {"path": "rootfs"},
    "annotations": {"io.coldsnap.capsule": "sha256:" + "a" * 64, "other": "1"},
    "linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/var/run/netns/x"}]},
    "hooks": {"poststart": [{"path": "/usr/bin/other-hook"}]},
    "unknownTopLevel": {"kept": True, "ünïcode": "✓"},
}


def test_config_round_trip_keeps_unknown_fields_and_mode(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SPEC))
    os.chmod(tmp_path / "config.json", 0o640)
    spec = load_spec(tmp_path)
    assert spec == SPEC
    assert ensure_hook(spec, "poststart", {"path": "/x/coldsnap-hook", "args": ["coldsnap-hook", "poststart"]})
    assert not ensure_hook(spec, "poststart", {"path": "/other/place/coldsnap-hook"})  # one per executable name
    write_spec(tmp_path, spec)
    again = load_spec(tmp_path)
    assert again["unknownTopLevel"] == SPEC["unknownTopLevel"]
    assert again["process"]["x-vendor"] == SPEC["process"]["x-vendor"]
    assert [h["path"] for h in hooks(again, "poststart")] == ["/usr/bin/other-hook", "/x/coldsnap-hook"]
    assert stat.S_IMODE(os.stat(tmp_path / "config.json").st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["config.json"]  # no temp file left
    assert annotations_of(again)["other"] == "1" and netns_path(again) == "/var/run/netns/x"
    assert hooks(again, "poststop") == [] and annotations_of({}) == {} and netns_path({}) is None


# --- CRIU options under runc -----------------------------------------------------------------------------------
def test_criu_options_split_into_runc_flags_and_config_lines():
    flags, lines = split_options(CriuOptions(leave_running=True, network_lock="skip").cli_flags(), "checkpoint")
    assert flags == ["--tcp-established", "--ext-unix-sk", "--file-locks", "--leave-running"]
    assert lines == ["link-remap", "ghost-limit 1024M", "network-lock skip"]
    flags, lines = split_options(CriuOptions(leave_running=True, external=["net[1]:x"]).cli_flags(), "restore")
    assert "--leave-running" not in flags and not any("external" in line for line in lines)


# --- annotations → request --------------------------------------------------------------------------------------
def test_annotations_become_a_restore_request():
    ref = "sha256:" + "b" * 64
    c = request_from_annotations({"io.coldsnap.capsule": ref,
                                  "io.coldsnap.policy": '{"fallback_to_cold": false, "compatibility": "relaxed"}',
                                  "io.coldsnap.validation": '{"host": "10.0.0.2", "port": 9000, "ready_timeout_s": 5}'})
    assert c.request.capsule == ref and c.request.policy.fallback_to_cold is False
    assert c.request.policy.compatibility == "relaxed"
    assert (c.host, c.port) == ("10.0.0.2", 9000) and c.validation_overrides == {"ready_timeout_s": 5}
    defaults = request_from_annotations({"io.coldsnap.capsule": ref})
    assert defaults.request.policy.fallback_to_cold is True and defaults.host is None and defaults.port is None


@pytest.mark.parametrize("ann, where", [
    ({"io.coldsnap.policy": "{not json"}, "io.coldsnap.policy"),
    ({"io.coldsnap.policy": '{"fallback_to_cold": true, "typo": 1}'}, "typo"),
    ({"io.coldsnap.validation": '{"port": "eighty"}'}, "port"),
    ({"io.coldsnap.validation": "[1]"}, "JSON object"),
])
def test_malformed_annotations_are_invalid_requests(ann, where):
    with pytest.raises(ColdSnapError) as e:
        request_from_annotations({"io.coldsnap.capsule": "sha256:" + "c" * 64, **ann})
    assert e.value.code == ErrorCode.INVALID_REQUEST and where in e.value.message


def test_the_host_usr_rootfs_has_the_links_and_mount_points_and_can_be_made_twice(tmp_path):
    import stat

    from coldsnap_bench.rootfs import MOUNT_POINTS, host_usr_rootfs

    root = host_usr_rootfs(tmp_path / "rootfs", extra_dirs=("/cache",))
    assert host_usr_rootfs(root, extra_dirs=("/cache",)) == root  # again over itself: no error, same result
    assert os.readlink(root / "bin") == "usr/bin"
    assert all((root / d).is_dir() for d in (*MOUNT_POINTS, "cache"))
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
    assert (root / "etc" / "passwd").read_text().startswith("root:x:0:0:")



def test_create_runtime_hook_acts_only_in_a_network_namespace_the_runtime_made(tmp_path):
    """runc runs createRuntime at CRIU's setup-namespaces during a restore: lo must be up before CRIU reconnects
    loopback TCP connections. The hook acts only where the runtime made the namespace (no path in the spec)."""
    from coldsnap.hooks.createruntime import create_runtime, own_network_namespace

    assert own_network_namespace({"linux": {"namespaces": [{"type": "pid"}, {"type": "network"}]}})
    assert not own_network_namespace({"linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/pod"}]}})
    assert not own_network_namespace({"linux": {"namespaces": [{"type": "pid"}]}})  # the host's network
    (tmp_path / "config.json").write_text(json.dumps({"linux": {"namespaces": [
        {"type": "network", "path": "/var/run/netns/pod"}]}}))
    assert create_runtime({"id": "c", "pid": 1, "bundle": str(tmp_path)}) == 0  # a pod's namespace: untouched
    assert create_runtime({"id": "c", "pid": 1, "bundle": str(tmp_path / "missing")}) == 1


def test_create_runtime_hook_brings_lo_up_in_a_fresh_network_namespace(tmp_path):
    import subprocess
    import sys
    import time

    if os.geteuid() != 0:
        pytest.skip("needs root to make a network namespace")
    (tmp_path / "config.json").write_text(json.dumps({"linux": {"namespaces": [{"type": "network"}]}}))
    ns = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{ns.pid}/ns/net") == os.readlink("/proc/self/ns/net"):  # until unshare has run
            assert time.monotonic() < deadline, "unshare made no network namespace"
            time.sleep(0.02)
        show = ["nsenter", f"--net=/proc/{ns.pid}/ns/net", "ip", "-o", "link", "show", "lo"]
        flags = lambda: subprocess.run(show, capture_output=True, text=True).stdout.split("<")[1].split(">")[0]  # noqa: E731
        assert "UP" not in flags().split(",")  # a fresh namespace: lo down
        hook = os.path.join(os.path.dirname(sys.executable), "coldsnap-hook")
        state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": ns.pid,
                            "bundle": str(tmp_path)})
        r = subprocess.run([hook, "createRuntime"], input=state, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "UP" in flags().split(",")
    finally:
        ns.kill()
        ns.wait()
