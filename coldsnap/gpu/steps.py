"""GPU step of capture/restore: checkpoint the CUDA state of every CUDA process of a tree, or say there is none.

A thin seam over coldsnap.gpu so flows stay readable and CPU-only hosts never load libcuda."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping
from uuid import uuid4

from coldsnap.base.paths import settings
from coldsnap.base.soon import Soon


@dataclass
class GpuCheckpoint:
    pids: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    summary: str = "no CUDA processes"
    gpu_uuids: list[str] = field(default_factory=list)  # the GPUs they use, by index (known at checkpoint)
    per_pid: dict[str, dict[str, float]] = field(default_factory=dict)  # each process's own seconds per step


def checkpoint_tree(root_pid: int) -> GpuCheckpoint:
    from coldsnap.gpu.cuda_checkpoint import CudaCheckpointAPI

    api = CudaCheckpointAPI()
    if not api.available():
        return GpuCheckpoint(summary="no CUDA processes (no CUDA driver with the checkpoint API on this host)")
    from coldsnap.contracts import ColdSnapError, ErrorCode
    from coldsnap.gpu import tree

    found = tree.cuda_pids(root_pid, api)
    foreign = tree.foreign_nvidia_mappings(root_pid, found)
    if foreign:  # CRIU would fail on them ("Can't handle non-regular mapping"): refuse by name, workload untouched
        raise ColdSnapError(ErrorCode.GPU_FAILED, tree.describe_foreign(foreign))
    from coldsnap.gpu.nvml import gpus_used_by

    used = gpus_used_by(found)  # while their contexts are still on the GPUs
    report = tree.checkpoint_tree(root_pid, pids=found, api=api)
    pids = list(report.pids)
    if not pids:
        return GpuCheckpoint(summary="no CUDA processes")
    return GpuCheckpoint(pids=pids, seconds=dict(report.seconds), gpu_uuids=used,
                         summary=f"CUDA state of {len(pids)} process(es) checkpointed")


def resume_in_place(ckpt: GpuCheckpoint, gpu_pairs=None) -> GpuCheckpoint:
    """The CUDA state of a tree checkpointed in place (a --leave-running capture, a wake), restored + unlocked:
    the same processes, the same PIDs."""
    if not ckpt.pids:
        return ckpt
    from coldsnap.gpu import tree

    report = tree.restore_tree(ckpt.pids, gpu_pairs=gpu_pairs)
    return GpuCheckpoint(pids=list(report.pids), seconds=dict(report.seconds),
                         summary=f"CUDA state of {len(ckpt.pids)} process(es) restored")


def restore_after_criu(root_pid: int, gpu_pairs=None) -> GpuCheckpoint:
    """After `criu restore`: restore + unlock every process of the tree whose CUDA state is checkpointed.
    Their host PIDs are new (the PID namespace kept the inner ones), so find them again."""
    from coldsnap.gpu.cuda_checkpoint import CudaCheckpointAPI

    api = CudaCheckpointAPI()
    if not api.available():
        return GpuCheckpoint(summary="no CUDA processes (no CUDA driver on this host)")
    from coldsnap.gpu import tree

    pids = tree.checkpointed_pids(root_pid)
    if not pids:
        return GpuCheckpoint(summary="no CUDA processes")
    report = tree.restore_tree(pids, gpu_pairs=gpu_pairs)
    return GpuCheckpoint(pids=list(report.pids), seconds=dict(report.seconds),
                         per_pid={str(p): {k: round(v, 4) for k, v in s.items()} for p, s in report.per_pid.items()},
                         summary=f"CUDA state of {len(pids)} process(es) restored")


# --- weights prefetch (coldsnap.gpu.prefetch) --------------------------------------------------------------------
@dataclass
class Prefetch:
    """Prefetchers loading the weights onto the workload's GPUs while the restore goes on (one per GPU: each
    tensor-parallel rank takes its shard from the copy on its own GPU; or, by_file, one per weights file of a
    one-GPU workload whose weights are several files), or why there are none."""

    sockets: dict[str, str] = field(default_factory=dict)  # GPU UUID (by_file: file path) → the prefetcher's socket
    procs: list = field(default_factory=list)  # their subprocess.Popen, in the same order
    skipped: str | None = None
    by_file: bool = False
    feeders: list = field(default_factory=list)  # threads telling prefetchers of a file still arriving its pieces
    said: list = field(default_factory=list)  # what each prefetcher printed before its report, once read (loaded)
    direct: bool = False  # its one prefetcher fetches the weights from the registry itself (coldsnap.gpu.direct)
    report: dict | None = None  # what finish_prefetch found, once it has reaped them

    def loaded(self, timeout: float) -> bool:
        """Whether every prefetcher has its weights on the GPU, waiting up to `timeout` for each to say (its first
        line): the engine may then take them without reading its files. False when there are none."""
        if not self.procs:
            return False
        deadline = time.monotonic() + timeout
        while len(self.said) < len(self.procs):
            proc, got = self.procs[len(self.said)], b""
            while b"\n" not in got:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                    break
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                got += chunk
            self.said.append(got)
            if b"\n" not in got:
                return False
        try:
            return all(json.loads(said.split(b"\n", 1)[0]).get("loaded") is True for said in self.said)
        except ValueError:
            return False

    def for_engine(self):
        """What the engine's resume is given: the socket (one GPU), {GPU UUID: socket} (ranks), {file: socket}
        (by_file), or None."""
        if len(self.sockets) == 1 and not self.by_file:
            return next(iter(self.sockets.values()))
        return dict(self.sockets) or None


def _prefetch_refusal(profile, supported: bool, by_file: bool = False) -> str | None:
    """Why this restore gets no prefetch (None: it does). supported: the engine takes prefetched weights and this
    restore reloads them from a file; by_file: it takes them file by file (one rank, any number of files)."""
    weights = profile.model.weights if profile.model else []
    if not settings().prefetch:
        return "COLDSNAP_PREFETCH=0"
    if not supported:
        return f"the {profile.engine.name} engine does not reload weights from a file on this restore"
    if not profile.cuda_pids or not profile.gpus_used:
        return "no CUDA process, or no record of the GPUs it used"
    ranks = profile.distributed.world_size if profile.distributed else 1
    if len(profile.gpus_used) != ranks:
        return f"{len(profile.gpus_used)} GPU(s) used by {ranks} rank(s): not one GPU a rank"
    if by_file:
        return None if ranks == 1 and weights else "several ranks, or no weights files: not prefetched by file"
    if len(weights) != 1:
        return "the weights are not one file"
    return None


@dataclass
class Streaming:
    """A weights file still arriving (a streamed pull): the ranges of it checked against their pins, as they come,
    and descriptors of the memory they land in first (coldsnap.capsule.pieces.SpoolFds; None: the file itself),
    which start_prefetch_soon closes. direct: waits for and returns the pieces the pull offers a prefetcher to
    fetch from the registry itself (None: it offers none); decline: tells the pull nobody will, so it fetches them.
    """
    ranges: Iterable[tuple[int, int]]
    spool: Any = None
    direct: Callable[[], dict | None] | None = None
    decline: Callable[[], None] | None = None


def _prefetcher(args: list[str], **popen) -> subprocess.Popen:
    """A prefetcher process (coldsnap.gpu.prefetch) with these arguments, its stdio piped, in a session of its own;
    the GPUs named by UUID, whatever CUDA_VISIBLE_DEVICES says here."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.Popen([sys.executable, "-m", "coldsnap.gpu.prefetch", *args], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **popen)


