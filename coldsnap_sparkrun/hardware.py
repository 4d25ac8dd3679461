"""One CPU slot for a host with no accelerator (plugins.coldsnap.cpu_slot): sparkrun plans a rank per accelerator,
and a CPU inference server (vLLM or SGLang on CPU, ColdSnap's reference engine) needs none. Through sparkrun's own
hardware-probe extension; off unless asked for."""

from __future__ import annotations

import os


def enrich_cpu_slot(parsed, hw):
    from dataclasses import replace

    from sparkrun.core.hardware import AcceleratorSpec

    if hw.accelerators or parsed.get("COLDSNAP_CPU_SLOT") != "1":
        return hw
    memory_gb = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30
    cpu = AcceleratorSpec(vendor="cpu", model="cpu", count=1, memory_gb=round(memory_gb, 1))
    return replace(hw, accelerators=[cpu])
