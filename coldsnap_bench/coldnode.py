"""`coldsnap bench --cold-node`: the first restore on a node that has never seen the capsule, against a vanilla start.

The capsule and its weights payload are pushed to a private registry on loopback (Debian's docker-registry, as in
the registry bench). Each sample is a fresh node: a ColdSnap home with an empty store, nothing staged, no memo of
checked digests, and no weights file at the pinned path; it trusts the capturing host's key through a policy file,
as a fleet would. Its clock runs from issuing `coldsnap restore --capsule REF@DIGEST` (one command as a user or a
node agent issues it: it pulls, unpacking the capsule's images while the weights arrive, then restores) to the first
token of its validated completion; the spans say where the time went (pull, admit, verify, weights put back and
checked, what was left to unpack, CRIU, the CUDA driver, the engine's resume, validate). Vanilla's clock runs from
issuing a cold start to its first token, its weights read from local disk (page cache warm).

The limit beside it is the bytes a first restore must move at rates measured in the same run: what it pulls at the
slower of the registry's own rate (a blob fetched over HTTP, as one stream and as parallel pieces, timed) and the node
storage's durable write rate (a pull keeps what it fetches; one writer and parallel ones), then the restore's limit
(bench.bandwidth).

Arms (`--arm NAME=[SETTING=VALUE,...]`, repeated): variants of the restore's settings side by side in one run,
one capture and one vanilla for all: each round restores a fresh node once per arm, the arms' order turning from one
round to the next, so that neither the machine's drift nor a first sample's warm-up favours one of them (in separate
benches the first on a fresh machine came out slowest each time). With arms the two-command baseline is not run.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from coldsnap.base.files import WriteBehind, private_dir
from coldsnap.base.paths import settings
from coldsnap.capsule import CapsuleStore, pieces
from coldsnap.capsule.payload import weight_layers
from coldsnap.capsule.registry import push
from coldsnap.capsule.signing import host_public_key_path
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.contracts.receipt import Receipt
from coldsnap.contracts.results import CaptureFacts, RestoreFacts
from coldsnap.engines import get_adapter
from coldsnap.flows.capture import capture
from coldsnap_bench import bandwidth
from coldsnap_bench.registry import LocalRegistry
from coldsnap_bench.run import (
    BenchOptions,
    BenchResult,
    _stats,
    _vanilla_once,
    capture_request,
    clock_parts,
    host_record,
)

# Where a first restore's time goes, in order: the pull, then the restore receipt's spans (staging's parts: verify
# the capsule's blobs, put back and check the weights, unpack the images; hydrate's: the CUDA driver's restore, then
# the engine's resume: weights, KV cache, CUDA graphs), then what lies outside them.
SPANS = ("pull", "admit", "verify", "weights", "unpack", "network", "criu-restore", "cuda driver", "engine resume",
         "validate", "process starts")
CLI = [sys.executable, "-m", "coldsnap.cli"]


def _node_env(node: Path) -> dict[str, str]:
    """A node that has the image (this ColdSnap, its CRIU) and nothing else, trusting the capturing host's key."""
    private_dir(node)
    policy = node / "policy.json"
    policy.write_text(json.dumps({"format": 1, "trust": [{"match": "*", "keys": [str(host_public_key_path())]}]}))
    env = {**os.environ, "COLDSNAP_HOME": str(node / "home"), "COLDSNAP_RUN": str(node / "run"),
           "COLDSNAP_CRIU_PREFIX": str(settings().criu_prefix), "COLDSNAP_POLICY_FILE": str(policy)}
    for name in ("COLDSNAP_STORE", "COLDSNAP_STAGED", "COLDSNAP_RECEIPTS"):
        env.pop(name, None)
    return env


