"""coldsnap-runtime's decision (coldsnap.shim.main.decide), as a table: runc argv + what the bundle's spec and the
shim's records say → pass through / restore / answer start / delete. No root, no runc: the real-runc behaviour is
in test_shim_runc.py. And the pass-through path's imports, counted."""

import json
import os
import subprocess
import sys

import pytest

from coldsnap.oci.argv import parse_runc_argv
from coldsnap.oci.records import ShimRecord
from coldsnap.shim.main import ANSWER_START, DELETE, PASS_THROUGH, RESTORE, annotated_spec, decide

ROOT = "/run/runc"
ANNOTATED = {"ociVersion": "1.0.2", "annotations": {"io.coldsnap.capsule": "sha256:" + "a" * 64}}
RESTORED = ShimRecord.from_json({"outcome": "restored", "id": "c1", "root": ROOT, "bundle": "/b"})
FELL_BACK = ShimRecord.from_json({"outcome": "fell-back", "id": "c1", "root": ROOT, "bundle": "/b"})
RESTORING = ShimRecord.from_json({"outcome": "restoring", "id": "c1", "root": ROOT, "bundle": "/b",
                                  "owner": {"pid": 1, "start": 0}})
OTHER_ROOT = ShimRecord.from_json({"outcome": "restored", "id": "c1", "root": "/run/other-runc", "bundle": "/b"})

# (argv, the bundle's spec is annotated, the shim's record of c1, expected action)
TABLE = [
    (["--version"], False, None, PASS_THROUGH),
    (["create", "--bundle", "/b", "c1"], False, None, PASS_THROUGH),  # unannotated
    (["create", "--bundle", "/b", "c1"], True, None, RESTORE),
    (["--root", ROOT, "create", "-b", "/b", "--pid-file", "/p", "c1"], True, None, RESTORE),
    (["run", "-d", "-b", "/b", "c1"], True, None, RESTORE),  # run --detach = create + start
    (["run", "-b", "/b", "c1"], True, None, RESTORE),  # foreground run: the flow refuses it, not the decision
    (["create", "--bundle", "/b"], True, None, PASS_THROUGH),  # no container id: runc's usage error
    (["start", "c1"], False, RESTORED, ANSWER_START),
    (["--root", ROOT, "start", "c1"], False, RESTORED, ANSWER_START),
    (["start", "c1"], False, FELL_BACK, PASS_THROUGH),  # a cold container starts under runc
    (["start", "c1"], False, RESTORING, ANSWER_START),  # its create died mid-restore: the shim deletes it
    (["delete", "c1"], False, RESTORING, DELETE),
    (["start", "c1"], False, None, PASS_THROUGH),  # not ours
    (["start", "../c1"], False, RESTORED, PASS_THROUGH),  # an id runc refuses: runc answers
    (["create", "-b", "/b", "c1/.."], True, None, PASS_THROUGH),
    (["start", "c1"], False, OTHER_ROOT, PASS_THROUGH),  # same id under another runc root: not ours
    (["delete", "c1"], False, RESTORED, DELETE),
    (["delete", "--force", "c1"], False, FELL_BACK, DELETE),  # its record must go too
    (["delete", "c1"], False, None, PASS_THROUGH),
    (["state", "c1"], True, RESTORED, PASS_THROUGH),
    (["kill", "c1", "KILL"], False, RESTORED, PASS_THROUGH),
    (["exec", "c1", "create", "--bundle", "/b"], True, RESTORED, PASS_THROUGH),  # positional words, not a create
    (["checkpoint", "c1"], True, RESTORED, PASS_THROUGH),
    (["list"], False, None, PASS_THROUGH),
    ([], False, None, PASS_THROUGH),
]


@pytest.mark.parametrize("argv,annotated,record,want", TABLE, ids=[" ".join(t[0]) or "(none)" for t in TABLE])
def test_the_shim_decides_from_argv_spec_and_record(argv, annotated, record, want):
    def spec_of(bundle):
        assert bundle == "/b"  # the bundle the argv names
        return ANNOTATED if annotated else None

    def record_of(cid):
        assert cid == "c1"
        return record

    action, data = decide(parse_runc_argv(argv), spec_of=spec_of, record_of=record_of)
    assert action == want
    assert data == {RESTORE: ANNOTATED, ANSWER_START: record, DELETE: record, PASS_THROUGH: None}[action]


