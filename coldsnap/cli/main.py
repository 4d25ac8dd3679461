"""`coldsnap`: the command-line entry point. Parses arguments, calls one flow, prints the result.
Errors become one line on stderr and a stable exit code (see contracts/errors.py); never a traceback."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from coldsnap import __version__
from coldsnap.base.paths import settings
from coldsnap.cli.show import Shown
from coldsnap.contracts import ENGINE_NAMES, EXIT_CODES, SCHEMAS, ColdSnapError, ErrorCode, parse_request
from coldsnap.contracts.parse import MAX_BYTES, short
from coldsnap.contracts.results import CaptureFacts, RestoreFacts, SleepFacts, WakeFacts


def _epilog() -> str:
    codes: dict[int, list[str]] = {}
    for code, status in EXIT_CODES.items():
        codes.setdefault(status, []).append(code.value)
    table = ", ".join(f"{status} {'/'.join(names)}" for status, names in sorted(codes.items()))
    return (f"exit codes: 0 ok, {table}.\nPaths: COLDSNAP_HOME (/var/lib/coldsnap), COLDSNAP_STORE, "
            "COLDSNAP_RUN (/run/coldsnap), COLDSNAP_RECEIPTS, COLDSNAP_CRIU_PREFIX, COLDSNAP_CRIU; every setting: "
            "docs/settings.md.")


def _progress(args) -> Shown:
    """The invocation's one progress display (coldsnap.cli.show): lines, or live bars on a terminal."""
    if getattr(args, "shown", None) is None:
        args.shown = Shown(quiet=getattr(args, "json", False))
    return args.shown


def _emit(args, data: Any, human: str | None = None) -> None:
    """data (a dict or a contract model) as JSON with --json (or when there is no human form), else the human line."""
    if getattr(args, "json", False) or human is None:
        if hasattr(data, "model_dump"):
            data = data.model_dump(mode="json")
        print(json.dumps(data, indent=1, sort_keys=True))
    else:
        print(human)


