"""Contracts: every model round-trips, hashes are canonical, every rejection names its field."""

import json
import subprocess
import sys

import pytest

from coldsnap.contracts import (
    SCHEMAS,
    Capabilities,
    CapsuleProfile,
    CaptureRequest,
    ColdSnapError,
    ErrorCode,
    HostProfile,
    NetworkPlan,
    Receipt,
    RestoreRequest,
    WorkloadRequest,
    canonical_json,
    parse_request,
    sha256_hex,
)

DIGEST = "a" * 64
CAPTURE = {
    "format": 1,
    "operation": "capture",
    "id": "op-1",
    "engine": {"name": "reference", "version": "0.1", "options": {"layers": 4}},
    "model": {"id": "m", "revision": "r1", "weights": [{"path": "/w/model.safetensors", "sha256": DIGEST, "size": 3}]},
    "launch": {"env": {"A": "1"}, "devices": [], "port": 8000, "mounts": [{"source": "/a", "target": "/b"}]},
    "policy": {"weights_mode": "recovery", "kv_discard": True, "compatibility": "strict", "fallback_to_cold": True},
    "validation": {"prompt": "hi", "max_tokens": 4, "expected_text": "abc"},
    "lifecycle": {"leave_running": False, "name": "ref-1"},
    "tag": "demo",
}


def host():
    return HostProfile(arch="x86_64", cpu_model="cpu", cpu_flags=["sse"], kernel="6.18", criu_version="4.2.1")


def profile():
    return CapsuleProfile(
        created="2026-11-29T00:00:00Z", snapshot_driver="criu-process", host=host(),
        engine={"name": "reference"}, weights_mode="recovery", kv_discarded=True, launch={"command": ["x"]},
        validation={"prompt": "p"}, expected_text="t",
        network=NetworkPlan(netns="coldsnap-a", host_veth="csh0", workload_veth="eth0", host_address="169.254.237.1",
                            workload_address="169.254.237.2", port=8000),
    )


@pytest.mark.parametrize("doc", [
    CAPTURE,
    {"format": 1, "operation": "restore", "capsule": "sha256:" + DIGEST},
    {"format": 1, "operation": "prepare", "capsule": "name@sha256:" + DIGEST, "policy": {"allow_unpinned": False}},
    {"format": 1, "operation": "sleep", "workload": "w"},
    {"format": 1, "operation": "wake", "workload": "w"},
    {"format": 1, "operation": "status"},
    {"format": 1, "operation": "stop", "workload": "w"},
])
def test_requests_round_trip(doc):
    req = parse_request(json.dumps(doc))
    again = parse_request(req.model_dump_json())
    assert again == req
    assert req.operation == doc["operation"]


def test_models_round_trip():
    for model in (profile(), host(),
                  Receipt(operation="capture", operation_id="x", request_sha256=DIGEST, state="succeeded",
                          origin={"wall_time": "2026-11-29T00:00:00Z", "monotonic_s": 1.0},
                          spans=[{"name": "dump", "start_s": 0.1, "duration_s": 0.2}],
                          error={"code": "criu-failed", "message": "m"}, coldsnap_version="0.1.0"),
                  Capabilities(coldsnap_version="0.1", request_formats=[1], receipt_formats=[1], capsule_formats=[1],
                               operations=["capture"], engines=["reference"], snapshot_drivers=["criu-process"],
                               weights_modes=["native"], results="/r", qualified=[])):
        assert type(model).model_validate_json(model.model_dump_json()) == model


def test_canonical_hash_is_stable_under_key_order():
    reordered = json.loads(json.dumps(CAPTURE), object_pairs_hook=lambda pairs: dict(reversed(pairs)))
    assert list(reordered) != list(CAPTURE)
    assert canonical_json(reordered) == canonical_json(CAPTURE)
    assert sha256_hex(reordered) == sha256_hex(CAPTURE)
    a = parse_request(json.dumps(CAPTURE))
    b = parse_request(json.dumps(reordered))
    assert sha256_hex(a) == sha256_hex(b)
    changed = dict(CAPTURE, tag="other")
    assert sha256_hex(changed) != sha256_hex(CAPTURE)
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == '{"a":[1,{"c":3,"d":2}],"b":1}'


def nested(path, value):
    doc = json.loads(json.dumps(CAPTURE))
    cur = doc
    for key in path[:-1]:
        cur = cur[key]
    cur[path[-1]] = value
    return doc


@pytest.mark.parametrize("doc,field", [
    ({"format": 1, "bogus": 1}, "bogus"),
    (dict(CAPTURE, extra=1), "extra"),
    (nested(["launch", "surprise"], 1), "launch.surprise"),
    (nested(["launch", "port"], "eighty"), "launch.port"),
    (nested(["launch", "port"], 70000), "launch.port"),
    (nested(["launch", "env"], {"1BAD": "x"}), "launch.env"),
    (nested(["launch", "image_digest"], "latest"), "launch.image_digest"),
    (nested(["model", "weights", 0, "sha256"], "xyz"), "model.weights.0.sha256"),
    (nested(["model", "weights", 0, "path"], "relative.safetensors"), "model.weights.0.path"),
    (nested(["model", "revision"], ""), "model.revision"),
    (nested(["policy", "weights_mode"], "magic"), "policy.weights_mode"),
    (nested(["validation", "max_tokens"], 0), "validation.max_tokens"),
    (nested(["engine", "name"], "tgi"), "engine.name"),
    (nested(["lifecycle", "name"], "Bad Name"), "lifecycle.name"),
    (dict(CAPTURE, format=2), "format"),
    ({"format": 1, "operation": "explode"}, "operation"),
    ({"format": 1}, "operation"),
    ({"format": 1, "operation": "restore"}, "capsule"),
    ({"format": 1, "operation": "sleep"}, "sleep needs a workload"),
])
def test_rejections_name_the_field(doc, field):
    with pytest.raises(ColdSnapError) as e:
        parse_request(json.dumps(doc))
    assert e.value.code == ErrorCode.INVALID_REQUEST
    assert field in e.value.message
    assert "\n" not in e.value.message


