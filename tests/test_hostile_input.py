"""Hostile input at coldsnap-runtime and the CLI: nothing is touched before it is validated, documents are strict,
every refusal is one line with a stable exit code, never a traceback.

The shim runs here in front of a stand-in runc (a script that records how it was called and answers like runc
would: a stand-in so that no root or container is needed; test_shim_runc.py runs the real runc). Where the real
runc is installed, the pass-through is also compared with it byte for byte."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap.contracts import capsule as mt

SHIM = str(Path(sys.prefix) / "bin" / "coldsnap-runtime")
CLI = [sys.executable, "-m", "coldsnap.cli"]
CAPSULE = "sha256:" + "c" * 64  # pinned, well-formed, in no store

FAKE_RUNC = """#!/bin/sh
# A stand-in for runc: it records its argv, then answers as runc does for these cases.
printf '%s\\n' "$@" > "$RUNC_CALLED"
case " $* " in
  *" create "*) [ -n "$RUNC_CREATE_FAILS" ] && { echo "runc: create failed" >&2; exit 1; } ;;
esac
for a in "$@"; do last="$a"; done
case "$last" in
  *..*|*/*) echo "invalid container ID format: $last" >&2; exit 1 ;;
esac
echo "runc $*"
"""


@pytest.fixture
def lab(tmp_path):
    """A stand-in runc, a private ColdSnap home and run dir nested so that `../../..` from them lands in tmp_path."""
    runc = tmp_path / "runc"
    runc.write_text(FAKE_RUNC)
    runc.chmod(0o755)
    home, run = tmp_path / "h1" / "h2" / "home", tmp_path / "r1" / "r2" / "run"
    env = {"PATH": os.environ["PATH"], "COLDSNAP_RUNC": str(runc), "COLDSNAP_HOME": str(home),
           "COLDSNAP_RUN": str(run), "RUNC_CALLED": str(tmp_path / "runc-called"),
           "COLDSNAP_CRIU_PREFIX": os.environ.get("COLDSNAP_CRIU_PREFIX", "/var/lib/coldsnap/criu")}

    class Lab:
        base = tmp_path

        def shim(self, *args, **extra_env):
            (tmp_path / "runc-called").unlink(missing_ok=True)
            return subprocess.run([SHIM, *args], env={**env, **extra_env}, capture_output=True, text=True,
                                  timeout=120)

        def runc_argv(self):
            called = tmp_path / "runc-called"
            return called.read_text().splitlines() if called.exists() else None

        def bundle(self, name, spec):
            d = tmp_path / "bundles" / name
            d.mkdir(parents=True)
            (d / "config.json").write_bytes(spec if isinstance(spec, bytes) else json.dumps(spec).encode())
            return d

        def cli(self, *args, stdin=b""):
            return subprocess.run([*CLI, *args], env={**os.environ, **env}, input=stdin, capture_output=True,
                                  timeout=120)

    return Lab()


def annotated(**annotations) -> dict:
    return {"ociVersion": "1.0.2", "process": {"args": ["sh"], "env": ["PATH=/bin"]}, "root": {"path": "rootfs"},
            "annotations": {mt.ANNOTATION_CAPSULE: CAPSULE, **annotations}}


def snapshot(root: Path, skip: set[str]) -> dict:
    """Every path under root with its mode, size and mtime (what a stray write or chmod would change)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.name in skip:
            continue
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out


def one_line(stderr: str) -> bool:
    return len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


@pytest.mark.parametrize("cid", ["../../../victim", "../victim", "..", ".", "a/b", "x" * 300, "-flag", "a b", "é"])
def test_an_id_runc_refuses_goes_to_runc_and_nothing_is_touched(lab, cid):
    victim = lab.base / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine")
    for d in ("r1/victim", "h1/victim", "r1/r2/run/shim"):
        (lab.base / d).mkdir(parents=True)
    before = snapshot(lab.base, {"runc-called"})
    bundle = lab.bundle("b", annotated())
    r = lab.shim("--root", str(lab.base / "runc-root"), "create", "-b", str(bundle), cid)
    assert lab.runc_argv() == ["--root", str(lab.base / "runc-root"), "create", "-b", str(bundle), cid]
    after = snapshot(lab.base, {"runc-called"})
    new = {p for p in set(after) - set(before) if not p.startswith("bundles")}
    assert new == set(), new  # no record, no receipt, no work dir: runc's own refusal is all there is
    assert {p: v for p, v in after.items() if p in before} == before  # nothing removed, moved or chmodded
    assert "Traceback" not in r.stderr


def test_the_pass_through_answers_as_runc_byte_for_byte(lab):
    runc = shutil.which("runc")
    if runc is None:
        pytest.skip("no runc on PATH to compare with (the stand-in checks above still ran)")
    bundle = lab.bundle("b", annotated())
    for args in (["--version"], ["--root", str(lab.base / "rr"), "list"], ["--root", str(lab.base / "rr"), "state",
                                                                          "nope"],
                 ["--root", str(lab.base / "rr"), "create", "-b", str(bundle), "../../../victim"]):
        want = subprocess.run([runc, *args], capture_output=True, timeout=60)
        got = subprocess.run([SHIM, *args], capture_output=True, timeout=60,
                             env={**os.environ, "COLDSNAP_RUNC": runc, "COLDSNAP_RUN": str(lab.base / "run")})
        def same(b: bytes) -> bytes:  # runc stamps its log lines with the time
            return re.sub(rb'time="[^"]*"', b'time="T"', b)

        assert (got.returncode, got.stdout, same(got.stderr)) == (want.returncode, want.stdout, same(want.stderr)), args


@pytest.mark.parametrize("spec", [
    {**annotated(), "hooks": {"poststart": {"path": "/bin/true"}}},  # not a list
    {**annotated(), "hooks": {"poststart": [{"path": 7}]}},
    {**annotated(), "annotations": {mt.ANNOTATION_CAPSULE: None}},  # runc: cannot unmarshal null into string
    {**annotated(), "annotations": {mt.ANNOTATION_CAPSULE: 123}},
    {**annotated(), "process": {"env": [1, 2]}},
    {**annotated(), "linux": {"namespaces": "network"}},
    b"[1, 2, 3]", b"{not json", b'{"annotations": {"io.coldsnap.capsule": "\xff"}}',
], ids=["hooks-not-a-list", "hook-path-number", "annotation-null", "annotation-number", "env-numbers",
        "namespaces-string", "array", "not-json", "not-utf8"])
def test_a_spec_runc_refuses_passes_through_for_runc_to_answer(lab, spec):
    bundle = lab.bundle("b", spec)
    before = (bundle / "config.json").read_bytes()
    r = lab.shim("create", "-b", str(bundle), "c1")
    assert r.returncode == 0 and r.stdout == f"runc create -b {bundle} c1\n", r.stderr  # runc got it, unchanged
    assert not (lab.base / "r1" / "r2" / "run").exists()  # no record, no work dir
    assert (bundle / "config.json").read_bytes() == before  # the spec as the caller wrote it


def receipt_of(lab, cid: str) -> dict | None:
    path = lab.base / "h1" / "h2" / "home" / "receipts" / f"{cid}.json"
    return json.loads(path.read_text()) if path.exists() else None


def record_of(lab, cid: str) -> Path:
    return lab.base / "r1" / "r2" / "run" / "shim" / f"{cid}.json"


def test_a_cold_create_that_fails_after_a_refusal_leaves_no_record_and_says_so(lab):
    bundle = lab.bundle("b", annotated())
    r = lab.shim("create", "-b", str(bundle), "c1", RUNC_CREATE_FAILS="1")
    assert r.returncode == 1 and "runc: create failed" in r.stderr  # runc's own answer
    assert lab.runc_argv() == ["create", "-b", str(bundle), "c1"]  # the caller's argv, unchanged
    assert not record_of(lab, "c1").exists()
    rec = receipt_of(lab, "c1")
    assert rec["state"] == "failed" and rec["result"]["started"] == "cold"
    assert "capsule-not-found" in rec["error"]["message"] and "cold start failed too" in rec["error"]["message"]


def test_a_cold_create_after_a_refusal_is_recorded_once_runc_made_it(lab):
    bundle = lab.bundle("b", annotated())
    r = lab.shim("create", "-b", str(bundle), "c2")
    assert r.returncode == 0 and r.stdout == f"runc create -b {bundle} c2\n"
    assert json.loads(record_of(lab, "c2").read_text())["outcome"] == "fell-back"
    assert receipt_of(lab, "c2")["state"] == "fell-back"


@pytest.mark.parametrize("annotations,why", [
    ({"io.coldsnap.polcy": '{"fallback_to_cold": false}'}, "io.coldsnap.polcy"),  # a typo must not become a cold start
    ({mt.ANNOTATION_POLICY: '{"fallback_to_cold": "no"}'}, "fallback_to_cold"),  # no coercion
    ({mt.ANNOTATION_POLICY: '{"fallback_to_cold": true, "fallback_to_cold": false}'}, "duplicate key"),
    ({mt.ANNOTATION_POLICY: '{"compatibility": NaN}'}, "NaN"),
    ({mt.ANNOTATION_POLICY: "[" * 100 + "]" * 100}, "nested"),
    ({mt.ANNOTATION_VALIDATION: '{"port": 8000.0}'}, "port"),
    ({mt.ANNOTATION_VALIDATION: '{"max_tokens": ' + "9" * 5000 + "}"}, "digits"),
    ({mt.ANNOTATION_IMAGE_DIGEST: "sha256:" + "A" * 64}, "image-digest"),
    ({mt.ANNOTATION_CAPSULE: "sha256:" + "a" * 63}, "digest must be sha256"),
    ({mt.ANNOTATION_CAPSULE: "sha512:" + "a" * 128}, "digest must be sha256"),
    ({mt.ANNOTATION_POLICY: '{"x": "' + "y" * 20_000_000 + '"}'}, "more than"),
])
def test_a_malformed_annotation_fails_create_in_one_short_line(lab, annotations, why):
    bundle = lab.bundle("b", annotated(**annotations))
    log = lab.base / "runc.log"
    r = lab.shim("--log", str(log), "--log-format", "json", "create", "-b", str(bundle), "c3")
    assert r.returncode == 1 and one_line(r.stderr) and why in r.stderr, r.stderr[:500]
    assert len(r.stderr) < 1000  # echoed values are cut short
    assert lab.runc_argv() is None  # runc never ran: nothing started
    line = json.loads(log.read_text().splitlines()[-1])
    assert line["level"] == "error" and why in line["msg"]
    assert not record_of(lab, "c3").exists()


def test_the_shim_never_ends_in_a_traceback(lab):
    # No fallback, and the receipt cannot be written (the home's parent is a file): an OSError deep in the flow.
    bundle = lab.bundle("b", annotated(**{mt.ANNOTATION_POLICY: '{"fallback_to_cold": false}'}))
    (lab.base / "h1").mkdir()
    (lab.base / "h1" / "h2").write_text("a file where the home's parent directory should be")
    log = lab.base / "runc.log"
    r = lab.shim("--log", str(log), "create", "-b", str(bundle), "c4")
    assert r.returncode == 1 and one_line(r.stderr), r.stderr
    assert r.stderr.startswith("coldsnap-runtime: ") and lab.runc_argv() is None
    assert 'level=error msg="coldsnap-runtime: ' in log.read_text()  # runc's text log format


@pytest.mark.parametrize("doc,why", [
    (b'{"format":1,"operation":"capture","operation":"status"}', "duplicate key 'operation'"),
    (b'{"format":true,"operation":"status"}', "format"),
    (b'{"format":1,"operation":"capture","validation":{"ready_timeout_s":NaN}}', "NaN"),
    (b'{"format":1,"operation":"capture","validation":{"ready_timeout_s":Infinity}}', "Infinity"),
    (b'{"format":1,"operation":"capture","validation":{"max_tokens":1e400}}', "out of range"),
    (b'{"format":1,"operation":"capture","policy":{"fallback_to_cold":"no"}}', "policy.fallback_to_cold"),
    (b'{"format":1,"operation":"capture","validation":{"max_tokens":' + b"9" * 5000 + b"}}", "digits"),
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b'{"format":1,"operation":"' + b"x" * 100_000 + b'"}', "operation"),
    (b" " * (2 << 20), "bytes"),
])
def test_strict_requests_are_refused_with_exit_2_and_one_short_line(lab, doc, why):
    r = lab.cli("validate-request", "-", stdin=doc)
    err = r.stderr.decode()
    assert r.returncode == 2 and one_line(err) and why in err and len(err) < 600, err[:600]


def test_references_malformed_mismatched_or_not_a_capsule(lab):
    home = lab.base / "h1" / "h2" / "home"
    blobs = home / "store" / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    layer = os.urandom(4096)
    layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    (blobs / layer_digest.split(":")[1]).write_bytes(layer)
    cases = {
        "sha256:" + "a" * 63: 2, "sha256:" + "A" * 64: 2, "sha512:" + "a" * 128: 2, "SHA256:" + "a" * 64: 2,
        "../x@" + layer_digest: 2,
        layer_digest: 4,  # a blob, not a capsule manifest
        "other@" + layer_digest: 3,  # the name does not tag it
        "sha256:" + "0" * 64: 3,
        "tag-only": 4,  # not pinned
    }
    for ref, code in cases.items():
        for cmd in (["inspect", ref], ["restore", "--capsule", ref, "--no-fallback"]):
            r = lab.cli(*cmd)
            err = r.stderr.decode()
            assert r.returncode == code and one_line(err), (cmd, r.returncode, err)


HOOK = str(Path(sys.prefix) / "bin" / "coldsnap-hook")


@pytest.mark.parametrize("stdin,code", [
    (b"not json", 2), (b"[]", 2), (b'{"id": 7}', 2), (b'{"id": "c", "id": "d"}', 2), (b"[" * 50_000, 2),
    (b'{"id": "c", "pid": "12"}', 2), (b"\xff", 2),
    (b'{"id": "../../../etc"}', 0), (b'{"id": "x/y", "pid": 1}', 0),  # ids runc refuses: not ours, untouched
])
@pytest.mark.parametrize("stage", ["poststart", "poststop", "createRuntime"])
def test_hooks_read_the_state_strictly_and_answer_in_one_line(lab, stage, stdin, code):
    r = subprocess.run([HOOK, stage], input=stdin, capture_output=True, timeout=60,
                       env={"PATH": os.environ["PATH"], "COLDSNAP_RUN": str(lab.base / "run")})
    assert r.returncode == code, r.stderr
    assert (r.stderr == b"") if code == 0 else one_line(r.stderr.decode())
    assert not (lab.base / "run").exists()
