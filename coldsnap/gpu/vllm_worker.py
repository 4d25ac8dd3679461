"""Runs inside vLLM's GPU worker (its `--worker-extension-cls`): the weights of a recovery restore reloaded from
copies already on the GPU instead of through vLLM's own loader.

vLLM's `reload_weights` reads each safetensors tensor into pageable host memory on one thread and copies it to the
GPU from there. Here each file's data section is on the GPU first: taken from the prefetcher that loaded it during
the restore (coldsnap.gpu.prefetch, one per file: its memory handed over on a UNIX socket and mapped here), or,
where there is none or it failed, filled here the prefetcher's way (`fill_buffered`: threads reading into pinned
buffers, each copying on its own stream). The tensors go to vLLM's `reload_weights` as views of those copies: its
weight loaders (fused QKV, gate/up, layerwise reload) run unchanged and copy device to device into the parameters
the restored CUDA graphs point at. Every copy stays mapped until the reload returns (the layerwise reload may hold a
layer's tensors across files).

Imported by the engine's own interpreter (torch, vLLM): stdlib, torch and ColdSnap's GPU part only, nothing that
needs ColdSnap's own dependencies. The restore calls it over vLLM's dev endpoint:
POST /collective_rpc {"method": "coldsnap_reload_weights", "args": ["{\"prefetched\": {FILE: SOCKET}}"]}.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

from coldsnap.gpu.libcuda import set_stack_limit
from coldsnap.gpu.prefetch import DTYPES, PrefetchError, Session, fill_buffered, read_header, whole_section
from coldsnap.gpu.vmm import CudaError, DeviceRegion, Driver, imported

EXTENSION = f"{__name__}.ColdSnapWorker"  # what the launch's --worker-extension-cls names
METHOD = "coldsnap_reload_weights"  # what the restore's collective_rpc calls (ColdSnapWorker's method of that name)
RELEASE_STACK, RESTORE_STACK = "coldsnap_release_stack", "coldsnap_restore_stack"  # around the CUDA checkpoint


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files vLLM loads from a model directory: those its index maps tensors to, else all."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(d.glob("*.safetensors"))


def prefetched_section(held: ExitStack, driver: Driver, path: Path, base: int, length: int, device: int, sock: str):
    """The file's data section as the prefetcher put it on this GPU, mapped here until `held` closes; raises
    PrefetchError or CudaError when it can't be used."""
    import torch

    session = Session(sock, str(path))
    held.callback(session.release)  # after the unmap below (last in, first out): then the prefetcher frees its copy
    message = session.message
    if message.get("offset") != base or int(message.get("bytes", -1)) != length or "plan" in message:
        os.close(session.fd)
        raise PrefetchError(f"the prefetcher loaded another part of {path.name} than its data section")
    ptr = held.enter_context(imported(driver, session.fd, int(message["alloc_bytes"]), device))
    return torch.as_tensor(DeviceRegion(ptr, length), device=torch.device("cuda", device))


def filled_section(driver: Driver, path: Path, base: int, length: int, device: int, threads: int):
    """The file's data section read onto this GPU now, in torch memory (freed with its last view)."""
    import torch

    section = torch.empty(length, dtype=torch.uint8, device=torch.device("cuda", device))
    fd = os.open(path, os.O_RDONLY)
    try:
        fill_buffered(driver, device, section.data_ptr(), fd, base, whole_section(length), threads)
    finally:
        os.close(fd)
    return section


