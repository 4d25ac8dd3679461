"""The manifests in docs/kubernetes.md are valid Kubernetes objects: each against the Kubernetes schemas with
kubernetes-validate (strict: an unknown field fails), and each through Debian's kubectl (`kubectl apply
--dry-run=client`, provisioned by packaging/kubernetes/kubectl.sh). No cluster runs here: kubectl talks to a
loopback stand-in that answers API discovery for the kinds the page uses and "not found" for every object (named
as such: it is not an API server, and kubectl's schema validation is left to kubernetes-validate)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (the test extra)")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "kubernetes.md"
KUBECTL_SH = REPO / "packaging" / "kubernetes" / "kubectl.sh"
KUBECTL = Path("/var/lib/coldsnap/kubectl/bin/kubectl")
K8S_VERSION = "1.33"  # the schemas checked against (kubernetes-validate bundles them per release)

# kind → (group/version, plural, namespaced): the kinds docs/kubernetes.md uses
KINDS = {"Pod": ("v1", "pods", True), "RuntimeClass": ("node.k8s.io/v1", "runtimeclasses", False),
         "Deployment": ("apps/v1", "deployments", True), "DaemonSet": ("apps/v1", "daemonsets", True)}


def manifests() -> list[tuple[int, dict]]:
    """(block number, object) for every YAML block of the page, multi-document blocks split."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert blocks, f"no yaml blocks in {DOC}"
    return [(i, obj) for i, block in enumerate(blocks) for obj in yaml.safe_load_all(block) if obj]


def test_every_manifest_is_valid_against_the_kubernetes_schemas():
    objs = manifests()
    assert {o["kind"] for _, o in objs} == set(KINDS), "the page's kinds changed: update KINDS"
    for i, obj in objs:
        try:
            kv.validate(obj, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"docs/kubernetes.md yaml block {i} ({obj['kind']} {obj['metadata']['name']}): {e.message}")


def test_the_schema_check_can_fail():
    _, pod = next((i, o) for i, o in manifests() if o["kind"] == "Pod")
    pod["spec"]["runtimeClass"] = "coldsnap"  # a typo of runtimeClassName
    with pytest.raises(kv.ValidationError):
        kv.validate(pod, K8S_VERSION, strict=True)


def test_pods_name_the_runtime_class_and_a_pinned_capsule():
    for _, obj in manifests():
        if obj["kind"] in ("Pod", "Deployment"):
            meta, spec = (obj["metadata"], obj["spec"]) if obj["kind"] == "Pod" else (
                obj["spec"]["template"]["metadata"], obj["spec"]["template"]["spec"])
            assert spec["runtimeClassName"] == "coldsnap"
            assert re.fullmatch(r".+@sha256:[0-9a-f]{64}", meta["annotations"]["io.coldsnap.capsule"])


class Discovery(BaseHTTPRequestHandler):
    """API discovery for KINDS (the legacy, unaggregated documents) and 404 for any object."""

    def log_message(self, *args):
        pass

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        path = self.path.split("?")[0]
        groups: dict[str, list[tuple[str, str, bool]]] = {}
        for kind, (gv, plural, namespaced) in KINDS.items():
            groups.setdefault(gv, []).append((kind, plural, namespaced))
        if path == "/api":
            return self._json(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        if path == "/apis":
            named = sorted({gv for gv in groups if "/" in gv})
            return self._json(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": gv.split("/")[0], "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}],
                 "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]}} for gv in named]})
        gv = path.removeprefix("/api/").removeprefix("/apis/")
        if gv in groups:
            return self._json(200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": [
                {"name": plural, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind,
                 "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]}
                for kind, plural, namespaced in groups[gv]]})
        return self._json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                "code": 404, "message": f"{path} not found (stand-in)"})


@pytest.fixture(scope="module")
def kubectl():
    if os.geteuid() != 0 and not KUBECTL.exists():
        pytest.skip(f"Debian's kubectl is provisioned by {KUBECTL_SH} as root")
    r = subprocess.run([str(KUBECTL_SH)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-800:]
    return KUBECTL


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Discovery)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = tmp_path_factory.mktemp("kube") / "config"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
        "clusters": [{"name": "stand-in", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
        "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "u", "namespace": "default"}}],
        "users": [{"name": "u", "user": {}}]}))
    yield config
    server.shutdown()


def _apply(kubectl: Path, config: Path, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(kubectl), "--kubeconfig", str(config), "apply", "--dry-run=client",
                           "--validate=false", "-o", "name", "-f", str(path)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": str(config.parent)})


def test_debian_kubectl_accepts_every_manifest(kubectl, stand_in, tmp_path):
    objs = manifests()
    path = tmp_path / "all.yaml"
    path.write_text("\n---\n".join(yaml.safe_dump(o) for _, o in objs))
    r = _apply(kubectl, stand_in, path)
    assert r.returncode == 0, r.stderr[-1500:]
    names = r.stdout.split()
    assert len(names) == len(objs), (names, r.stderr)
    assert sorted(n.split("/")[0].split(".")[0] for n in names) == sorted(o["kind"].lower() for _, o in objs)
    # and it can refuse: a manifest that is not an object of any kind it knows
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Pood\nmetadata: {name: x}\n")
    assert _apply(kubectl, stand_in, bad).returncode != 0