@pytest.mark.parametrize("text,needle", [
    ('{"format":1,"operation":"status"} {}', "Extra data"),
    ("[1,2]", "JSON object"),
    ("{", "not valid JSON"),
    ("", "not valid JSON"),
])
def test_rejects_malformed_documents(text, needle):
    with pytest.raises(ColdSnapError) as e:
        parse_request(text)
    assert needle in e.value.message


def test_receipt_rejects_unknown_state_and_bad_hash():
    base = dict(operation="capture", operation_id="x", request_sha256=DIGEST, state="succeeded",
                origin={"wall_time": "t", "monotonic_s": 0.0}, coldsnap_version="0")
    Receipt(**base)
    with pytest.raises(ValueError):
        Receipt(**dict(base, state="maybe"))
    with pytest.raises(ValueError):
        Receipt(**dict(base, request_sha256="abc"))
    with pytest.raises(ValueError):
        Receipt(**dict(base, surprise=1))


def test_a_receipt_result_is_the_model_of_its_operation():
    from coldsnap.contracts.results import RestoreFacts, WakeFacts

    base = dict(operation="wake", operation_id="x", request_sha256=DIGEST, state="succeeded",
                origin={"wall_time": "t", "monotonic_s": 0.0}, coldsnap_version="0")
    woke = {"workload": "w", "time_to_first_token_s": 0.25, "validated_text": "hi", "mode": "cuda",
            "engine_resume": {}}
    back = Receipt.model_validate_json(Receipt(**base, result=WakeFacts(**woke)).model_dump_json())
    assert isinstance(back.result, WakeFacts) and back.facts(WakeFacts).time_to_first_token_s == 0.25
    with pytest.raises(TypeError, match="no RestoreFacts"):
        back.facts(RestoreFacts)
    with pytest.raises(ValueError, match="time_to_first_tokn_s"):  # a misspelt key is an error, not a silent key
        Receipt.model_validate({**base, "result": {**woke, "time_to_first_tokn_s": 1.0}})
    # what an operation did not get to is left out of the JSON, not written as null
    restored = Receipt(**dict(base, operation="restore"), result=RestoreFacts(workload="w", started="cold"))
    assert json.loads(restored.model_dump_json())["result"] == {"workload": "w", "started": "cold"}
    with pytest.raises(ValueError):  # a capture's result needs its capsule
        Receipt.model_validate({**base, "operation": "capture", "result": {"tag": "t"}})


def test_profile_rejects_unknown_fields():
    data = json.loads(profile().model_dump_json())
    data["host"]["gpu_magic"] = True
    with pytest.raises(ValueError):
        CapsuleProfile.model_validate(data)


def test_types_per_operation():
    assert isinstance(parse_request(json.dumps(CAPTURE)), CaptureRequest)
    assert isinstance(parse_request('{"format":1,"operation":"prepare","capsule":"x"}'), RestoreRequest)
    assert isinstance(parse_request('{"format":1,"operation":"status"}'), WorkloadRequest)


def run_cli(*args, stdin=""):
    return subprocess.run([sys.executable, "-m", "coldsnap.cli", *args], input=stdin, capture_output=True, text=True)


def test_cli_validate_request_rejects_with_one_line_and_exit_2():
    r = run_cli("validate-request", "-", stdin='{"format":1,"bogus":1}')
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "bogus" in lines[0] and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv", [["capture", "--name", "BAD_NAME"], ["restore", "--capsule", "x", "--name", "B/x"]])
def test_a_bad_flag_value_is_a_bad_request_not_a_bug(argv, coldsnap_home):
    r = run_cli(*argv)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "name" in lines[0] and "internal" not in r.stderr, r.stderr


def test_cli_validate_request_accepts(tmp_path):
    f = tmp_path / "req.json"
    f.write_text(json.dumps(CAPTURE))
    r = run_cli("validate-request", str(f), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"valid": True, "operation": "capture"}
    r = run_cli("validate-request", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "cannot read request" in r.stderr


def test_cli_schema():
    r = run_cli("schema", "capture-request")
    assert r.returncode == 0
    schema = json.loads(r.stdout)
    assert schema["additionalProperties"] is False
    assert "launch" in schema["properties"]
    r = run_cli("schema")
    assert set(json.loads(r.stdout)) == set(SCHEMAS)
    r = run_cli("schema", "nope")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_cli_json_prints_the_receipt_of_a_failed_operation_too(coldsnap_home):
    r = run_cli("restore", "--capsule", "sha256:" + "0" * 64, "--json")
    assert r.returncode == 3
    receipt = Receipt.model_validate_json(r.stdout)  # the whole of stdout is the receipt
    assert receipt.state == "failed" and receipt.error.code == ErrorCode.CAPSULE_NOT_FOUND
    assert receipt.error.exit_code == 3
    assert (coldsnap_home / "receipts" / f"{receipt.operation_id}.json").exists()
    assert len(r.stderr.strip().splitlines()) == 1 and "capsule-not-found" in r.stderr
    r = run_cli("restore", "--capsule", "sha256:" + "0" * 64)  # without --json: the line only
    assert r.returncode == 3 and r.stdout == ""