def tensors_on_gpu(files: list[Path], device: int, threads: int, prefetched: dict[str, str], held: ExitStack,
                   stats: dict[str, Any]) -> Iterator[tuple]:
    """(name, CUDA tensor) for every tensor of the files, each file's data section on the GPU in one piece first:
    the prefetched copy where there is one (mapped until `held` closes), else read here. stats: bytes, seconds
    waiting for or filling the copies, and how each file came."""
    import torch

    driver = Driver()
    driver.use_primary_context(device)  # torch's: the imported memory is mapped in it
    for path in files:
        base, header = read_header(path)
        length = path.stat().st_size - base
        t = time.perf_counter()
        section = None
        sock = prefetched.get(str(path.resolve()))
        if sock:
            try:
                section = prefetched_section(held, driver, path, base, length, device, sock)
                stats["prefetched"] += 1
            except (PrefetchError, CudaError, OSError, ValueError) as e:
                stats["errors"].append(f"{path.name}: {e}"[:300])
        if section is None:
            section = filled_section(driver, path, base, length, device, threads)
            stats["filled"] += 1
        stats["copies_s"] += time.perf_counter() - t
        stats["bytes"] += length
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            dtype = getattr(torch, DTYPES[info["dtype"]][0])
            yield name, section[start:end].view(dtype).view(tuple(info["shape"]))
        del section


def restore_stack(worker) -> int | None:
    """The stack limit coldsnap_release_stack took away, set back (before the engine's next kernel); its bytes."""
    stack_bytes = getattr(worker, "_coldsnap_stack_bytes", None)
    if stack_bytes:
        set_stack_limit(stack_bytes)
        worker._coldsnap_stack_bytes = None
    return stack_bytes


class ColdSnapWorker:
    """Mixed into vLLM's Worker by --worker-extension-cls; `self` is the worker (model_runner, model_config)."""

    def coldsnap_release_stack(self) -> dict[str, Any]:
        """Before the CUDA checkpoint (vLLM asleep): the driver's per-thread stack reserve given back, so that the
        checkpoint saves and the restore copies back that much less device memory (coldsnap.gpu.libcuda)."""
        import torch

        torch.cuda.synchronize()  # torch's context current on this thread, and nothing of it in flight
        before = set_stack_limit(0)
        if before:  # a second release (asleep again before any resume) keeps the first value
            self._coldsnap_stack_bytes = before
        return {"stack_bytes": before}

    def coldsnap_restore_stack(self) -> dict[str, Any]:
        return {"stack_bytes": restore_stack(self)}

    def coldsnap_reload_weights(self, options: str = "{}") -> dict[str, Any]:
        import torch

        opts = json.loads(options)
        t0 = time.perf_counter()
        device = torch.cuda.current_device()
        restore_stack(self)
        files = weight_files(self.model_config.model)  # type: ignore[attr-defined]
        if not files:
            raise FileNotFoundError(f"no safetensors files in {self.model_config.model}")  # type: ignore[attr-defined]
        prefetched = {str(Path(k).resolve()): v for k, v in (opts.get("prefetched") or {}).items()}
        stats: dict[str, Any] = {"copies_s": 0.0, "bytes": 0, "prefetched": 0, "filled": 0, "errors": []}
        # direct: the model's own weight loaders copy each tensor straight into the parameters (the memory the CUDA
        # graphs point at), as at its first load; vLLM's layerwise reload builds each layer anew and copies it over,
        # which a quantized model's processing needs and an unquantized one does not
        direct = opts.get("reload") == "direct" and self.model_config.quantization is None  # type: ignore[attr-defined]
        with ExitStack() as held:
            weights = tensors_on_gpu(files, device, int(opts.get("threads", 8)), prefetched, held, stats)
            if direct:
                with torch.no_grad():
                    self.model_runner.get_model().load_weights(weights)  # type: ignore[attr-defined]
            else:
                self.model_runner.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
            torch.cuda.synchronize(device)  # every copy out of the mapped memory done before it is unmapped
        torch.cuda.empty_cache()  # the copies filled here: room for the KV cache woken next
        total = time.perf_counter() - t0
        return {"files": len(files), "bytes": int(stats["bytes"]), "prefetched": stats["prefetched"],
                "reload": "direct" if direct else "layerwise",
                "filled": stats["filled"], "copies_s": round(stats["copies_s"], 3), "total_s": round(total, 3),
                "gb_per_s": round(stats["bytes"] / total / 1e9, 2), **({"errors": stats["errors"]}
                                                                       if stats["errors"] else {})}