class Standby:
    """A prefetcher started before the restore knows what it prefetches (python -m coldsnap.gpu.prefetch --standby):
    its interpreter, imports and CUDA's start (~0.3 s) paid while the pull waits on the registry. start_prefetch
    gives it its arguments (take), or it is dismissed; either way once. Whoever started it reaps it at the end."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = _prefetcher(["--standby"])
        self.dismissed: subprocess.Popen | None = None

    def take(self, args: list[str]) -> subprocess.Popen:
        """The prefetcher, now running with `args` (its own arguments, as start_prefetch would start it with)."""
        proc, self.proc = self.proc, None
        assert proc is not None and proc.stdin is not None, "a standby prefetcher is taken once"
        proc.stdin.write(json.dumps(args).encode() + b"\n")
        proc.stdin.flush()
        return proc

    def dismiss(self) -> None:
        """Not needed (or not any more): its stdin ends, and it exits once CUDA has started. Waits for nothing."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.stdin is not None:
            with suppress(OSError):
                proc.stdin.close()
            self.dismissed = proc

    def reap(self, wait_s: float = 5.0) -> int | None:
        """Dismissed (if it was not taken) and gone: its exit status (None: taken, the prefetch reaps it)."""
        self.dismiss()
        proc, self.dismissed = self.dismissed, None
        if proc is None:
            return None
        try:  # dismissed, it writes nothing (a pipe it could fill would need communicate)
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        return proc.returncode


