"""ColdSnap as a sparkrun plugin (entry point `coldsnap` in the group `sparkrun.plugins`).

  sparkrun coldsnap capture RECIPE --hosts localhost   cold start, sparkrun's readiness, capture (capsule tagged
                                                       for the launch's identity)
  sparkrun run RECIPE --hosts localhost                restored from that capsule, validated; else cold as usual
  sparkrun logs|status|stop RECIPE                     as for any sparkrun workload

Enabled with `sparkrun plugins enable coldsnap` and `features: {executor.docker: false}` in sparkrun's
config.yaml (the coldsnap executor, a docker executor, is then sparkrun's only one);
settings under `plugins.coldsnap` (coldsnap_sparkrun.client). Needs sparkrun (Python 3.12+) and a
docker with coldsnap-runtime registered as a runtime. See docs/sparkrun.md."""

from __future__ import annotations

SPARKRUN_PLUGIN_API_VERSION = 1
SPARKRUN_PLUGIN_SCAN_SUBMODULES = False  # the executor below is what sparkrun should find

from coldsnap_sparkrun.executor import ColdSnapExecutor  # noqa: E402,F401 - registered by sparkrun


def register(v) -> None:
    from sparkrun.plugins import register_cli_command

    from coldsnap_sparkrun import client, commands

    register_cli_command(commands.load, name="coldsnap")
    if client.settings().cpu_slot:
        from sparkrun.plugins import register_hardware_probe

        from coldsnap_sparkrun.hardware import enrich_cpu_slot

        register_hardware_probe("coldsnap-cpu", script='printf "COLDSNAP_CPU_SLOT=1\\n"', enrich=enrich_cpu_slot)
