"""Weights prefetched onto the GPU during a restore (coldsnap.gpu.prefetch) and taken by the engine at resume.

The hand-over itself needs a GPU (it runs on the device machine); without one the prefetcher must still answer the
engine with its reason, and the engine must reload from the file instead: that path runs everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

torch = pytest.importorskip("torch")

from coldsnap.gpu.prefetch import ALIGN, check_pieces, copy_jobs, data_section, packed_layout, read_bytes, split_jobs  # noqa: E402
from coldsnap_reference.model import ModelConfig, Runner, build_model, decode, encode, shards  # noqa: E402
from coldsnap_reference.weights import (  # noqa: E402
    ensure_weights,
    load_prefetched,
    load_weights,
    packed_parts,
    prefetch_plan,
    read_header,
)

TINY = ModelConfig(layers=1, hidden=64, heads=2, intermediate=176, max_seq=64, prefill_chunk=16)


def start_prefetcher(weights: str, gpu: str, sock: str, plan=None, mode: str = "mapped") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap.gpu.prefetch", "--file", weights, "--gpu", gpu,
                             "--socket", sock, "--timeout", "60", "--mode", mode,
                             *(["--plan", str(plan)] if plan else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not __import__("os").path.exists(sock):  # it listens before it loads
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the prefetcher did not listen"
        time.sleep(0.02)
    return proc


def report_of(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=60)
    lines = out.decode().strip().splitlines()
    assert lines, err.decode()
    return json.loads(lines[-1])


def test_an_engine_whose_prefetch_fails_reloads_from_the_file_and_says_why(tmp_path):
    """A prefetcher that cannot load (here: no GPU with that UUID, or no GPU at all) tells the engine why over the
    socket; the engine's resume reloads from the file, gives the same output, and reports the reason."""
    path = ensure_weights(tmp_path / "w.safetensors", TINY)
    runner = Runner(build_model(TINY, load_weights(path, mode="copy"), "cpu"), "cpu", kv_bytes=1 << 20)
    before = decode(list(runner.generate(encode("Hello, world!"), 8)))
    runner.release(save_to=str(tmp_path / "saved.safetensors"))  # weights dropped, to be reloaded at resume
    sock = str(tmp_path / "p.sock")
    proc = start_prefetcher(str(tmp_path / "saved.safetensors"), "GPU-00000000-0000-0000-0000-000000000000", sock)
    resumed = runner.resume(prefetched=sock)
    reload = resumed["weights_reload"]
    assert "prefetch_error" in reload and "the prefetcher failed" in reload["prefetch_error"], reload
    assert reload.get("prefetched") is None and reload["bytes"] > 0  # from the file
    assert decode(list(runner.generate(encode("Hello, world!"), 8))) == before
    report = report_of(proc)
    assert report["served"] is True and report["error"] and proc.returncode == 1
    assert not __import__("os").path.exists(sock)  # the prefetcher removed its socket


def test_the_prefetcher_refuses_a_missing_file_with_a_one_line_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "coldsnap.gpu.prefetch", "--file", str(tmp_path / "nope"),
                          "--gpu", "GPU-x", "--socket", str(tmp_path / "s"), "--timeout", "1"],
                         capture_output=True, text=True, timeout=60)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 1 and report["served"] is False and "error" in report
    assert "Traceback" not in out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the hand-over maps GPU memory")
@pytest.mark.parametrize("mode", ["mapped", "buffered"])
@pytest.mark.parametrize("tp_rank,planned", [(None, False), (1, False), (1, True)],
                         ids=["whole", "tp-shard", "tp-shard-planned"])