def _cli(env: dict, *args: str, timeout: float = 900) -> dict:
    r = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise ColdSnapError(ErrorCode.VALIDATION_FAILED, f"coldsnap {args[0]} on the fresh node failed "
                            f"(exit {r.returncode}): {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout) if "--json" in args else {}


def parse_arm(text: str, known: set[str]) -> tuple[str, dict[str, str]]:
    """`NAME=` or `NAME=SETTING=VALUE[,SETTING=VALUE...]` as (name, settings); known: the settings' names it may set.
    Raises INVALID_REQUEST, in one line, for anything else."""
    name, eq, rest = text.partition("=")
    if not eq or not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"--arm {text!r}: want NAME=[SETTING=VALUE,...] (NAME of "
                            "letters, digits, - and _; nothing after = for the defaults)")
    settings_: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not eq or var not in known:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"--arm {name}: {item!r} is not SETTING=VALUE with "
                                "SETTING one of ColdSnap's settings (docs/settings.md)")
        settings_[var] = value
    return name, settings_


RATE_BYTES = 4 << 30  # enough of a blob to time the registry's rate; a 31 GB blob read twice would take a minute


def _read_range(url: str, start: int, length: int) -> int:
    got = 0
    req = urllib.request.Request(url, headers={"Range": f"bytes={start}-{start + length - 1}"})
    with urllib.request.urlopen(req, timeout=600) as r:
        while got < length and (data := r.read(8 << 20)):
            got += len(data)
    return got


def _timed_parallel(fn, spans: list[tuple[int, int]]) -> float:
    """GB/s of fn(start, length) over the spans, one thread each, all at once."""
    t = time.monotonic()
    with ThreadPoolExecutor(len(spans)) as pool:
        done = sum(pool.map(lambda sp: fn(*sp), spans))
    return done / (time.monotonic() - t) / 1e9


def _spans(size: int, n: int) -> list[tuple[int, int]]:
    step = -(-size // n)
    return [(o, min(step, size - o)) for o in range(0, size, step)]


def registry_rate(registry: str, repo: str, digest: str, size: int) -> float:
    """GB/s the registry serves (up to RATE_BYTES of) a blob, its storage in page cache as a nearby one's is: the
    better of one GET and of as many ranged GETs at once as a pull by pieces makes (coldsnap.capsule.pieces)."""
    url = f"http://{registry}/v2/{repo}/blobs/{digest}"
    size = min(size, RATE_BYTES)
    _read_range(url, 0, size)  # warms the registry's storage
    return max(_timed_parallel(lambda o, n: _read_range(url, o, n), _spans(size, 1)),
               _timed_parallel(lambda o, n: _read_range(url, o, n), _spans(size, pieces.workers())))


def storage_write_rate(directory: Path, size: int) -> float:
    """GB/s of writing `size` bytes (up to RATE_BYTES) to a new file in `directory` and making them durable
    (fsync), written back as they are written (coldsnap.base.files.WriteBehind), as a pull writes a blob: the
    better of one writer and as many writers at once as a pull by pieces has, in the same run."""
    size = max(64 << 20, min(size, RATE_BYTES))
    block = os.urandom(16 << 20)
    path = directory / f".write-rate.{os.getpid()}"

    def timed(writers: int) -> float:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            def write(start: int, length: int) -> int:
                behind = WriteBehind(fd, start)
                for at in range(start, start + length, len(block)):
                    behind.wrote(os.pwrite(fd, block[:min(len(block), start + length - at)], at))
                return length

            t = time.monotonic()
            _timed_parallel(write, _spans(size, writers))
            os.fsync(fd)
            return size / (time.monotonic() - t) / 1e9
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)

    return max(timed(1), timed(pieces.workers()))


AFTER_SAMPLES_S = 30  # what --deadline-s keeps for after the samples: the limit's measures, the JSON and chart