def _one_line(text: str, limit: int = 2000) -> str:
    """An error as one line of bounded length, whatever input it quotes."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"


def _receipt_line(receipt) -> str:
    from coldsnap.flows.receipts import receipt_path

    return f"receipt {receipt_path(receipt.operation_id)}"


def _read_request(path: str, *operations: str) -> Any:
    """The request document at path (- for stdin); with operations, one of those."""
    try:
        if path == "-":
            raw = sys.stdin.buffer.read(MAX_BYTES + 1)
        else:
            with open(path, "rb") as f:
                raw = f.read(MAX_BYTES + 1)  # a bigger document is refused without reading all of it
    except OSError as e:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"cannot read request {short(path)}: {e.strerror}") from None
    req = parse_request(raw)
    if operations and req.operation not in operations:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"operation: expected {operations[0]}, got {req.operation}")
    return req


# --- commands ----------------------------------------------------------------------------------------------------
def cmd_schema(args) -> None:
    if args.name:
        if args.name not in SCHEMAS:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"no schema {args.name!r}; one of: {', '.join(SCHEMAS)}")
        print(json.dumps(SCHEMAS[args.name].model_json_schema(), indent=1))
    else:
        print(json.dumps({name: m.model_json_schema() for name, m in SCHEMAS.items()}, indent=1))


def cmd_validate_request(args) -> None:
    req = _read_request(args.file)
    _emit(args, {"valid": True, "operation": req.operation}, f"valid {req.operation} request")


def cmd_doctor(args) -> int:
    from coldsnap.host.doctor import doctor_json, render_table, run_doctor

    checks = run_doctor()
    data = doctor_json(checks)
    _emit(args, data, render_table(checks))
    return 0 if data["ok"] else EXIT_CODES[ErrorCode.ENVIRONMENT]


def cmd_capabilities(args) -> None:
    from coldsnap.host.capabilities import capabilities

    print(capabilities().model_dump_json(indent=1))


def _capture_request(args):
    from coldsnap.contracts import CaptureRequest

    req = _read_request(args.request, "capture") if args.request else CaptureRequest(operation="capture")

    def given(**values: Any) -> dict[str, Any]:  # the flags given override the request's fields
        return {k: v for k, v in values.items() if v}

    data = req.model_dump()
    options = {**req.engine.options, **engine_options(args.engine_opt)} if args.engine_opt else None
    data["engine"].update(given(name=args.engine, options=options))
    data.update(given(tag=args.tag, snapshot_driver=args.snapshot_driver))
    data["policy"].update(given(weights_mode=args.weights_mode))
    data["lifecycle"].update(given(leave_running=args.leave_running, name=args.name))
    if args.device:
        data["launch"]["devices"] = [] if args.device == "cpu" else [args.device]
    with _flags_checked():
        return type(req).model_validate(data)  # validates the combination


@contextmanager
def _flags_checked() -> Iterator[None]:
    """A request built from flags is refused like one read from a file: one line naming the field, exit 2."""
    from pydantic import ValidationError

    from coldsnap.contracts.parse import first_error

    try:
        yield
    except ValidationError as e:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, first_error(e)) from None


def engine_options(pairs: list[str] | None) -> dict:
    """--engine-opt KEY=VALUE (repeatable) → typed engine options (ints, floats, true/false stay typed)."""
    out: dict = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"--engine-opt {pair!r}: expected KEY=VALUE")
        key, value = pair.split("=", 1)
        for conv in (int, float):
            try:
                out[key] = conv(value)
                break
            except ValueError:
                continue
        else:
            out[key] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def cmd_capture(args) -> None:
    if args.container:
        from coldsnap.flows.container_capture import capture_container

        res = capture_container(args.container, args.runc_root, args.bundle, engine=args.engine or "reference",
                                image_digest=args.image_digest, image=args.image, port=args.port,
                                weights_mode=args.weights_mode or "native",
                                leave_running=args.leave_running, tag=args.tag, quiesce=args.quiesce or "drain",
                                progress=_progress(args))
    else:
        from coldsnap.flows.capture import capture

        req = _capture_request(args)
        if args.quiesce == "none" or req.policy.quiesce != "drain":
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, "quiesce none (capture with requests in flight) applies "
                                "to a container capture only (--container ID)")
        res = capture(req, progress=_progress(args))
    r = res.receipt
    facts = r.facts(CaptureFacts)
    _emit(args, r, f"captured {facts.capsule} ({facts.capsule_bytes / 2**20:.1f} MiB); {_receipt_line(r)}")


def cmd_restore(args) -> None:
    from coldsnap.contracts import Lifecycle, Policy, RestoreRequest
    from coldsnap.flows.restore import restore

    if args.request:
        req = _read_request(args.request, "restore", "prepare")
    else:
        if not args.capsule:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, "restore needs --capsule REF (or --request FILE)")
        gpu_map = dict(pair.split("=", 1) for pair in (args.gpu_map or []) if "=" in pair)
        if len(gpu_map) != len(args.gpu_map or []):
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--gpu-map expects CAPTURED_UUID=LOCAL_UUID")
        with _flags_checked():
            req = RestoreRequest(
                operation="prepare" if args.prepare_only else "restore", capsule=args.capsule,
                insecure_registry=args.insecure, gpu_map=gpu_map, lifecycle=Lifecycle(name=args.name),
                policy=Policy(fallback_to_cold=not args.no_fallback, allow_unpinned=args.allow_unpinned,
                              compatibility="relaxed" if args.relaxed else "strict"))
    r = restore(req, progress=_progress(args))
    res = r.facts(RestoreFacts)
    if r.state == "fell-back":
        human = f"fell back to a cold start ({res.fallback_reason}); serving at {res.url}"
    elif r.operation == "prepare":
        human = f"prepared {res.capsule} (admitted, verified, staged)"
    else:
        human = f"restored {res.workload} at {res.url}: first token {res.time_to_first_token_s:.3f} s"
    _emit(args, r, f"{human}; {_receipt_line(r)}")


def cmd_status(args) -> None:
    from coldsnap.base.procfs import alive
    from coldsnap.workload.state import list_states

    rows = []
    for ws in list_states():
        if args.name and ws.name != args.name:
            continue
        state = ws.state if alive(ws.pid) else "dead"
        rows.append({"name": ws.name, "state": state, "origin": ws.origin, "pid": ws.pid, "url": ws.url,
                     "capsule": ws.capsule, "engine": ws.engine or None, "weights_mode": ws.weights_mode or None,
                     "sleep_mode": ws.sleep_mode if state == "sleeping" else None})
    if args.name and not rows:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"no workload named {args.name!r} on this host")
    def line(r: dict) -> str:
        state = r["state"] + (f" ({r['sleep_mode']})" if r["sleep_mode"] else "")
        return f"{r['name']:<24} {state:<18} {r['origin']:<9} pid {r['pid']:<8} {r['url']}"

    human = "\n".join(line(r) for r in rows) or "no workloads"
    _emit(args, {"workloads": rows, "recovered": args.recovered}, human)


def cmd_stop(args) -> None:
    from coldsnap.workload.process import stop_workload
    from coldsnap.workload.state import load_state

    ws = load_state(args.name)
    stop_workload(ws)
    _emit(args, {"stopped": ws.name}, f"stopped {ws.name}")


def cmd_sleep(args) -> None:
    from coldsnap.contracts import WorkloadRequest
    from coldsnap.flows.lifecycle import sleep

    with _flags_checked():
        req = WorkloadRequest(operation="sleep", workload=args.name, sleep_mode=args.mode)
    r = sleep(req, progress=_progress(args))
    _emit(args, r, f"{args.name} is sleeping ({r.facts(SleepFacts).mode}: GPU memory released); "
                   f"{_receipt_line(r)}")


def cmd_wake(args) -> None:
    from coldsnap.contracts import WorkloadRequest
    from coldsnap.flows.lifecycle import wake

    with _flags_checked():
        req = WorkloadRequest(operation="wake", workload=args.name)
    r = wake(req, progress=_progress(args))
    _emit(args, r, f"{args.name} is awake: first token {r.facts(WakeFacts).time_to_first_token_s:.3f} s; "
                   f"{_receipt_line(r)}")


def _store():
    from coldsnap.capsule import CapsuleStore

    return CapsuleStore(settings().store).init()


def cmd_runtime(args) -> None:
    from coldsnap.host.runtimes import configure

    r = configure(args.runtime, dry_run=args.dry_run, set_default=args.set_default, config=args.config,
                  runtime_path=args.runtime_path, runtime_class_path=args.runtime_class,
                  out=(lambda m: None) if args.json else print)
    if args.json:
        print(json.dumps(vars(r), default=str, indent=1))


def cmd_ls(args) -> None:
    from coldsnap.capsule.gc import list_capsules

    rows = list_capsules(_store())
    human = "\n".join(f"{r['digest']}  {r.get('tag') or '-':<28} {r.get('engine') or '-':<10} "
                       f"{(r.get('size') or 0) / 2**20:9.1f} MiB  staged {r['staged_bytes'] / 2**20:8.1f} MiB  "
                       f"{r.get('created') or ''}" for r in rows)
    _emit(args, {"capsules": rows}, human or "no capsules")


def cmd_rm(args) -> None:
    from coldsnap.capsule.gc import remove

    removed = remove(_store(), args.ref)
    _emit(args, {"removed": removed}, f"removed {', '.join(removed)} from the index (blobs go at the next gc)")


def cmd_gc(args) -> None:
    from coldsnap.capsule.gc import gc

    r = {**gc(_store(), grace_s=args.grace, code_dir=settings().code), "recovered": args.recovered}
    _emit(args, r, f"freed {r['freed_bytes'] / 2**20:.1f} MiB ({len(r['removed_blobs'])} blobs, "
                   f"{r['code_removed']} CUDA code files)")


def cmd_push(args) -> None:
    from coldsnap.capsule.registry import push

    store = _store()
    digest = store.resolve(args.capsule, allow_unpinned=args.allow_unpinned)
    r = push(store, digest, args.ref, insecure=args.insecure, progress=_progress(args).transfer)
    _progress(args)(f"pushed {r['bytes_transferred'] / 2**20:.1f} MiB in {r['seconds']:.1f} s")
    _emit(args, r, f"pushed {r['ref']}")


def cmd_pull(args) -> None:
    from coldsnap.capsule.registry import pull

    r = pull(_store(), args.ref, insecure=args.insecure, allow_unpinned=args.allow_unpinned,
             progress=_progress(args).transfer)
    data = {"digest": str(r), "bytes_transferred": r.bytes_transferred, "payload_bytes": r.payload_bytes,
            "blobs_fetched": r.blobs_fetched, "resumed_bytes": r.resumed_bytes, "seconds": r.seconds, "tag": r.tag,
            "template": r.template}
    with_template = bool(r.template and r.template["pulled"])
    if r.template and not with_template:
        _progress(args)(f"its template {r.template['digest']} is not in the registry: a restore that refuses "
                        "this capsule will start cold")
    _emit(args, data, f"pulled {r} ({r.bytes_transferred / 2**20:.1f} MiB moved, "
                      f"{len(r.blobs_present)} blobs already here{', with its template' if with_template else ''})")


SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL|AUTH", re.I)


def cmd_inspect(args) -> None:
    from coldsnap.capsule import CapsuleStore, trust
    from coldsnap.host.run_args import ENGINES, run_args
    from coldsnap.host.runtimes import default_runtime_path

    store = CapsuleStore(settings().store)
    cap = store.load(store.resolve(args.ref, allow_unpinned=args.allow_unpinned))
    out = {"digest": cap.digest, "manifest": cap.manifest,
           "profile": cap.profile.model_dump(mode="json", exclude={"launch": {"env"}})}
    out["secret_like_env"] = [n for n in cap.env_names if SECRET_NAME.search(n)]
    if out["secret_like_env"]:  # their values are in the capsule's memory images: whoever restores it has them
        print(f"coldsnap: warning: environment variables that look like credentials travelled in this capsule "
              f"(their values are in its processes' memory): {', '.join(out['secret_like_env'])}", file=sys.stderr)
    verdict = trust.check(cap, store)
    prov = verdict.provenance
    out["trust"] = {"provenance": prov.origin if prov else None, "remote": prov.remote if prov else None,
                    "signed_by": verdict.signed_by, "refusal": verdict.refusal}
    if cap.profile.container is not None:  # how to restore it, as `coldsnap run-args` prints it
        out["run_args"] = {e: run_args(cap.profile, cap.digest, e, default_runtime_path()).line() for e in ENGINES}
    print(json.dumps(out, indent=1))


def cmd_run_args(args) -> None:
    from coldsnap.capsule import CapsuleStore
    from coldsnap.host.run_args import run_args
    from coldsnap.host.runtimes import default_runtime_path

    store = CapsuleStore(settings().store)
    digest = store.resolve(args.capsule, allow_unpinned=args.allow_unpinned)
    r = run_args(store.load(digest).profile, digest, args.engine, args.runtime_path or default_runtime_path(),
                 name=args.name, image=args.image)
    for note in r.notes:
        _progress(args)(f"note: {note}")
    _emit(args, {"engine": r.engine, "argv": r.argv, "command": r.line(), "notes": r.notes}, r.line())


def _arms(args) -> list[tuple[str, dict[str, str]]]:
    """--arm, each parsed (coldsnap_bench.coldnode.parse_arm); refused in one line unless with --cold-node, or
    where two share a name."""
    if not args.arm:
        return []
    if not args.cold_node:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--arm applies to --cold-node only")
    from coldsnap.base.paths import VARIABLES
    from coldsnap_bench.coldnode import parse_arm

    arms = [parse_arm(a, {v.name for v in VARIABLES}) for a in args.arm]
    names = [name for name, _ in arms]
    if len(set(names)) != len(names):
        twice = sorted(n for n in names if names.count(n) > 1)[0]
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"--arm: two arms named {twice!r}")
    return arms


def cmd_bench(args) -> None:
    progress = _progress(args)
    if args.registry:
        from coldsnap_bench.registry import run

        progress(f"registry benchmark: a {args.size_mib} MiB capsule through a local registry vs curl")
        data = run(args.out, size_mib=args.size_mib, repeats=args.samples)
        s = data["summary"]
        _emit(args, data, f"push {s['push_MB_s']} MB/s ({s['push_vs_curl']}x curl PUT), pull {s['pull_MB_s']} MB/s "
                          f"({s['pull_vs_curl_file_fsynced']}x curl to a synced file, {s['pull_vs_curl_devnull']}x "
                          f"curl to /dev/null), peak RSS {s['peak_rss_mib_push']}/{s['peak_rss_mib_pull']} MiB; "
                          f"wrote {args.out}/registry_bench.json and .png")
        return
    from coldsnap_bench.run import BenchOptions, run_bench

    if args.deadline_s is not None and not args.cold_node:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--deadline-s applies to --cold-node only")
    if args.deadline_s is not None and args.deadline_s <= 0:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--deadline-s must be a positive number of seconds")
    arms = _arms(args)
    opts = BenchOptions(
        engine=args.engine, samples=args.samples, vanilla_samples=args.vanilla_samples, device=args.device,
        weights_mode=args.weights_mode, engine_options=engine_options(args.engine_opt), out=args.out,
        name=args.name, drop_caches=args.drop_caches, via=args.via, template=args.template,
        deadline_s=args.deadline_s, arms=arms, command="coldsnap " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    if args.passthrough:
        from coldsnap_bench.passthrough import run_passthrough

        result = run_passthrough(opts, reps=args.samples if args.samples != 5 else 20, progress=progress)
    elif args.cold_node:
        from coldsnap_bench.coldnode import run_cold_node

        result = run_cold_node(opts, progress=progress)
    elif args.replicas:
        from coldsnap_bench.replicas import run_replicas

        result = run_replicas(opts, args.replicas, progress=progress)
    elif opts.via == "sparkrun":
        from coldsnap_bench.sparkrun import run_sparkrun_bench

        result = run_sparkrun_bench(opts, progress=progress)
    elif opts.via == "cri":
        from coldsnap_bench.pods import run_pods_bench

        result = run_pods_bench(opts, progress=progress)
    elif opts.via:
        from coldsnap_bench.via import run_via_bench

        result = run_via_bench(opts, progress=progress)
    else:
        result = run_bench(opts, progress=progress)
    _emit(args, result.data, result.summary)


def cmd_demo(args) -> None:
    from coldsnap_bench.run import BenchOptions, run_bench

    opts = BenchOptions(engine="reference", device="cpu", weights_mode="auto", samples=args.samples,
                        out=args.out or str(settings().home / "demo"), command="coldsnap demo")
    progress = _progress(args)
    progress("demo: the embedded reference engine on CPU, started cold and restored from a capsule, side by side")
    result = run_bench(opts, progress=progress)
    _emit(args, result.data, result.summary)


# --- parser ------------------------------------------------------------------------------------------------------
ALWAYS_JSON = "accepted for symmetry; output is always JSON"
PINNED = "accept a tag instead of a digest"
LOCAL_REGISTRY = "plain HTTP (a local registry)"
WEIGHTS_MODES = ["native", "recovery", "auto"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="coldsnap",
        description="Capture an initialized inference server once (CRIU + CUDA checkpoint) and restore it instead "
                    "of cold-starting: admit → stage → restore → hydrate → validate → receipt.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"coldsnap {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    json_flags: list[tuple[argparse.ArgumentParser, str | None]] = []

    def add(name, fn, help_, json_help=None):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(fn=fn)
        json_flags.append((sp, json_help))
        return sp

    def flag(sp, name, help_=None):
        sp.add_argument(name, action="store_true", help=help_)

    sp = add("schema", cmd_schema, "print the JSON Schema of a contract (all when NAME is omitted)", ALWAYS_JSON)
    sp.add_argument("name", nargs="?", help=f"one of: {', '.join(SCHEMAS)}")
    sp = add("validate-request", cmd_validate_request, "check a request document; prints `valid OPERATION` (--json: "
             "{valid, operation}), or exits 2 with the field at fault")
    sp.add_argument("file", help="request file, or - for standard input")
    add("doctor", cmd_doctor, "check this host (CRIU, pycriu, runtimes, cgroups, capabilities, GPUs); prints one row "
        "per check with a fix for each that fails (--json: the checks); exits 12 when one fails",
        json_help="machine-readable output")
    add("capabilities", cmd_capabilities, "print what this ColdSnap supports and what it is qualified for, each claim "
        "with its result file (JSON)", ALWAYS_JSON)

    sp = add("capture", cmd_capture, "start a workload (or take a running container), validate it, capture it into a "
             "capsule; prints the capsule digest and the receipt's path (--json: the receipt, also on failure)",
             json_help="print the receipt as JSON, no progress")
    sp.add_argument("--request", help="capture request file (JSON), or - for stdin")
    sp.add_argument("--engine", choices=ENGINE_NAMES, help="engine (default: reference)")
    sp.add_argument("--tag", help="name the capsule in the local store")
    sp.add_argument("--name", help="workload name (default: ENGINE-xxxxxx)")
    sp.add_argument("--weights-mode", choices=WEIGHTS_MODES,
                    help="recovery: the engine drops its weights and reloads them from the pinned file after restore; "
                    "native: the weights travel with the capsule (saved by the engine as a payload beside the images "
                    "where it can, else inside them); auto (default; native with --container): recovery when the "
                    "engine supports it")
    sp.add_argument("--device", help="cpu (default) or cuda / cuda:N")
    flag(sp, "--leave-running", "keep the captured workload running")
    sp.add_argument("--snapshot-driver", choices=["full", "template", "both"],
                    help="full (default): the serving workload with its device state (CUDA through the driver's "
                    "checkpoint API); template: the engine before it touches its device, which rebuilds its device "
                    "state at restore (for GPUs and drivers that cannot checkpoint CUDA; reference engine only); "
                    "both: a template, then a full capsule naming it (a restore refused the full one falls to it)")
    sp.add_argument("--engine-opt", action="append", metavar="KEY=VALUE",
                    help="engine option, repeatable (reference: layers, hidden, heads, kv_mib, compile=false, "
                    "tensor_parallel=N for N ranks on N GPUs (gloo on CPU) captured as one unit, ...)")
    sp.add_argument("--container", metavar="ID", help="capture a running runc container instead (runc checkpoint)")
    sp.add_argument("--runc-root", default="/run/runc", help="runc --root of that container (podman: /run/runc; "
                    "docker: <exec-root>/runtime-runc/moby; containerd: /run/containerd/runc/<namespace>)")
    sp.add_argument("--bundle", help="the container's bundle (default: from runc state)")
    sp.add_argument("--image-digest", help="bind the capsule to this image digest (sha256:…)")
    sp.add_argument("--image", help="with --container: the image it runs, as its engine names it (for run-args)")
    sp.add_argument("--port", type=int, help="with --container: the port its server listens on (default: the "
                    "io.coldsnap.validation annotation's, else 8000)")
    sp.add_argument("--quiesce", choices=["drain", "none"],
                    help="with --container: drain (default) waits until no client is connected; none captures with "
                    "requests in flight (their connections travel in the capsule; the network namespace stays locked "
                    "until the restore)")

    sp = add("restore", cmd_restore, "restore a workload from a capsule (or start it cold when refused, unless "
             "--no-fallback); prints where it serves and the receipt's path (--json: the receipt, also on failure)")
    sp.add_argument("--capsule", help="capsule reference pinned by digest: sha256:… or NAME@sha256:…; or a registry "
                    "reference HOST[:PORT]/REPO@sha256:…, pulled unless the store has it (its images unpack while "
                    "its weights arrive)")
    flag(sp, "--insecure", "pull a registry reference over plain HTTP")
    sp.add_argument("--request", help="restore request file (JSON)")
    sp.add_argument("--name", help="the restored workload's name (default: the captured one's); each restore of a "
                    "capsule under its own name runs beside the others, on a network of its own")
    flag(sp, "--prepare-only", "admit, verify and stage only; touch no workload")
    flag(sp, "--no-fallback", "fail instead of starting cold")
    flag(sp, "--allow-unpinned", PINNED)
    flag(sp, "--relaxed", "relaxed compatibility (only what breaks a restore)")
    sp.add_argument("--gpu-map", action="append", metavar="CAPTURED=HERE",
                    help="restore onto another GPU of the same kind: GPU UUID pairs (repeatable)")

    sp = add("status", cmd_status, "list the workloads on this host, active or sleeping, after cleaning up what "
             "interrupted operations left; prints one row each (--json: {workloads, recovered})")
    sp.add_argument("name", nargs="?")
    sp = add("stop", cmd_stop, "stop a workload: its processes, network namespace and state; prints `stopped NAME` "
             "(--json: {stopped})")
    sp.add_argument("name")
    sp = add("runtime", cmd_runtime, "register coldsnap-runtime with docker, containerd (+ a Kubernetes "
             "RuntimeClass) or podman, keeping existing settings")
    sp.add_argument("action", choices=["configure"])
    sp.add_argument("--runtime", required=True, choices=["docker", "containerd", "podman"])
    flag(sp, "--dry-run", "print the diff, write nothing")
    flag(sp, "--set-default",
         "make coldsnap the default runtime: unannotated containers still run exactly as with runc")
    sp.add_argument("--config", help="configuration file to edit (default: the engine's usual path)")
    sp.add_argument("--runtime-path", help="path of coldsnap-runtime (default: the installed one)")
    sp.add_argument("--runtime-class", help="containerd: where to write the RuntimeClass manifest")
    sp = add("sleep", cmd_sleep, "release a workload's GPU memory in place (CUDA checkpoint), its process kept; "
             "prints the mode and the receipt's path (--json: the receipt)")
    sp.add_argument("--mode", choices=("auto", "engine", "cuda"), default="auto",
                    help="engine: the engine drops its weights and KV first and reloads them at wake (recovery "
                    "weights); cuda: all GPU memory moves to host memory and back; auto (default): engine when it can")
    sp.add_argument("name")
    sp = add("wake", cmd_wake, "bring a sleeping workload's GPU state back and validate it; prints the time to its "
             "first token and the receipt's path (--json: the receipt)")
    sp.add_argument("name")
    add("ls", cmd_ls, "list the capsules in the local store: digest, tag, engine, size, staged bytes, created "
        "(--json: {capsules})")
    sp = add("rm", cmd_rm, "remove a capsule from the local index and its staged images (blobs go at the next gc); "
             "prints the digests untagged (--json: {removed})")
    sp.add_argument("ref")
    sp = add("gc", cmd_gc, "delete blobs no capsule references, staged images of capsules gone or beyond the staging "
             "cap, and CUDA code files (coldsnap.gpu.codestash) no capsule lists and no process maps")
    sp.add_argument("--grace", type=float, default=600,
                    help="keep unreferenced blobs and code files younger than this (s)")
    sp = add("push", cmd_push, "push a capsule (and its weights payload) to an OCI registry; prints the reference "
             "pushed (--json: what moved)")
    sp.add_argument("capsule", help="local capsule: sha256:… or NAME@sha256:…")
    sp.add_argument("ref", help="HOST[:PORT]/REPO:TAG")
    flag(sp, "--insecure", LOCAL_REGISTRY)
    flag(sp, "--allow-unpinned")
    sp = add("pull", cmd_pull, "pull a capsule (only missing blobs; resumes interrupted pulls); prints its digest and "
             "what moved (--json: the same)")
    sp.add_argument("ref", help="HOST[:PORT]/REPO@sha256:… (or :TAG with --allow-unpinned)")
    flag(sp, "--insecure", LOCAL_REGISTRY)
    flag(sp, "--allow-unpinned")
    sp = add("inspect", cmd_inspect, "print a capsule's manifest and profile as JSON (environment values omitted)",
             ALWAYS_JSON)
    sp.add_argument("ref")
    flag(sp, "--allow-unpinned")

    sp = add("run-args", cmd_run_args, "print the podman, docker or ctr command that restores a container capsule "
             "(the captured container's binds, tmpfs, /dev/shm size, network, working directory and command)",
             json_help="print {engine, argv, command, notes} as JSON")
    sp.add_argument("capsule", help="a container capsule: sha256:… or NAME@sha256:…")
    sp.add_argument("--for", dest="engine", required=True, choices=["podman", "docker", "ctr"])
    sp.add_argument("--name", help="the restored container's name (ctr: its id)")
    sp.add_argument("--image", help="the image to run (default: the one the capture recorded)")
    sp.add_argument("--runtime-path", help="path of coldsnap-runtime (default: the installed one)")
    flag(sp, "--allow-unpinned", PINNED)

    sp = add("demo", cmd_demo, "capture the reference engine on CPU, restore it, and print cold vs restored side by "
             "side (--json: the result)")
    sp.add_argument("--samples", "-n", type=int, default=3)
    sp.add_argument("--out", help="where the JSON and PNG go (default: COLDSNAP_HOME/demo)")

    sp = add("bench", cmd_bench, "vanilla start vs restore, N samples each, against the same-run physical limit; "
             "writes JSON + PNG under --out and prints the table (--json: the result)",
             json_help="print the result JSON, no progress")
    sp.add_argument("--engine", default="reference", choices=ENGINE_NAMES)
    sp.add_argument("--samples", "-n", type=int, default=5,
                    help="restore samples (and vanilla, unless given); with --registry, transfers of each kind")
    sp.add_argument("--vanilla-samples", type=int, help="vanilla samples when they cost too much to match --samples")
    sp.add_argument("--device", default="cpu")
    sp.add_argument("--weights-mode", default="auto", choices=WEIGHTS_MODES)
    sp.add_argument("--out", default="bench/results", help="directory for the JSON and PNG")
    sp.add_argument("--engine-opt", action="append", metavar="KEY=VALUE", help="engine option, repeatable")
    sp.add_argument("--name", help="result file stem (default ENGINE-DEVICE-MODE)")
    flag(sp, "--drop-caches", "drop the page cache before every sample")
    sp.add_argument("--replicas", type=int, metavar="N", help="N restores of one capsule issued at once vs N vanilla "
                    "starts at once, for 1 … N (ENGINE-DEVICE-replicas)")
    flag(sp, "--template", "three ways in one run: vanilla, the restore of a template capsule (criu-template, "
         "captured with the full one) and of the full capsule")
    flag(sp, "--cold-node", "the first restore on a node that never saw the capsule: pull from a local registry + "
         "restore, from issue to first token, vs vanilla (ENGINE-DEVICE-cold-node)")
    sp.add_argument("--deadline-s", type=float, metavar="S", help="with --cold-node: take no further sample that "
                    "would not end within S seconds of the bench's start (at least one of each is taken), and write "
                    "the result of those taken: for a run that a time limit would otherwise cut off unwritten")
    sp.add_argument("--arm", action="append", metavar="NAME=[SETTING=VALUE,...]", help="with --cold-node, "
                    "repeatable: variants of the restore's settings side by side in one run (one capture, one "
                    "vanilla), each round restoring a node once per arm in turning order; NAME= alone: the defaults")
    flag(sp, "--passthrough", "what coldsnap-runtime adds to a runc call it passes through: runc vs coldsnap-runc vs "
         "the Python script, best of --samples (default 20) each")
    flag(sp, "--registry", "benchmark push/pull through a local registry instead")
    sp.add_argument("--size-mib", type=int, default=2048, help="capsule size for --registry")
    sp.add_argument("--via", choices=["podman", "docker", "cri", "sparkrun"], help=(
        "the engine in a container. podman|docker: `run` of the reference engine cold vs restored by "
        "coldsnap-runtime, plus its pass-through overhead (reference-VIA-cpu); cri: a pod through containerd's CRI "
        "plugin, StartContainer to first token (ENGINE-cri-cpu); sparkrun: `sparkrun run RECIPE` through "
        "ColdSnap's plugin to sparkrun's readiness (ENGINE-sparkrun-cpu); cri and sparkrun take --engine "
        "reference or vllm"))
    for sp, json_help in json_flags:  # every command takes --json, listed after its other options
        sp.add_argument("--json", action="store_true", help=json_help)
    return p


# Commands that look at or change this host's workloads, store or runtime state: before them, whatever killed
# operations left behind is cleaned up (coldsnap.flows.recovery).
RECOVERS = frozenset({"capture", "restore", "status", "stop", "sleep", "wake", "ls", "rm", "gc", "push", "pull",
                      "inspect", "demo", "bench"})


def _recover(args) -> list[str]:
    if args.command not in RECOVERS or os.geteuid() != 0:
        return []
    from coldsnap.flows.recovery import recover

    return recover(_progress(args))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    try:
        args.recovered = _recover(args)
        try:
            return args.fn(args) or 0  # a command returns its exit status only when that is not 0
        finally:
            if getattr(args, "shown", None) is not None:
                args.shown.close()
    except ColdSnapError as e:
        if e.receipt is not None and getattr(args, "json", False):  # a machine caller gets the receipt either way
            _emit(args, e.receipt)
        print(f"coldsnap: error: {_one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # e.g. `coldsnap schema | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("coldsnap: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug: still one line, with the traceback only on request
        if settings().debug:
            raise
        print(f"coldsnap: internal error: {type(e).__name__}: {_one_line(str(e), 500)} (set COLDSNAP_DEBUG=1 for a "
              "traceback)", file=sys.stderr)
        return EXIT_CODES[ErrorCode.INTERNAL]


if __name__ == "__main__":
    sys.exit(main())