def test_prefetched_weights_reach_the_engine_bit_for_bit(tmp_path, tp_rank, planned, mode):
    """Either way onto the GPU (the file's own pages registered with the driver, or pinned buffers), whole or a
    rank's plan (a part of every row: 2D copies), the engine gets the tensors it would load from the file."""
    cfg = ModelConfig(layers=2, hidden=512, heads=8, intermediate=1408, max_seq=64, prefill_chunk=16)
    path = ensure_weights(tmp_path / "w.safetensors", cfg)
    mine = shards(cfg, 2, tp_rank) if tp_rank is not None else None
    want = load_weights(path, "cuda", shards=mine)
    params = {n: torch.zeros_like(t) for n, t in want.items()}
    uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
    sock = str(tmp_path / "p.sock")
    plan = None
    if planned:  # only rank 1's parts go onto the GPU, packed
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps(prefetch_plan(path, list(params), mine)))
    proc = start_prefetcher(path, uuid, sock, plan, mode)
    stats = load_prefetched(path, params, sock, shards=mine)
    assert stats["prefetched"] is True and stats["bytes"] == sum(t.numel() * 4 for t in want.values())
    for n in want:
        assert torch.equal(params[n], want[n]), n
    report = report_of(proc)
    assert report["served"] is True and "error" not in report and proc.returncode == 0, report
    assert report["mode"] == mode and "mapped_error" not in report, report  # just written: in the page cache
    if mode == "mapped":
        assert report["mapped"]["windows"] >= 1 and report["mapped"]["unregister_s"] >= 0, report
    if planned:  # it moved this rank's share, not the file
        assert report["pieces"] == len(params) and report["bytes"] < 0.6 * data_section(path)[1], report
    print(json.dumps({"engine": stats, "prefetcher": report}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the prefetcher loads onto it")
def test_a_file_changed_after_its_load_is_not_taken_from_the_prefetcher(tmp_path):
    """The bytes a prefetcher read from a file are the file as it was then: written to since (its mtime moved), it
    is another file to the engine, which refuses the copy (and, in a resume, reloads from the file)."""
    from coldsnap.gpu.prefetch import PrefetchError

    path = ensure_weights(tmp_path / "w.safetensors", TINY)
    params = {n: torch.zeros_like(t) for n, t in load_weights(path, "cuda").items()}
    sock = str(tmp_path / "p.sock")
    proc = start_prefetcher(path, "GPU-" + str(torch.cuda.get_device_properties(0).uuid), sock, mode="buffered")
    try:
        assert json.loads(proc.stdout.readline())["loaded"] is True
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with pytest.raises(PrefetchError, match="loaded another file than"):
            load_prefetched(path, params, sock)
    finally:
        proc.kill()
        proc.wait()


def _drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_the_mapped_fill_sees_how_much_of_the_file_is_in_the_page_cache(tmp_path):
    """The mapped fill pays only when the page cache holds the file; mincore says how much it holds."""
    from coldsnap.gpu.prefetch import FileMapping

    path = tmp_path / "f"
    path.write_bytes(os.urandom(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, 4 << 20)
        mapping = FileMapping(fd)
        try:
            assert mapping.resident(0, 4 << 20) == 1.0
            _drop_from_page_cache(str(path))
            if mapping.resident(0, 4 << 20) > 0.5:
                pytest.skip(f"{tmp_path} keeps files in memory whatever is advised (tmpfs?): nothing to measure")
            assert mapping.resident(0, 4 << 20) < 0.5
        finally:
            mapping.close()
    finally:
        os.close(fd)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the hand-over maps GPU memory")
def test_a_file_not_in_the_page_cache_is_read_through_buffers_and_the_report_says_why(tmp_path):
    cfg = ModelConfig(layers=2, hidden=512, heads=8, intermediate=1408, max_seq=64, prefill_chunk=16)
    path = ensure_weights(tmp_path / "w.safetensors", cfg)
    _drop_from_page_cache(path)
    want = load_weights(path, "cuda")
    _drop_from_page_cache(path)  # reading it brought it back
    params = {n: torch.zeros_like(t) for n, t in want.items()}
    uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
    proc = start_prefetcher(path, uuid, str(tmp_path / "p.sock"))
    stats = load_prefetched(path, params, str(tmp_path / "p.sock"))
    assert stats["prefetched"] is True and all(torch.equal(params[n], want[n]) for n in want)
    report = report_of(proc)
    if "page cache" not in report.get("mapped_error", "") and report["mode"] == "mapped":
        pytest.skip(f"{tmp_path} keeps files in memory whatever is advised (tmpfs?): {report}")
    assert report["mode"] == "buffered" and "page cache" in report["mapped_error"], report


# --- a tensor-parallel rank's plan: only its parts, packed ---------------------------------------------------------
def _run_jobs_on_the_host(path: str, pieces, chunk: int, window: int | None = None) -> bytearray:
    """What a fill does on the GPU, done with bytes: each job reads its range, copies `rows` rows of `width`.
    window: the jobs cut at multiples of it in the file, as the mapped fill cuts them; none may read across one."""
    from coldsnap.gpu.prefetch import cut_at_windows

    base, length = data_section(path)
    data = open(path, "rb").read()[base:]
    packed = bytearray(packed_layout(pieces)[1])
    jobs = copy_jobs(pieces, chunk)
    if window:
        jobs = cut_at_windows(jobs, base, window)
        assert all((base + j[0]) // window == (base + j[0] + read_bytes(j) - 1) // window for j in jobs)
    for offset, pitch, width, rows, dst in jobs:
        assert read_bytes((offset, pitch, width, rows, dst)) <= max(chunk, width)
        read = data[offset:offset + read_bytes((offset, pitch, width, rows, dst))]
        for r in range(rows):
            packed[dst + r * width:dst + (r + 1) * width] = read[r * pitch:r * pitch + width]
    return packed


@pytest.mark.parametrize("chunk,window", [(16 << 20, None), (3000, None), (100, None), (3000, 4096), (100, 256)],
                         ids=["chunks", "rows-per-job", "parts-of-rows", "rows-cut-at-windows",
                              "parts-cut-at-windows"])
def test_a_ranks_plan_packs_exactly_its_shards(tmp_path, chunk, window):
    """Each rank's plan covers its shards (whole tensors, dim-0 ranges, a part of every row for dim 1), and the
    packed memory, cut into jobs of any size, holds the same tensors the engine loads from the file."""
    cfg = ModelConfig(layers=2, hidden=64, heads=4, intermediate=176, max_seq=64, prefill_chunk=16)
    path = ensure_weights(tmp_path / "w.safetensors", cfg)
    _, header = read_header(path)
    length = data_section(path)[1]
    sizes = []
    for rank in (0, 1):
        mine = shards(cfg, 2, rank)
        assert {s.dim for s in mine.values()} == {0, 1}  # both kinds of split are exercised
        want = load_weights(path, "cpu", mode="copy", shards=mine)
        names = list(want)
        pieces = prefetch_plan(path, names, mine)
        check_pieces(pieces, length)
        starts, size = packed_layout(pieces)
        assert all(s % ALIGN == 0 for s in starts) and size < length
        sizes.append(size)
        packed = _run_jobs_on_the_host(path, pieces, chunk, window)
        parts = packed_parts(torch.frombuffer(packed, dtype=torch.uint8), header, names, mine)
        for n in names:
            assert torch.equal(parts[n], want[n]), (rank, n)
    assert sizes[0] == sizes[1]  # the ranks hold equal shares


def test_jobs_are_shared_out_in_file_order_and_a_piece_outside_the_file_is_refused():
    jobs = copy_jobs([(0, 10 << 20, 1, 10 << 20), (20 << 20, 100, 1000, 200)], chunk=1 << 20)
    groups = split_jobs(jobs, 4)
    assert len(groups) <= 4 and [j for g in groups for j in g] == jobs
    loads = [sum(read_bytes(j) for j in g) for g in groups]
    assert max(loads) < 1.5 * sum(loads) / len(groups)
    with pytest.raises(ValueError, match="piece 1"):
        check_pieces([(0, 10, 1, 10), (90, 20, 1, 20)], 100)
    with pytest.raises(ValueError, match="piece 0"):
        check_pieces([(0, 30, 2, 20)], 100)  # wider than its pitch


def test_the_prefetcher_refuses_a_bad_plan_with_a_one_line_error(tmp_path):
    path = ensure_weights(tmp_path / "w.safetensors", TINY)
    (tmp_path / "plan.json").write_text("{not json")
    out = subprocess.run([sys.executable, "-m", "coldsnap.gpu.prefetch", "--file", path, "--gpu", "GPU-x",
                          "--socket", str(tmp_path / "s"), "--plan", str(tmp_path / "plan.json")],
                         capture_output=True, text=True, timeout=60)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 1 and report["served"] is False and "--plan" in report["error"]
    assert "Traceback" not in out.stderr


def test_a_restore_hands_each_gpu_its_ranks_plan_and_cleans_up(monkeypatch, tmp_path):
    from coldsnap.gpu.steps import finish_prefetch, start_prefetch

    path = ensure_weights(tmp_path / "w.safetensors", TINY)
    pieces = [[0, 256, 1, 256], [1024, 64, 4, 128]]
    profile = _profile(gpus_used=["GPU-0000aaaa", "GPU-0000bbbb"], distributed=NS(world_size=2),
                       prefetch_plans={"GPU-0000aaaa": pieces},  # GPU b: no plan, the whole file
                       model=NS(weights=[NS(path=path, size=1 << 20)]))
    monkeypatch.setattr("coldsnap.gpu.nvml.free_bytes", lambda gpu: 64 << 30)
    p = start_prefetch(profile, True, {"GPU-0000bbbb": "GPU-0000cccc"}, tmp_path)
    assert p.skipped is None and list(p.sockets) == ["GPU-0000aaaa", "GPU-0000cccc"]
    a, c = (proc.args for proc in p.procs)
    plan = a[a.index("--plan") + 1]
    assert json.loads(open(plan).read()) == pieces and os.stat(plan).st_mode & 0o777 == 0o600
    assert "--plan" not in c and a[a.index("--threads") + 1] == "8" and a[a.index("--mode") + 1] == "buffered"
    deadline = time.monotonic() + 30
    while not all(os.path.exists(sock) for sock in p.sockets.values()):  # they listen, waiting for an engine
        assert time.monotonic() < deadline, "the prefetchers did not listen"
        time.sleep(0.02)
    finish_prefetch(p)
    assert list(tmp_path.glob("*.plan.json")) == [] and list(tmp_path.glob("*.sock")) == []
    monkeypatch.setenv("COLDSNAP_PREFETCH_THREADS", "lots")
    assert "COLDSNAP_PREFETCH_THREADS='lots'" in start_prefetch(profile, True, {}, tmp_path).skipped
    monkeypatch.delenv("COLDSNAP_PREFETCH_THREADS")
    monkeypatch.setenv("COLDSNAP_PREFETCH_MODE", "dma")
    assert "COLDSNAP_PREFETCH_MODE='dma' is not one of auto, buffered, mapped" in \
        start_prefetch(profile, True, {}, tmp_path).skipped


# --- when a restore prefetches, and reaping the prefetchers ----------------------------------------------------
def _profile(**over):
    from types import SimpleNamespace as NS

    base = dict(engine=NS(name="reference"), cuda_pids=1, gpus_used=["GPU-a"], distributed=None, prefetch_plans={},
                model=NS(weights=[NS(path="/models/w.safetensors", size=10 << 30)]))
    return NS(**{**base, **over})


def test_a_restore_prefetches_only_where_it_can_help_and_says_why_not(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    from coldsnap.gpu.steps import _prefetch_refusal, start_prefetch, start_prefetch_soon

    assert _prefetch_refusal(_profile(), True) is None
    assert "does not reload weights" in _prefetch_refusal(_profile(), False)
    assert "no CUDA process" in _prefetch_refusal(_profile(cuda_pids=0), True)
    assert "not one GPU a rank" in _prefetch_refusal(_profile(distributed=NS(world_size=2)), True)
    assert _prefetch_refusal(_profile(distributed=NS(world_size=2), gpus_used=["GPU-a", "GPU-b"]), True) is None
    two_files = NS(weights=[NS(path="a", size=1), NS(path="b", size=1)])
    assert "not one file" in _prefetch_refusal(_profile(model=two_files), True)
    monkeypatch.setenv("COLDSNAP_PREFETCH", "0")
    assert start_prefetch(_profile(), True, {}, tmp_path).skipped == "COLDSNAP_PREFETCH=0"
    monkeypatch.delenv("COLDSNAP_PREFETCH")
    # Room for a second copy is checked on the GPU the restore maps to (NVML); no answer means no prefetch.
    monkeypatch.setattr("coldsnap.gpu.nvml.free_bytes", lambda gpu: 64 << 30 if gpu == "GPU-big" else 4 << 30)
    assert "not enough free memory on GPU-a" in start_prefetch(_profile(), True, {}, tmp_path).skipped
    assert "GPU-small" in start_prefetch(_profile(), True, {"GPU-a": "GPU-small"}, tmp_path).skipped
    # The restore starts them on a thread of its own and takes the same answer when it needs it.
    assert "GPU-small" in start_prefetch_soon(_profile(), True, {"GPU-a": "GPU-small"}, tmp_path)().skipped
    monkeypatch.setattr("coldsnap.gpu.nvml.free_bytes", lambda gpu: 1 / 0)  # whatever goes wrong, no traceback
    assert "division by zero" in start_prefetch_soon(_profile(), True, {}, tmp_path)().skipped


def test_the_engine_gets_a_socket_for_one_gpu_and_a_map_for_ranks():
    from coldsnap.gpu.steps import Prefetch

    assert Prefetch().for_engine() is None
    assert Prefetch(sockets={"GPU-a": "/s/a"}).for_engine() == "/s/a"
    assert Prefetch(sockets={"GPU-a": "/s/a", "GPU-b": "/s/b"}).for_engine() == {"GPU-a": "/s/a", "GPU-b": "/s/b"}
    assert Prefetch(sockets={"/m/1.safetensors": "/s/a"}, by_file=True).for_engine() == {"/m/1.safetensors": "/s/a"}


def test_an_engine_that_takes_its_weights_by_file_gets_a_prefetcher_for_each(monkeypatch, tmp_path):
    """vLLM's weights are several safetensors files: one prefetcher each on the workload's one GPU (each with its
    share of the readers), the room for all of them checked at once, all reaped with their sockets."""
    from coldsnap.gpu.steps import _prefetch_refusal, finish_prefetch, start_prefetch

    files = [ensure_weights(tmp_path / f"w{i}.safetensors", TINY) for i in range(3)]
    profile = _profile(model=NS(weights=[NS(path=f, size=4 << 30) for f in files]))
    assert "not one file" in _prefetch_refusal(profile, True)  # an engine that takes one file
    assert _prefetch_refusal(profile, True, by_file=True) is None
    assert "several ranks" in _prefetch_refusal(_profile(model=profile.model, distributed=NS(world_size=2),
                                                         gpus_used=["GPU-a", "GPU-b"]), True, by_file=True)
    monkeypatch.setattr("coldsnap.gpu.nvml.free_bytes", lambda gpu: 30 << 30)  # < 2 x 12 GiB + 8 GiB
    assert "not enough free memory on GPU-b" in start_prefetch(profile, True, {"GPU-a": "GPU-b"}, tmp_path,
                                                               by_file=True).skipped
    monkeypatch.setattr("coldsnap.gpu.nvml.free_bytes", lambda gpu: 64 << 30)
    p = start_prefetch(profile, True, {"GPU-a": "GPU-b"}, tmp_path, by_file=True)
    assert p.skipped is None and p.by_file and list(p.sockets) == files
    assert all(a.args[a.args.index("--gpu") + 1] == "GPU-b" and a.args[a.args.index("--threads") + 1] == "2"
               for a in p.procs)  # 8 readers among 3 files
    assert [a.args[a.args.index("--file") + 1] for a in p.procs] == files
    deadline = time.monotonic() + 30
    while not all(os.path.exists(sock) for sock in p.sockets.values()):
        assert time.monotonic() < deadline, "the prefetchers did not listen"
        time.sleep(0.02)
    report = finish_prefetch(p)
    assert set(report["per_file"]) == set(files) and list(tmp_path.glob("*.sock")) == []


def test_the_vllm_worker_extension_reads_the_files_vllm_loads(tmp_path):
    """The extension runs in vLLM's process (GPU only); here, what it can be checked for without one: which files
    a model directory's weights are, and each file's data section and tensors."""
    from coldsnap.gpu import vllm_worker
    from coldsnap.gpu.vllm_worker import weight_files

    assert callable(getattr(vllm_worker.ColdSnapWorker, vllm_worker.METHOD))  # what the restore calls, by name

    one = ensure_weights(tmp_path / "a" / "model.safetensors", TINY)
    assert weight_files(tmp_path / "a") == [Path(one)]
    d = tmp_path / "b"
    d.mkdir()
    for name in ("model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors", "stray.safetensors"):
        ensure_weights(d / name, TINY)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "x": "model-00002-of-00002.safetensors", "y": "model-00001-of-00002.safetensors"}}))
    assert [p.name for p in weight_files(d)] == ["model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"]  # the index's, not the stray
    base, header = read_header(Path(one))
    assert (base, os.path.getsize(one) - base) == data_section(one)
    assert all(0 <= t["data_offsets"][0] <= t["data_offsets"][1] <= os.path.getsize(one) - base
               for name, t in header.items() if name != "__metadata__")


def test_a_prefetcher_no_engine_took_is_killed_and_its_socket_removed(tmp_path):
    from coldsnap.gpu.steps import Prefetch, finish_prefetch

    path = ensure_weights(tmp_path / "w.safetensors", TINY)
    sock = str(tmp_path / "p.sock")
    proc = start_prefetcher(path, "GPU-00000000-0000-0000-0000-000000000000", sock)  # waits for an engine
    t = time.monotonic()
    report = finish_prefetch(Prefetch(sockets={"GPU-a": sock}, procs=[proc]))
    assert time.monotonic() - t < 5 and proc.returncode is not None  # killed, not waited out
    assert "reported nothing" in report["error"] and not __import__("os").path.exists(sock)


def test_a_rank_takes_only_the_prefetcher_on_its_own_gpu(tmp_path):
    """{GPU UUID: socket}: a CPU engine (no GPU of its own) takes none of them and reloads from the file quietly."""
    path = ensure_weights(tmp_path / "w.safetensors", TINY)
    runner = Runner(build_model(TINY, load_weights(path, mode="copy"), "cpu"), "cpu", kv_bytes=1 << 20)
    runner.release(save_to=str(tmp_path / "saved.safetensors"))
    reload = runner.resume(prefetched={"GPU-00000000-0000-0000-0000-000000000000": str(tmp_path / "none.sock")})
    assert reload["weights_reload"]["bytes"] > 0 and "prefetch_error" not in reload["weights_reload"]


# --- the mapped fill's order of work, with a stand-in for the driver (the GPU runs the real one above) -----------
class _StandInDriver:
    """Stands in for libcuda where there is no GPU: registrations are recorded (one can be made to fail), and each
    copy reads the host memory it is given, so a wrong address or a copy before its window is registered shows."""

    def __init__(self, fail_at: int | None = None):
        self.registered, self.copies, self.fail_at, self.calls = {}, [], fail_at, 0
        self.lock = __import__("threading").Lock()  # registrations come from several threads
        self.lib = NS(cuStreamSynchronize=lambda s: 0, cuStreamDestroy_v2=lambda s: 0,
                      cuMemHostUnregister=lambda p: self.registered.pop(p.value))

    def use_primary_context(self, device):
        return "ctx"

    def call(self, fn, *args):
        from coldsnap.gpu.vmm import CudaError

        if fn == "cuMemHostRegister_v2":
            with self.lock:
                self.calls += 1
                failing = self.calls == self.fail_at
            if failing:
                raise CudaError("cuMemHostRegister_v2 failed: CUDA_ERROR_NOT_SUPPORTED (801)")
            self.registered[args[0].value] = args[1]
        elif fn == "cuMemcpyHtoDAsync_v2":
            dst, src, n, _ = args
            assert any(p <= src and src + n <= p + size for p, size in self.registered.items()), "not registered"
            self.copies.append((dst, __import__("ctypes").string_at(src, n)))


def test_the_mapped_fill_copies_each_range_from_a_registered_window_and_gives_everything_back(tmp_path):
    from coldsnap.gpu.prefetch import fill_mapped, whole_section

    path = tmp_path / "w.safetensors"
    data = os.urandom(5 << 20)
    path.write_bytes((13).to_bytes(8, "little") + b'{"a":"bcdef"}' + data)  # a data section off the page
    base, length = data_section(str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        driver = _StandInDriver()
        stats, release = fill_mapped(driver, 0, 0, fd, base, whole_section(length), 3, window=1 << 20)
        assert stats["windows"] == 6 and stats["resident"] == 1.0
        assert b"".join(chunk for _, chunk in sorted(driver.copies)) == data
        assert release() >= 0 and driver.registered == {}
        failing = _StandInDriver(fail_at=3)
        from coldsnap.gpu.vmm import CudaError

        with pytest.raises(CudaError, match="NOT_SUPPORTED"):
            fill_mapped(failing, 0, 0, fd, base, whole_section(length), 2, window=1 << 20)
        assert failing.registered == {}  # what it had registered went back
    finally:
        os.close(fd)


# --- straight from the registry (COLDSNAP_PULL_DIRECT=1: coldsnap.gpu.direct) -----------------------------------
def test_a_direct_offer_goes_to_one_whole_file_prefetcher_and_is_declined_otherwise(monkeypatch, tmp_path):
    """The pull's offer (the pieces past the file's head) goes to the prefetcher on its stdin when one prefetcher
    loads the whole file; several ranks, or no prefetch at all, decline it, so the pull fetches the pieces itself
    at once."""
    from types import SimpleNamespace as NS

    from coldsnap.gpu.steps import Streaming, finish_prefetch, start_prefetch, start_prefetch_soon

    path = str(ensure_weights(tmp_path / "w.safetensors", TINY))
    job = {"url": "http://127.0.0.1:9/blob", "authorization": None, "hash": "sha256", "pieces": []}
    declined: list = []

    def streaming() -> dict:
        return {path: Streaming(iter(()), direct=lambda: job, decline=lambda: declined.append(1))}

    monkeypatch.setattr("coldsnap.gpu.nvml.free_bytes", lambda gpu: 64 << 30)
    one = _profile(model=NS(weights=[NS(path=path, size=1 << 20)]))
    p = start_prefetch_soon(one, True, {}, tmp_path, arrivals=streaming())()
    try:
        assert p.direct and p.skipped is None and not declined
        args = p.procs[0].args
        assert "--direct" in args and "--arrivals" not in args
        for feeder in p.feeders:
            feeder.join(10)
    finally:
        report = finish_prefetch(p, wait_s=2)
    assert report.get("error"), report  # no GPU of that name: it says so, and the engine would read the file
    ranks = _profile(model=NS(weights=[NS(path=path, size=1 << 20)]), distributed=NS(world_size=2),
                     gpus_used=["GPU-a", "GPU-b"])
    p = start_prefetch(ranks, True, {}, tmp_path, arrivals=streaming())
    try:
        assert not p.direct and all("--direct" not in proc.args for proc in p.procs)
    finally:
        finish_prefetch(p, wait_s=2)
    monkeypatch.setenv("COLDSNAP_PREFETCH", "0")
    assert start_prefetch_soon(one, True, {}, tmp_path, arrivals=streaming())().skipped == "COLDSNAP_PREFETCH=0"
    assert declined == [1]  # the refused one declined; the ranks' caller (start_prefetch_soon) would have too


def test_a_standby_prefetcher_runs_the_orders_it_is_given_or_exits_when_dismissed(monkeypatch, tmp_path):
    """Started before there is anything to prefetch (a cold node's restore, while the pull waits), a standby
    prefetcher exits 0 when dismissed; given its orders (its arguments, JSON), it runs them: here onto a GPU that
    does not exist, so its first line says it loaded nothing, and why. With COLDSNAP_PREFETCH=0 none starts."""
    from coldsnap.gpu.steps import Standby, stand_by

    dismissed = Standby()
    dismissed.dismiss()
    assert dismissed.proc is None and dismissed.reap() == 0
    path = str(ensure_weights(tmp_path / "w.safetensors", TINY))
    sock = str(tmp_path / "s.sock")
    proc = Standby().take(["--file", path, "--gpu", "GPU-00000000-0000-0000-0000-000000000000", "--socket", sock,
                           "--timeout", "1"])
    try:
        first = json.loads(proc.stdout.readline())
        assert first["loaded"] is False and first["error"], first
    finally:
        out, err = proc.communicate(timeout=30)
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["served"] is False and report["gpu"].startswith("GPU-0000"), (report, err.decode()[-500:])
    assert not os.path.exists(sock)
    monkeypatch.setenv("COLDSNAP_PREFETCH", "0")
    assert stand_by() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the pieces are copied onto it")
def test_weights_fetched_straight_from_the_registry_reach_the_engine_bit_for_bit(tmp_path):
    """--direct: every piece of the file served by a real HTTP server answering ranges, the job giving where the
    data section starts (as the pull read it from the registry); the prefetcher fetches each piece, checks it
    against its pin, copies its data onto the GPU from its pinned buffers (the header skipped), and the engine gets
    the tensors it would load from the whole file. A piece that does not match its pin fails the load, and so does
    a data section's start that the pinned first piece does not confirm; the engine hears why. The good one is a
    standby prefetcher given its orders (as a cold node's restore does), its file the partial the job names, whose
    head the pull writes only after the load is done (its mtime moving then, as on a slow node's disk), the
    engine's file linked to it afterwards."""
    import hashlib

    from test_prefetch_arrivals import RangeServer

    from coldsnap.gpu.steps import Standby

    cfg = ModelConfig(layers=2, hidden=512, heads=8, intermediate=1408, max_seq=64, prefill_chunk=16)
    whole = Path(ensure_weights(tmp_path / "w.safetensors", cfg)).read_bytes()
    piece = 1 << 20
    head = 8 + int.from_bytes(whole[:8], "little")
    first = -(-head // piece) * piece
    uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
    want = load_weights(str(tmp_path / "w.safetensors"), "cuda")
    cases = ((whole, head, None), (whole[:-3] + b"\x00\x01\x02", head, "does not match the pin"),
             (whole, head + 8, "the file's header says its data starts elsewhere"))
    for i, (served, data_offset, failure) in enumerate(cases):
        good = failure is None
        partial = tmp_path / f"partial-{i}.safetensors"
        partial.write_bytes(bytes(len(whole)))  # the head comes below, once the load is done
        engine_file = tmp_path / f"engine-{i}.safetensors"  # linked to the partial once the restore stages
        server = RangeServer(served)
        sock = str(tmp_path / f"d-{i}.sock")
        args = ["--file", str(engine_file), "--gpu", uuid, "--socket", sock, "--timeout", "60", "--direct",
                "--threads", "3"]
        proc = Standby().take(args) if good else subprocess.Popen(
            [sys.executable, "-m", "coldsnap.gpu.prefetch", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        try:
            job = {"url": server.url, "authorization": None, "hash": "sha256", "partial": str(partial),
                   "data_offset": data_offset,
                   "pieces": [[o, min(piece, len(whole) - o), hashlib.sha256(whole[o:o + piece]).hexdigest()]
                              for o in range(0, len(whole), piece)]}
            proc.stdin.write(json.dumps(job).encode() + b"\n")
            proc.stdin.flush()  # communicate (report_of) closes it
            loaded = json.loads(proc.stdout.readline())
            assert loaded["loaded"] is good, (loaded, proc.stderr.read1(4000) if not good else "")
            with open(partial, "r+b") as f:  # the pull's head, filed after the load (a second later, by its mtime)
                f.write(whole[:first])
            os.utime(partial, ns=(partial.stat().st_atime_ns, partial.stat().st_mtime_ns + 10**9))
            params = {n: torch.zeros_like(t) for n, t in want.items()}
            os.link(partial, engine_file)
            if good:
                stats = load_prefetched(str(engine_file), params, sock)
                assert stats["prefetched"] is True
                for n in want:
                    assert torch.equal(params[n], want[n]), n
            else:
                assert failure in loaded["error"], loaded
            report = report_of(proc) if good else None
            if report is not None:
                assert report["mode"] == "direct" and report["served"] is True and "error" not in report, report
                print(json.dumps({"prefetcher": report}))
        finally:
            proc.kill()
            proc.wait()
            server.close()