def run_cold_node(opts: BenchOptions, progress=lambda m: None) -> BenchResult:
    n = opts.samples
    if n < 1:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--samples must be at least 1")
    started = time.monotonic()

    def time_for(longest: float) -> bool:
        """Whether one more sample as long as the longest so far ends within --deadline-s, with time left for
        the same-run limit's measures and the result."""
        return opts.deadline_s is None or time.monotonic() - started + longest + AFTER_SAMPLES_S <= opts.deadline_s

    stopped: list[str] = []  # what the deadline cut short
    req = capture_request(opts, "-cold-node")
    name = req.lifecycle.name
    launch = get_adapter(opts.engine).prepare(req)
    # The capture's own cold start comes first and warms what a first start warms (imports, compile caches).
    progress(f"capturing {opts.engine} on {opts.device}")
    cap = capture(req, progress=progress)
    expected = cap.profile.expected_text
    weights = [w.path for w in (cap.profile.model.weights if cap.profile.model else [])]

    nv = opts.vanilla_samples or n
    vanilla: list[float] = []
    for i in range(nv):
        if vanilla and not time_for(max(vanilla)):
            stopped.append(f"vanilla after {i} of {nv}")
            progress(f"vanilla: {i} of {nv} samples, the rest would end past --deadline-s {opts.deadline_s:g}")
            break
        vanilla.append(_vanilla_once(name, req, launch, expected))
        progress(f"vanilla {i + 1}/{nv}: first token {vanilla[-1]:.3f} s (weights from local disk)")

    with tempfile.TemporaryDirectory(dir=private_dir(settings().run / "bench")) as tmp:
        registry = LocalRegistry.start(Path(tmp) / "registry")
        moved = [(p, p + ".cold-node") for p in weights if os.path.exists(p)]
        try:
            repo = "coldsnap/bench"
            store = CapsuleStore(settings().store)
            for d in weight_layers(store, store.load(cap.capsule)):  # linked in, not copied (push skips them)
                registry.hold(repo, d.digest, store.blob_path(d.digest))
            pushed = push(CapsuleStore(settings().store), cap.capsule, f"{registry}/{repo}:cold-node", insecure=True)
            ref = f"{registry}/{repo}@{cap.capsule}"
            biggest = _biggest_blob(store, cap.capsule)
            rate = registry_rate(registry, repo, *biggest)
            write_rate = storage_write_rate(Path(tmp), biggest[1])
            progress(f"pushed to {registry}; the registry serves a {biggest[1] / 2**20:.0f} MiB blob at "
                     f"{rate:.2f} GB/s; the node's storage writes at {write_rate:.2f} GB/s")
            for src, dst in moved:  # the node has no weights file: the payload brings it
                os.replace(src, dst)
            samples: list[dict] = []
            two_commands: list[dict] = []
            failed: list[dict] = []  # restores that did not serve: said, not timed; the bench goes on
            arms = opts.arms  # (name, settings), each restored once a round
            rounds: list[float] = []  # seconds each node took (its two restores and their clean-up)
            for i in range(n):
                if rounds and not time_for(max(rounds)):
                    stopped.append(f"cold nodes after {i} of {n}")
                    progress(f"cold nodes: {i} of {n}, the rest would end past --deadline-s {opts.deadline_s:g}")
                    break
                began = time.monotonic()
                served: list[dict] = []  # this round's one-command restores that served
                # arms: each once, the order turning by one a round; else one command, and pull-then-restore as
                # two, in turns: first one, then the other
                turns = [(True, *arms[(i + k) % len(arms)]) for k in range(len(arms))] if arms else \
                    [(one, "", {}) for one in ((True, False) if i % 2 == 0 else (False, True))]
                for one, arm, extra in turns:
                    for p in weights:
                        Path(p).unlink(missing_ok=True)  # the previous sample's put-back copy
                    try:
                        got = _first_restore(Path(tmp) / f"node{i}", ref, expected, one_command=one,
                                             settings_=extra)
                        if arms:
                            got["arm"] = arm
                        (served if one else two_commands).append(got)
                    except ColdSnapError as e:
                        failed.append({"node": i + 1, **({"arm": arm} if arms else {}), "one_command": one,
                                       "error": e.message})
                        progress(f"cold node {i + 1}: {arm + ' ' if arm else ''}failed: {e.message}")
                    shutil.rmtree(Path(tmp) / f"node{i}", ignore_errors=True)  # its copy of the weights: disk room
                rounds.append(time.monotonic() - began)
                samples += served
                if arms:
                    progress(f"cold node {i + 1}/{n}: " + ", ".join(
                        f"{g['arm']} {g['total_s']:.3f} s" for g in served) + " to first token")
                    continue
                if failed and failed[-1]["node"] == i + 1:  # said above
                    continue
                progress(f"cold node {i + 1}/{n}: restore of the reference → first token "
                         f"{samples[-1]['total_s']:.3f} s (pull {samples[-1]['spans']['pull']:.2f} s); pull, then "
                         f"restore: {two_commands[-1]['total_s']:.3f} s")
        finally:
            for src, dst in moved:
                if os.path.exists(dst):
                    os.replace(dst, src)
            registry.stop()

    first = [s for s in samples if s.get("arm", "") == (opts.arms[0][0] if opts.arms else "")]
    if not first:  # the baseline (the first arm) has nothing to time
        raise ColdSnapError(ErrorCode.VALIDATION_FAILED, "no restore on a fresh node served"
                            + (f": {failed[-1]['error']}" if failed else ""))
    staged = settings().staged / cap.capsule.split(":")[1] / "images"
    if not staged.exists():
        from coldsnap.contracts import RestoreRequest
        from coldsnap.flows.restore import restore

        restore(RestoreRequest(operation="prepare", capsule=cap.capsule))  # for the image bytes the limit counts
    pages = max(staged.glob("pages-*.img"), key=lambda p: p.stat().st_size, default=None)
    bw = {**bandwidth.measure(pages), "registry_read_gbs": round(rate, 2), "storage_write_gbs": round(write_rate, 2)}
    weights_bytes = sum(os.path.getsize(p) for p in weights if os.path.exists(p))
    apart = cap.receipt.facts(CaptureFacts).weights_apart
    streams = bool(cap.profile.model) and all(w.chunks for w in cap.profile.model.weights)  # pinned by pieces
    limit = cold_node_limit(bw, bandwidth.dir_bytes(staged), weights_bytes, not apart,
                            statistics.median(s["pulled_bytes"] for s in samples), rate, write_rate, streams)
    v = _stats(vanilla)
    by_arm = {name: _arm_result(extra, [s for s in samples if s["arm"] == name], v, limit,
                                sum(f.get("arm") == name for f in failed)) for name, extra in opts.arms}
    r = _stats([s["total_s"] for s in first])  # with arms: the first arm's (the baseline)
    data = {
        "kind": "coldsnap.bench",
        "command": opts.command or "coldsnap " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": host_record(cap.profile),
        "page_cache": "warm (the registry's storage and the vanilla weights)",
        "storage": _storage(settings().home),
        "engine": opts.engine, "device": opts.device, "weights_mode": cap.profile.weights_mode,
        "samples": len(samples), "vanilla_samples": len(vanilla), "cold_node": True,
        **({"deadline_s": opts.deadline_s, "stopped_early": stopped, "asked": {"samples": n, "vanilla_samples": nv}}
           if stopped else {}),
        "clock": "restore: issue of `coldsnap restore --capsule REF@DIGEST` on a fresh node (it pulls, unpacking "
                 "the images while the weights arrive, then restores) -> first token of its validated completion; "
                 "vanilla: issue of a cold start -> first token, weights from local disk",
        "vanilla": v, "restore": r, "ratio_median": round(v["median_s"] / r["median_s"], 2),
        "validations": {"vanilla": f"{len(vanilla)}/{len(vanilla)}",
                        "restore": f"{sum(s['validated'] for s in samples)}/"
                                   f"{len(samples) + sum(f['one_command'] for f in failed)}"},
        "fell_back": 0, "span_medians_s": _span_medians(first),
        **({"failed": failed} if failed else {}),
        **({"arms": by_arm} if by_arm else {}),
        "runs": samples, "bandwidth": bw, "physical_limit": limit,
        # the same nodes' restores issued as `coldsnap pull` then `coldsnap restore`, in turns with the runs above
        "two_commands": {**_stats([s["total_s"] for s in two_commands]),
                         "validated": f"{sum(s['validated'] for s in two_commands)}/{len(two_commands)}",
                         "span_medians_s": _span_medians(two_commands),
                         "runs": two_commands} if two_commands else None,
        "capsule": {"digest": cap.capsule, "bytes": cap.receipt.facts(CaptureFacts).capsule_bytes, "staging_s": None,
                    "weights_bytes": sum(d.size for d in weight_layers(store, store.load(cap.capsule))),
                    "pushed_bytes": pushed.get("bytes_transferred"), "capture_spans": {s.name: s.duration_s
                                                                             for s in cap.receipt.spans}},
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (opts.name or f"{opts.engine}-{opts.device.replace(':', '')}-cold-node")
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    _chart(data, stem.with_suffix(".png"))
    lim = f"; the limit {limit['limit_s']} s ({r['median_s'] / limit['limit_s']:.2f}x)" if limit else ""
    if by_arm:
        told = "; ".join(f"{name} " + (f"{a['restore']['median_s']:.3f} s" if a["restore"] else "none served")
                         + f" ({a['validations']})" for name, a in by_arm.items())
        told = f"first restore on a cold node, by arm: {told}; the limit {limit['limit_s'] if limit else '?'} s"
    else:
        told = (f"first restore on a cold node {r['median_s']:.3f} s (pull {data['span_medians_s']['pull']:.3f} s)"
                f"{lim}; {data['validations']['restore']} validated; pull, then restore: "
                f"{data['two_commands']['median_s']:.3f} s")
    summary = (f"vanilla {v['median_s']:.3f} s vs {told}"
               + (f" (stopped early by --deadline-s: {'; '.join(stopped)})" if stopped else "")
               + (f"; {len(failed)} restore(s) did not serve, the first: {failed[0]['error']}" if failed else "")
               + f"\nwrote {stem}.json and {stem}.png")
    return BenchResult(data, summary)


def _span_medians(runs: list[dict]) -> dict[str, float]:
    return {k: round(statistics.median(s["spans"][k] for s in runs), 4) for k in SPANS} if runs else {}


def _arm_result(extra: dict[str, str], runs: list[dict], vanilla: dict, limit: dict, failed: int = 0) -> dict:
    """One arm's account: its settings, its restores' medians, against the run's vanilla and limit (failed: its
    restores that did not serve, counted among those not validated)."""
    r = _stats([s["total_s"] for s in runs]) if runs else None
    return {"settings": extra, "restore": r,
            "validations": f"{sum(s['validated'] for s in runs)}/{len(runs) + failed}",
            "ratio_median": round(vanilla["median_s"] / r["median_s"], 2) if r else None,
            "vs_limit": round(r["median_s"] / limit["limit_s"], 2) if r and limit and limit.get("limit_s") else None,
            "span_medians_s": _span_medians(runs)}


def cold_node_limit(bw: dict, images_bytes: int, weights_bytes: int, weights_in_images: bool, pulled: float,
                    registry_gbs: float, write_gbs: float, streams: bool) -> dict:
    """The least a first restore on a node must take, at rates measured in the same run. Weights pinned piece by
    piece (streams) stream from the registry onto the GPU while they land, the node's storage written behind: they
    cost their bytes at the slower of the registry and the host-to-device copy, and the disk no longer counts. The
    rest of what is pulled (the capsule's own blobs: its CRIU images) comes first at the registry's rate, and is then
    restored (bandwidth.restore_limit's host copies). `disk_bound_s`: a pull that lands on the node's storage before
    the restore, the limit of weights that come as one stream."""
    limit = bandwidth.restore_limit(bw, images_bytes, weights_bytes, weights_in_images=weights_in_images)
    h2d = bw.get("pinned_h2d_gbs") or 0
    if not limit or not registry_gbs:
        return limit
    pull_s = pulled / (min(registry_gbs, write_gbs or registry_gbs) * 1e9)
    disk_bound = {**limit, "pull_bytes": int(pulled), "pull_s": round(pull_s, 3),
                  "limit_s": round(limit["limit_s"] + pull_s, 3), "disk_bound_s": round(limit["limit_s"] + pull_s, 3),
                  "assumption": limit["assumption"] + "; the pull at the slower of the registry's read rate and the "
                                "node storage's durable write rate (both measured), before the restore"}
    if not streams or weights_in_images:
        return disk_bound
    rest = max(pulled - weights_bytes, 0)
    first_s = rest / (registry_gbs * 1e9)
    streamed_s = weights_bytes / (min(registry_gbs, h2d or registry_gbs) * 1e9)
    return {**limit, "pull_bytes": int(pulled), "images_pull_s": round(first_s, 3),
            "weights_streamed_s": round(streamed_s, 3), "limit_s": round(first_s + limit["host_s"] + streamed_s, 3),
            "disk_bound_s": disk_bound["disk_bound_s"],
            "assumption": limit["assumption"] + "; the capsule's own blobs pulled at the registry's rate first, then "
                          "the weights streamed at the slower of the registry's and the host-to-device rate (the "
                          "node's storage written behind); disk_bound_s: the whole pull at the slower of the "
                          "registry's and the storage's durable write rate, before the restore"}


def _storage(path: Path) -> str:
    """The filesystem the home (weights, store, the registry's storage, the nodes) lives on, e.g. 'ext4 at /'."""
    best = ("?", "/")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mnt, fstype, *_ = line.split()
        if str(path).startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best[1]):
            best = (fstype, mnt)
    return f"{best[0]} at {best[1]}"


