"""`coldsnap capabilities`: what this ColdSnap supports (from the contracts) and what it is qualified for, each claim
read from the result file that measured it (bench/results/*.json: `coldsnap bench` results and the receipts of
device runs). Nothing here is written by hand: a claim without a result file does not exist."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import coldsnap
from coldsnap.base.paths import settings
from coldsnap.contracts import ENGINE_NAMES, FORMAT_VERSION, OPERATIONS, Capabilities, CapsuleProfile, Policy
from coldsnap.contracts.profile import Qualification

# The result files of a source checkout (an installed ColdSnap has none unless COLDSNAP_RESULTS names a directory).
REPO_RESULTS = Path(coldsnap.__file__).resolve().parents[1] / "bench" / "results"


def results_dir() -> Path:
    return Path(settings().results or REPO_RESULTS)


def _where(data: dict) -> str:
    host = data.get("host") or {}
    if isinstance(host, str):  # a device run that describes its machine in words
        return host
    gpus = host.get("gpus") or []
    machine = f"{len(gpus)}x{gpus[0]}" if gpus else (host.get("cpu_model") or "CPU")
    return f"{machine}, CRIU {host.get('criu', '?')}"


def _bench_claim(data: dict) -> str:
    """One `coldsnap bench` result as a sentence: what restored, how often validated, against what."""
    what = f"{data.get('engine')} on {data.get('device')}, weights {data.get('weights_mode')}"
    if data.get("via"):
        what += f", in a {data['via']} container through coldsnap-runtime"
    v, r = data.get("vanilla") or {}, data.get("restore") or {}
    sentence = (f"{what}: restore → first token {r.get('median_s')} s median vs vanilla {v.get('median_s')} s "
                f"({(data.get('validations') or {}).get('restore')} restores validated, "
                f"{data.get('fell_back', 0)} fell back")
    limit = (data.get("physical_limit") or {}).get("limit_s")
    if limit and r.get("median_s"):
        sentence += f"; {r['median_s'] / limit:.2f}x the same-run physical limit of {limit} s"
    if isinstance(data.get("template"), dict):  # bench --template: the template capsule's restores in the same run
        t = data["template"]
        sentence += f"; template restore → first token {t.get('median_s')} s median ({t.get('validated')} validated)"
    if data.get("page_cache"):
        sentence += f"; page cache {data['page_cache']}"
    return sentence + f") on {_where(data)}: `{data.get('command', 'command not recorded')}`"


def _replicas_claim(data: dict) -> str:
    """bench --replicas: N restores of one capsule at once against N vanilla starts at once, per N."""
    rows = "; ".join(f"{r['replicas']} at once: restore {r['restore_s']} s vs vanilla {r['vanilla_s']} s "
                     f"({r['validated']['restore']} restores validated)" for r in data["rows"])
    return (f"{data.get('engine')} on {data.get('device')}, N replicas of one capsule, to the last validated: {rows} "
            f"on {_where(data)}: `{data.get('command', 'command not recorded')}`")


def _receipts_claim(data: dict) -> str | None:
    """A file of receipts from a device run: how many of each operation succeeded, and the command that ran them."""
    receipts = data.get("receipts")
    receipts = receipts if isinstance(receipts, list) else [data["receipt"]] if isinstance(data.get("receipt"), dict) \
        else []
    counts: dict[str, list[int]] = {}
    for rec in receipts:
        if isinstance(rec, dict) and rec.get("operation"):
            ok, total = counts.setdefault(rec["operation"], [0, 0])
            counts[rec["operation"]] = [ok + (rec.get("state") == "succeeded"), total + 1]
    if not counts:
        return None
    done = ", ".join(f"{op} {ok}/{total} succeeded" for op, (ok, total) in counts.items())
    what = f": {data['what']}" if data.get("what") else ""
    return f"{done}{what} ({data.get('command', 'command not recorded')})"


def _summary_claim(data: dict) -> str:
    """A device run assembled by a script (not `coldsnap bench`): what it measured, its summary, where and how."""
    figures = "; ".join(f"{k}: " + ", ".join(f"{m} {v}" for m, v in row.items()) if isinstance(row, dict)
                        else f"{k} {row}" for k, row in data["summary"].items())
    return f"{data['what']}: {figures} (on {_where(data)}; page cache {data.get('page_cache', '?')}): " \
           f"`{data['command']}`"


def qualifications(directory: Path | None = None) -> list[Qualification]:
    directory = directory or results_dir()
    out = []
    for path in sorted(directory.rglob("*.json")) if directory.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        claim: str | None
        if data.get("kind") == "coldsnap.bench":
            claim = _bench_claim(data)
        elif data.get("kind") == "coldsnap.bench.replicas" and isinstance(data.get("rows"), list):
            claim = _replicas_claim(data)
        elif path.name.endswith(".receipts.json"):
            if path.with_name(path.name.removesuffix(".receipts.json") + ".json").exists():
                continue  # the receipts of a bench result: the result says it
            claim = _receipts_claim(data)
        elif isinstance(data.get("summary"), dict) and data.get("what") and data.get("command"):
            claim = _summary_claim(data)
        else:
            claim = f"measured: {data.get('command')}" if data.get("command") else None
        if claim:
            out.append(Qualification(claim=claim, evidence=str(path.relative_to(directory.parent.parent))
                                     if directory == REPO_RESULTS else str(path)))
    return out


def capabilities() -> Capabilities:
    return Capabilities(
        coldsnap_version=coldsnap.__version__, request_formats=[FORMAT_VERSION], receipt_formats=[FORMAT_VERSION],
        capsule_formats=[FORMAT_VERSION], operations=list(OPERATIONS), engines=list(ENGINE_NAMES),
        snapshot_drivers=list(typing.get_args(CapsuleProfile.model_fields["snapshot_driver"].annotation)),
        weights_modes=list(typing.get_args(Policy.model_fields["weights_mode"].annotation)),
        results=str(results_dir()), qualified=qualifications())