def test_only_a_bundle_that_names_a_capsule_is_restored(tmp_path):
    def bundle(spec) -> str:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(spec if isinstance(spec, str) else json.dumps(spec))
        return str(d)

    assert annotated_spec(bundle(ANNOTATED)) == ANNOTATED
    assert annotated_spec(bundle({"process": {"env": ["COLDSNAP_CAPSULE=sha256:" + "b" * 64]}})) is not None
    for spec in ({}, {"annotations": {"io.coldsnap.capsule": "  "}}, {"annotations": {"other": "x"}}, "{not json",
                 "[1, 2]"):
        assert annotated_spec(bundle(spec)) is None, spec
    assert annotated_spec(str(tmp_path / "missing")) is None  # runc reports a missing bundle itself
    # A pod's pause container carries the pod's annotations (containerd's pod_annotations, CRI-O): never restored.
    for mark in ({"io.kubernetes.cri.container-type": "sandbox"}, {"io.kubernetes.cri-o.ContainerType": "sandbox"}):
        assert annotated_spec(bundle({"annotations": {**ANNOTATED["annotations"], **mark}})) is None, mark
    container = {"io.kubernetes.cri.container-type": "container"}
    assert annotated_spec(bundle({"annotations": {**ANNOTATED["annotations"], **container}})) is not None


# The pass-through path runs on every runc call of a node: it may import only these stdlib-only modules of ours.
PASS_THROUGH_MODULES = {"coldsnap", "coldsnap.shim", "coldsnap.shim.main", "coldsnap.oci", "coldsnap.oci.argv",
                        "coldsnap.oci.runtime"}
MORE = {"create": {"coldsnap.oci.spec"}, "start": {"coldsnap.oci.records"}, "delete": {"coldsnap.oci.records"}}


@pytest.mark.parametrize("argv", [["--version"], ["list"], ["state", "c1"], ["kill", "c1", "KILL"],
                                  ["create", "--bundle", "BUNDLE", "c1"], ["start", "c1"], ["delete", "c1"],
                                  ["exec", "c1", "true"]], ids=lambda a: a[0])
def test_the_pass_through_imports_only_a_handful_of_stdlib_modules(tmp_path, argv):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "annotations": {"other": "x"}}))
    argv = [str(bundle) if a == "BUNDLE" else a for a in argv]
    fake_runc = tmp_path / "runc"
    fake_runc.write_text("#!/bin/sh\necho \"runc $*\"\n")
    fake_runc.chmod(0o755)
    env = {**os.environ, "COLDSNAP_RUNC": str(fake_runc), "COLDSNAP_RUN": str(tmp_path / "run")}
    r = subprocess.run([sys.executable, "-X", "importtime", "-c",
                        "import sys; from coldsnap.shim.main import main; sys.exit(main())", *argv],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == f"runc {' '.join(argv)}\n", r.stderr[-2000:]  # runc got the argv as is
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    ours = {m for m in imported if m == "coldsnap" or m.startswith("coldsnap.")}
    assert ours <= PASS_THROUGH_MODULES | MORE.get(argv[0], set()), sorted(ours)
    assert len(ours) <= 7
    assert not {m for m in imported if m.split(".")[0] in ("pydantic", "pycriu", "pyroute2", "torch", "zstandard")}


def test_a_shim_record_is_typed_and_survives_its_file(tmp_path, monkeypatch):
    from coldsnap.oci import records
    from coldsnap.oci.records import Outcome, Owner

    monkeypatch.setenv("COLDSNAP_RUN", str(tmp_path))
    monkeypatch.setattr(records, "MARKERS", str(tmp_path / "markers"))
    record = ShimRecord(outcome=Outcome.RESTORING, id="c1", root=ROOT, bundle="/b", runc="/usr/bin/runc",
                        owner=Owner(pid=7, start=11), summary="c1 restored and validated")
    records.save("c1", record)
    assert json.loads((tmp_path / "shim" / "c1.json").read_text())["outcome"] == "restoring"  # the file's word
    assert records.load("c1") == record
    (tmp_path / "shim" / "c1.json").write_text(json.dumps({**record.to_json(), "from_a_later_version": 1}))
    assert records.load("c1") == record  # what it does not know, it leaves
    for damaged in ("{not json", json.dumps({"outcome": "unheard-of", "id": "c1", "root": ROOT, "bundle": "/b"}),
                    json.dumps({"id": "c1"})):
        (tmp_path / "shim" / "c1.json").write_text(damaged)
        assert records.load("c1") is None, damaged
