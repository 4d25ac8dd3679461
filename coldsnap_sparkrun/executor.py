"""The `coldsnap` executor: sparkrun's Docker executor, with the serve step decided by ColdSnap.

The executor of every launch once sparkrun's own docker executor is off (`features: {executor.docker: false}` in
sparkrun's config.yaml): it is a docker executor, and sparkrun's default is then the only one enabled. It changes
two things in sparkrun's launch, and only these (coldsnap_sparkrun.serve says why): PID 1 starts the
server, and the serve step, given the serve command, looks for a capsule of this launch's identity
(coldsnap_sparkrun.identity). With none, or one ColdSnap's admission refuses, the server starts cold
as sparkrun would start it. With one, the idle container sparkrun just made is replaced by one of the same name,
labels and options run through the coldsnap runtime with the capsule named: coldsnap-runtime restores it and
validates it before `docker run` returns; sparkrun's readiness, logs and stop then see a running server."""

from __future__ import annotations

import json
import shlex
import sys
import time
from typing import Any

from sparkrun.orchestration.executors.docker import DockerExecutor

from coldsnap.base.paths import settings
from coldsnap_sparkrun import client, serve
from coldsnap_sparkrun.identity import identity, tag_of

SLEEP = "sleep infinity"


def _say(message: str) -> None:
    print(f"[coldsnap] {message}", file=sys.stderr, flush=True)


class ColdSnapExecutor(DockerExecutor):
    executor_name = "coldsnap"
    required_feature_flag = None  # on whenever the plugin is

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._launches: dict[str, dict] = {}

    def run_cmd(self, image, command="", container_name=None, detach=True, env=None, volumes=None, extra_opts=None,
                *, sparkrun_labels=None):
        if command.strip() == SLEEP and container_name:
            command = serve.SUPERVISOR
            self._launches[container_name] = {"image": image, "detach": detach, "env": dict(env or {}),
                                              "volumes": dict(volumes or {}), "extra_opts": list(extra_opts or []),
                                              "labels": dict(sparkrun_labels or {})}
        return super().run_cmd(image, command, container_name, detach, env, volumes, extra_opts,
                               sparkrun_labels=sparkrun_labels)

    def generate_exec_serve_script(self, container_name, serve_command, env=None, detached=True, volumes=None, *,
                                   sparkrun_labels=None):
        launch = self._launches.get(container_name)
        if launch is None or not detached:  # not a container this executor laid out (or --foreground): sparkrun's
            return super().generate_exec_serve_script(container_name, serve_command, env, detached, volumes,
                                                      sparkrun_labels=sparkrun_labels)
        cold = serve.cold_serve(container_name, serve_command, env)
        capsule, why = self._decide(container_name, launch, serve_command)
        strict = settings().sparkrun_mode == "restore"  # sparkrun coldsnap restore: no cold start
        refuse = f"echo {shlex.quote('ColdSnap: ' + why)} >&2\nexit 1\n"
        body = refuse if strict else cold
        if capsule:
            s = client.settings()
            policy = json.dumps({"fallback_to_cold": s.fallback_to_cold and not strict})
            run_line = super().run_cmd(
                launch["image"], serve.SUPERVISOR, container_name, launch["detach"],
                {**launch["env"], "COLDSNAP_CAPSULE": capsule, "COLDSNAP_POLICY": policy}, launch["volumes"],
                [*launch["extra_opts"], "--runtime", s.docker_runtime], sparkrun_labels=launch["labels"])
            body = serve.restore_serve(container_name, run_line, capsule, refuse if strict else cold)
        else:
            _say(why)
        return "#!/bin/bash\nset -uo pipefail\n" + body

    def _decide(self, name: str, launch: dict, serve_command: str) -> tuple[str | None, str]:
        """(the capsule to restore, or None and why the server starts cold)."""
        r = client.docker("image", "inspect", "--format", "{{.Id}}", launch["image"])
        image_id = r.stdout.strip() if r.returncode == 0 else launch["image"]
        ident = identity(launch["labels"], serve_command, image_id)
        tag = tag_of(ident)
        record = {"container": name, "identity": ident, "tag": tag, "image": launch["image"],
                  "time": time.time()}
        mode = settings().sparkrun_mode
        try:
            if mode == "capture":
                path = settings().sparkrun_record
                if path:
                    with open(path, "w") as f:
                        json.dump(record, f)
                return None, f"capture run: starting {name} cold (capsule tag {tag})"
            if mode == "cold":
                return self._record(record, None, f"{client.MODE_ENV}=cold: starting it cold")
            capsule = client.capsule_for(tag)
            if capsule is None:
                return self._record(record, None, f"no capsule for this launch (tag {tag}): starting it cold")
            try:  # admission and staging now, before sparkrun's container is touched
                client.coldsnap("restore", "--capsule", capsule, "--prepare-only", timeout=1800)
            except client.ColdSnapFailed as e:
                return self._record(record, None, f"capsule {capsule} refused ({e}): starting it cold")
            _say(f"restoring {name} from {capsule}")
            return self._record(record, capsule, "restore")
        except (client.ColdSnapFailed, OSError, ValueError) as e:
            return self._record(record, None, f"ColdSnap could not be asked ({e}): starting it cold")

    def _record(self, record: dict, capsule: str | None, why: str) -> tuple[str | None, str]:
        record.update(capsule=capsule, decision="restore" if capsule else "cold", reason=why)
        try:
            (client.home() / f"{record['container']}.json").write_text(json.dumps(record, indent=1))
        except OSError:
            pass
        return capsule, why
