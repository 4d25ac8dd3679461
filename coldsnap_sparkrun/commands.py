"""`sparkrun coldsnap capture|restore|status|ls`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import click

from coldsnap_sparkrun import client
from coldsnap_sparkrun.identity import TAG_PREFIX

PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True}


def _sparkrun() -> str:
    beside = Path(sys.prefix) / "bin" / "sparkrun"
    return str(beside) if beside.exists() else "sparkrun"


def _fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"sparkrun coldsnap: error: {message}", err=True)
    raise SystemExit(code)


@click.group(name="coldsnap", help="Capture a recipe's server once; `sparkrun run` restores it from then on.")
def group() -> None:
    pass


@group.command(context_settings=PASS_THROUGH, help="Start RECIPE cold (`sparkrun run RECIPE ARGS…`), wait until "
               "sparkrun reports it ready, then capture it into a capsule tagged for this launch's identity. The "
               "captured container stops (--leave-running keeps it serving).")
@click.argument("recipe")
@click.option("--leave-running", is_flag=True, help="keep the captured server running")
@click.option("--json", "as_json", is_flag=True, help="print the capture receipt as JSON")
@click.pass_context
def capture(ctx: click.Context, recipe: str, leave_running: bool, as_json: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="coldsnap-sparkrun-") as tmp:
        record_path = Path(tmp) / "launch.json"
        env = {**os.environ, client.MODE_ENV: "capture", client.RECORD_ENV: str(record_path)}
        launched = subprocess.run([_sparkrun(), "run", recipe, *ctx.args], env=env)
        if launched.returncode != 0:
            _fail(f"`sparkrun run {recipe}` exited {launched.returncode}: nothing captured", launched.returncode)
        if not record_path.exists():
            _fail("sparkrun did not launch through the coldsnap executor: add `features: {executor.docker: false}` "
                  "to sparkrun's config.yaml (see docs/sparkrun.md)")
        launch = json.loads(record_path.read_text())
    name, tag, engine = launch["container"], launch["tag"], launch["identity"]["engine"]
    r = client.docker("inspect", "--format", "{{.Id}}", name)
    if r.returncode != 0:
        _fail(f"container {name} is gone: {r.stderr.strip()[-300:]}")
    cid = r.stdout.strip()
    root = client.runc_root_of(cid)
    if root is None:
        _fail(f"no runc state for {name} under {client.settings().docker_exec_root}/runtime-*/moby (set "
              "plugins.coldsnap.docker_exec_root to dockerd's exec-root)")
    click.echo(f"[coldsnap] capturing {name} ({engine}, tag {tag})", err=True)
    args = ["capture", "--container", cid, "--runc-root", root, "--engine", engine, "--tag", tag,
            "--image", launch["image"]]
    if launch["identity"].get("port"):
        args += ["--port", str(launch["identity"]["port"])]
    if leave_running:
        args.append("--leave-running")
    try:
        receipt = client.coldsnap(*args)
    except client.ColdSnapFailed as e:
        _fail(f"capture failed: {e}", e.exit_code)
    (client.home() / f"{tag}.identity.json").write_text(json.dumps(launch, indent=1))
    result = receipt.get("result", {})
    if as_json:
        click.echo(json.dumps(receipt))  # one line, the last: sparkrun's own output comes before it
    else:
        click.echo(f"captured {recipe} into {tag}@{result.get('capsule')} "
                   f"({(result.get('capsule_bytes') or 0) / 2**20:.1f} MiB); `sparkrun run {recipe}` restores it")


@group.command(context_settings=PASS_THROUGH, help="`sparkrun run RECIPE ARGS…`, restored from its capsule or "
               "failing: no cold start (the capsule must exist and be admitted).")
@click.argument("recipe")
@click.pass_context
def restore(ctx: click.Context, recipe: str) -> None:
    env = {**os.environ, client.MODE_ENV: "restore"}
    raise SystemExit(subprocess.run([_sparkrun(), "run", recipe, *ctx.args], env=env).returncode)


@group.command(help="The capsules captured for sparkrun launches in the local store.")
@click.option("--json", "as_json", is_flag=True)
def ls(as_json: bool) -> None:
    try:
        rows = [c for c in client.coldsnap("ls").get("capsules", []) if (c.get("tag") or "").startswith(TAG_PREFIX)]
    except client.ColdSnapFailed as e:
        _fail(str(e), e.exit_code)
    for row in rows:
        path = client.home() / f"{row['tag']}.identity.json"
        row["identity"] = json.loads(path.read_text())["identity"] if path.exists() else None
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    for row in rows:
        ident = row["identity"] or {}
        click.echo(f"{row['tag']}@{row['digest'][:19]}…  {ident.get('engine') or '-':<9} "
                   f"{ident.get('model') or '-':<40} port {ident.get('port') or '-':<6} "
                   f"{(row.get('size') or 0) / 2**20:8.1f} MiB")
    if not rows:
        click.echo("no capsules for sparkrun launches (sparkrun coldsnap capture RECIPE)")


@group.command(help="What ColdSnap decided for the latest sparkrun launches (restore or cold, and why) and the "
               "receipts of those restores.")
@click.option("--json", "as_json", is_flag=True)
def status(as_json: bool) -> None:
    records = []
    for path in sorted(client.home().glob("sparkrun_*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except ValueError:
            continue
    records.sort(key=lambda r: r.get("time", 0))
    if as_json:
        click.echo(json.dumps(records, indent=1))
        return
    for r in records:
        click.echo(f"{r['container']}: {r['decision']}" + (f" from {r['capsule']}" if r.get("capsule") else "")
                   + f" ({r['reason']})" if r["decision"] != "restore" else f"{r['container']}: restored from "
                   f"{r['capsule']}")
    if not records:
        click.echo("no sparkrun launches through the coldsnap executor yet")


def load() -> click.Command:
    return group