def stand_by() -> Standby | None:
    """A standby prefetcher, where one can be of use: COLDSNAP_PREFETCH is not 0 and this host has an NVIDIA driver.
    None otherwise, or where it cannot start (no prefetch is only slower)."""
    if not settings().prefetch or not os.path.exists("/dev/nvidiactl"):
        return None
    try:
        return Standby()
    except OSError:
        return None


def start_prefetch(profile, supported: bool, gpu_map: dict[str, str], run_dir, by_file: bool = False,
                   arrivals: Mapping[str, Streaming] | None = None, standby: Standby | None = None) -> Prefetch:
    """Start a prefetcher on each GPU of the workload when the restore will reload weights from one file, each GPU
    has room for a second copy of what it loads for a moment, and COLDSNAP_PREFETCH is not 0. A tensor-parallel
    capsule's plan (profile.prefetch_plans) has each GPU load only its rank's part. by_file (an engine that takes
    its weights file by file, on one GPU): a prefetcher for each weights file, the readers shared among them.
    arrivals: weights files still arriving (a streamed pull), each with the ranges of it checked against their pins
    as they come: their prefetchers load those, as they come, and nothing else, from the spool where there is one.
    standby: started ahead (stand_by): the one prefetcher of a direct pull is that one (any other is started here);
    dismissed when there is none. Never raises: no prefetch is only slower."""
    try:
        return _start_prefetch(profile, supported, gpu_map, run_dir, by_file, arrivals, standby)
    finally:
        if standby is not None:
            standby.dismiss()  # taken, or not needed