def _biggest_blob(store: CapsuleStore, digest: str) -> tuple[str, int]:
    """(digest, size) of the largest blob a first restore pulls: a weights layer, or another layer of the capsule."""
    capsule = store.load(digest)
    best = max([*capsule.layers, *weight_layers(store, capsule)], key=lambda d: d.size)
    return best.digest, best.size


def _first_restore(node: Path, ref: str, expected: str, one_command: bool = True,
                   settings_: dict[str, str] | None = None) -> dict:
    """One command, as a node issues it: `coldsnap restore --capsule REF@DIGEST` pulls (the images unpack while the
    weights arrive), admits, stages and restores. one_command False: `coldsnap pull REF@DIGEST`, then `coldsnap
    restore --capsule DIGEST` (nothing overlaps; what the one command saves, in the same run). settings_: an arm's
    settings, in the commands' environment."""
    env = {**_node_env(node), **(settings_ or {})}
    t_issue = time.monotonic()
    pull_s = None
    if one_command:
        receipt = _cli(env, "restore", "--capsule", ref, "--insecure", "--no-fallback", "--json")
    else:
        pulled = _cli(env, "pull", ref, "--insecure", "--json")
        pull_s = time.monotonic() - t_issue
        receipt = _cli(env, "restore", "--capsule", ref.rsplit("@", 1)[1], "--no-fallback", "--json")
    result = receipt["result"]
    try:
        total = result["first_token_monotonic_s"] - t_issue
        took = {x["name"]: x["duration_s"] for x in receipt["spans"]}
        spans = {"pull": round(pull_s, 4) if pull_s is not None else took.get("pull", 0.0), **_restore_spans(receipt)}
        # the rest is the commands' own start-up (an interpreter each) and what lies between the spans
        spans["process starts"] = round(max(total - sum(spans.values()), 0.0), 4)
        facts = result.get("pull") or {}
        return {"total_s": round(total, 4), "spans": spans,
                "restore_ttft_s": result["time_to_first_token_s"],
                # the weights' bytes included
                "pulled_bytes": (facts.get("bytes") if one_command else pulled.get("bytes_transferred")) or 0,
                "streamed": bool(facts.get("streamed")),
                "spooled": bool(facts.get("spooled")),  # the weights' pieces in memory first, the disk after
                "direct_offered": bool(facts.get("direct_offered")),  # offered to the prefetcher (COLDSNAP_PULL_DIRECT)
                # where "process starts" hides: the receipt's own spans (from the command's start) and stage's parts
                "timeline": {"origin_after_issue_s": round(receipt["origin"]["monotonic_s"] - t_issue, 4),
                             "spans": [(x["name"], round(x["start_s"], 4), round(x["duration_s"], 4))
                                       for x in receipt["spans"]],
                             "admit_parts": result.get("admit_parts") or {},
                             "stage_parts": result.get("stage_parts") or {},
                             "weights_wait_s": (result.get("hydrate") or {}).get("weights_wait_s"),
                             # the weights' pieces: sized → last checked; and the prefetcher's own account
                             "pieces_s": facts.get("pieces_s"),
                             "pull_steps_s": facts.get("steps_s"),  # the pull's steps, from its own start
                             "prefetch": {k: v for k, v in ((result.get("hydrate") or {}).get("prefetch") or {}).items()
                                          if k in ("mode", "cuda_init_s", "load_s", "gb_per_s", "ready_s", "error")}},
                "validated": result["validated_text"] == expected and receipt["state"] == "succeeded"}
    finally:
        _cli(env, "stop", result["workload"])