def _start_prefetch(profile, supported: bool, gpu_map: dict[str, str], run_dir, by_file: bool,
                    arrivals: Mapping[str, Streaming] | None, standby: Standby | None) -> Prefetch:
    from coldsnap.base.files import write_run_state
    from coldsnap.gpu.nvml import free_bytes
    from coldsnap.gpu.prefetch import MODES, gpu_key, packed_layout

    why = _prefetch_refusal(profile, supported, by_file)
    if why:
        return Prefetch(skipped=why)
    files = profile.model.weights
    plans = {gpu_key(g): pieces for g, pieces in profile.prefetch_plans.items()}
    # (key, GPU now, the file, the pieces of it its rank holds or None: all of it)
    if by_file:
        gpu = gpu_map.get(profile.gpus_used[0], profile.gpus_used[0])
        targets = [(w.path, gpu, w, None) for w in files]
    else:
        targets = [(gpu_map.get(u, u), gpu_map.get(u, u), files[0], plans.get(gpu_key(u))) for u in profile.gpus_used]
    room: dict[str, int] = {}  # bytes each GPU loads
    for _, gpu, w, pieces in targets:
        room[gpu] = room.get(gpu, 0) + (packed_layout(pieces)[1] if pieces else w.size)
    for gpu, size in room.items():
        free = free_bytes(gpu)
        if free is None or free < 2 * size + (8 << 30):
            return Prefetch(skipped=f"not enough free memory on {gpu} for a second copy of the weights")
    threads = settings().prefetch_threads  # readers per prefetcher (they compete with CRIU)
    if not threads.isdigit() or int(threads) < 1:
        return Prefetch(skipped=f"COLDSNAP_PREFETCH_THREADS={threads!r} is not a positive number")
    mode = settings().prefetch_mode  # how the weights reach the GPU (prefetch.MODES)
    if mode == "auto":  # several prefetchers reading side by side beside CRIU: the GPU copies from the page cache,
        mode = "mapped" if by_file and len(targets) > 1 else "buffered"  # each byte crossing host memory once
    if mode not in MODES:
        return Prefetch(skipped=f"COLDSNAP_PREFETCH_MODE={mode!r} is not one of auto, {', '.join(MODES)}")
    once_served = ["--hold"]  # the copy kept until the restore is done (freeing it slowed the first request down)
    if by_file:  # the readers shared among the files' prefetchers; each copy freed once taken, for the engine maps
        threads = str(max(1, int(threads) // len(targets)))  # its KV cache next, where the copies were
        once_served = ["--linger"] if settings().prefetch_linger else []  # contexts go after the first token
    p = Prefetch(by_file=by_file)
    for key, gpu, weights, pieces in targets:
        name = f"{run_dir}/{uuid4().hex[:12]}"
        sock = name + ".sock"
        if len(sock.encode()) > 100:
            return _abandon(p, "the socket path would be too long")
        p.sockets[key] = sock  # from here on its files are removed whatever happens
        try:
            plan: list[str] = []
            if pieces:
                write_run_state(name + ".plan.json", json.dumps(pieces).encode())
                plan = ["--plan", name + ".plan.json"]
            streaming = (arrivals or {}).get(weights.path)
            # straight from the registry: one prefetcher, loading a whole file, the pull offering its pieces
            direct = streaming is not None and streaming.direct is not None and len(targets) == 1 and not pieces
            spool = streaming.spool if streaming else None
            spooled = ["--spool-fds", ",".join(map(str, spool.fds)), "--spool-piece-bytes", str(spool.piece_bytes)] \
                if spool is not None else []
            args = ["--file", weights.path, "--gpu", gpu, "--socket", sock, *once_served, "--threads", threads,
                    "--mode", mode, *plan, *(["--direct"] if direct else ["--arrivals"] if streaming else []),
                    *spooled]
            if direct and standby is not None and standby.proc is not None:
                proc = standby.take(args)
            else:
                proc = _prefetcher(args, pass_fds=spool.fds if spool is not None else ())
            p.procs.append(proc)
            if direct:
                assert streaming is not None and streaming.direct is not None
                p.direct = True
                feeder = threading.Thread(target=_feed_direct, args=(proc, streaming.direct), daemon=True,
                                          name="coldsnap-direct-job")
                feeder.start()
                p.feeders.append(feeder)
            elif streaming:
                feeder = threading.Thread(target=_feed, args=(proc, streaming.ranges), daemon=True,
                                          name="coldsnap-arrivals")
                feeder.start()
                p.feeders.append(feeder)
        except OSError as e:
            return _abandon(p, f"could not start the prefetcher: {e}")  # its plan file included
    return p


def _feed(proc, ranges: Iterable[tuple[int, int]]) -> None:
    """Tell a prefetcher (--arrivals) of each range of its file as it is checked, then that no more come."""
    try:
        for offset, length in ranges:
            proc.stdin.write(f"{offset} {length}\n".encode())
            proc.stdin.flush()
        proc.stdin.write(b"end\n")
        proc.stdin.flush()
    except (OSError, ValueError):
        pass  # gone, or reaped already (finish_prefetch closed its stdin): nothing more to tell it


def _feed_direct(proc, job: Callable[[], dict | None]) -> None:
    """Give a prefetcher (--direct) the pieces the pull offers, once it does ("null": none; the prefetcher then
    loads nothing and the engine reads its file). The stdin stays open: the prefetcher holds its copy until it
    closes."""
    try:
        proc.stdin.write(json.dumps(job()).encode() + b"\n")
        proc.stdin.flush()
    except (OSError, ValueError):
        pass  # gone, or reaped already


def start_prefetch_soon(profile, supported: bool, gpu_map: dict[str, str], run_dir,
                        by_file: bool = False, arrivals: Mapping[str, Streaming] | None = None,
                        standby: Standby | None = None) -> Callable[[], Prefetch]:
    """start_prefetch on a thread of its own, so the restore does not wait for its NVML queries and process starts
    (~10 ms); the answer, called, waits for it and returns the Prefetch."""
    def start() -> Prefetch:
        p = None
        try:
            p = start_prefetch(profile, supported, gpu_map, run_dir, by_file, arrivals, standby)
        except Exception as e:  # noqa: BLE001 - no prefetch is only slower; say why in the receipt
            p = Prefetch(skipped=f"starting the prefetchers failed: {e}")
        finally:  # the prefetchers have their own descriptors of the spools by now
            for streaming in (arrivals or {}).values():
                if streaming.spool is not None:
                    streaming.spool.close()
                if streaming.decline is not None and not getattr(p, "direct", False):
                    streaming.decline()  # no prefetcher fetches them: the pull does, now
        return p

    return Soon(start, "coldsnap-prefetch-start").result


def _abandon(p: Prefetch, why: str) -> Prefetch:
    for proc in p.procs:
        proc.kill()
        proc.communicate()
    for sock in p.sockets.values():
        _remove_files(sock)
    return Prefetch(skipped=why)


def _remove_files(sock: str) -> None:
    """A prefetcher's socket and its plan, if they are still there."""
    for path in (sock, sock.removesuffix(".sock") + ".plan.json"):
        with suppress(FileNotFoundError):
            os.unlink(path)


def finish_prefetch(p: Prefetch, wait_s: float = 10.0) -> dict:
    """Reap the prefetchers: what they reported (one GPU: its report; several: by GPU UUID). One that served an
    engine has removed its socket and frees its copy once its stdin closes, here; one whose socket is still there
    would wait for an engine that is not coming, and is killed. Once reaped, the same report again."""
    if p.report is None:
        p.report = _reap(p, wait_s)
    return p.report


def _reap(p: Prefetch, wait_s: float) -> dict:
    if not p.procs:
        return {"skipped": p.skipped}
    reports = {}
    for i, ((key, sock), proc) in enumerate(zip(p.sockets.items(), p.procs)):
        if os.path.exists(sock):
            proc.kill()
        try:
            out, err = proc.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        _remove_files(sock)
        out = (p.said[i] if i < len(p.said) else b"") + out
        lines = [line for line in out.decode(errors="replace").splitlines()
                 if line.startswith("{") and not line.startswith('{"loaded"')]  # its report, not the first line
        if lines:
            reports[key] = json.loads(lines[-1])
        else:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            reports[key] = {"error": f"the prefetcher reported nothing: {tail[0][:300]}"}
    if len(reports) == 1 and not p.by_file:
        return next(iter(reports.values()))
    return {"per_file" if p.by_file else "per_gpu": reports}


def memory_held(root_pid: int) -> dict[str, int]:
    """GPU UUID → bytes the tree rooted at root_pid holds there now (NVML); {} without NVML or CUDA."""
    from coldsnap.base.procfs import descendants
    from coldsnap.gpu.nvml import memory_used_by

    return memory_used_by([root_pid, *descendants(root_pid)])


def refuse_without_room(profile, gpu_map: dict[str, str]) -> None:
    """Before a restore makes anything: each GPU it lands on must have the room the workload held there while it
    served at capture (another replica or workload may hold the rest). RESOURCE_BUSY names the first one short."""
    from coldsnap.contracts import ColdSnapError, ErrorCode
    from coldsnap.gpu.nvml import free_bytes

    for uuid, need in profile.gpu_memory.items():
        gpu = gpu_map.get(uuid, uuid)
        free = free_bytes(gpu)
        if free is not None and free < need:
            raise ColdSnapError(ErrorCode.RESOURCE_BUSY, f"GPU {gpu} has {free / 2**30:.1f} GiB free; the workload "
                                f"needs {need / 2**30:.1f} GiB there (another workload holds the rest)")