def _restore_spans(receipt: dict) -> dict[str, float]:
    """The restore receipt's spans as the chart stacks them (SPANS between pull and process starts)."""
    took = {x["name"]: x["duration_s"] for x in receipt["spans"]}
    parts = clock_parts(took, Receipt.model_validate(receipt, strict=False).facts(RestoreFacts))
    staging = receipt["result"].get("stage_parts") or {}
    # streamed by pieces: what the engine's resume waited for the last pieces, CRIU and the driver done (their
    # listing and placing come after the first token); else the weights' tail after staging, checked and placed
    waited = (receipt["result"].get("hydrate") or {}).get("weights_wait_s")
    weights = waited if waited is not None else staging.get("arrive", 0.0) + staging.get("weights", 0.0)
    return {"admit": took.get("admit", 0.0), "verify": staging.get("verify", 0.0),
            "weights": weights, "unpack": staging.get("unpack", 0.0),
            "network": parts["network"], "criu-restore": parts["criu-restore"],
            "cuda driver": parts["cuda driver"], "engine resume": round(parts["engine resume"] - (waited or 0.0), 4),
            # the validate span ends after the whole completion; its first token is what the clock stops at
            "validate": parts["first token"]}


def _chart(data: dict, path: Path) -> None:
    """Each cold-node sample's spans stacked, beside vanilla and the same-run limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = data["runs"]
    colors = dict(zip(SPANS, ("#8c564b", "#7f7f7f", "#9467bd", "#e377c2", "#17becf", "#bcbd22", "#2b7bba",
                              "#d62728", "#ff7f0e", "#2ca02c", "#c7c7c7")))
    fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=120)
    ax.bar(0, data["vanilla"]["median_s"], color="#9a9a9a", label="vanilla start (median)")
    for i, run in enumerate(runs, start=1):
        bottom = 0.0
        for k in SPANS:
            ax.bar(i, run["spans"][k], bottom=bottom, color=colors[k], label=k if i == 1 else None)
            bottom += run["spans"][k]
    two = (data.get("two_commands") or {}).get("median_s")
    if two:
        ax.bar(len(runs) + 1, two, color="#d9d9d9", edgecolor="#9a9a9a", label="pull, then restore (median)")
    limit = (data.get("physical_limit") or {}).get("limit_s")
    if limit:
        ax.axhline(limit, color="#d62728", linestyle="--", linewidth=1, label=f"limit {limit} s (same run)")
    ticks = ["vanilla", *[f"{run['arm']} {i}" if "arm" in run else f"node {i}" for i, run in enumerate(runs, 1)],
             *(["two cmds"] if two else [])]
    ax.set_xticks(range(len(ticks)), ticks, fontsize=7)
    ax.set_ylabel("seconds from issue to first token")
    arms = data.get("arms")
    how = ", ".join(f"{name} {a['ratio_median']}x" if a["ratio_median"] else f"{name} none served"
                    for name, a in arms.items()) if arms else f"{data['ratio_median']}x"
    ax.set_title(f"{data['engine']} on {data['device']}: first restore on a cold node, {how} sooner than vanilla",
                 fontsize=10)
    ax.legend(fontsize=7)
    fig.text(0.01, 0.01, data["command"], fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)
