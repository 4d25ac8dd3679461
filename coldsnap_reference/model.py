"""A tiny Llama-like decoder (RMSNorm, rotary positions, causal attention, SwiGLU MLP) and its runner.

Decoding has static shapes so torch.compile compiles each step once and CUDA graphs can capture it:
the KV cache is preallocated for max_seq positions (per layer, updated in place), the prompt is
prefilled in fixed-size padded chunks (shape [1, prefill_chunk]) and every decode step has shape [1, 1]. The position is
passed as a tensor, never as a Python int (an int would be specialized and recompiled per position).
Each step returns the greedy next token of every position (argmax over printable ASCII only), so the
logits never leave the graph.

The tokenizer is byte-level: token = UTF-8 byte, plus BOS/EOS/PAD; no training is needed.
"""

from __future__ import annotations

import ctypes
import gc
import time
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from coldsnap_reference.shapes import (  # noqa: F401 - re-exported: the model's vocabulary
    BOS,
    EOS,
    PAD,
    PRINTABLE,
    SHARD_DIMS,
    ModelConfig,
    Shard,
    check_tensor_parallel,
    decode,
    encode,
    local_shape,
    param_specs,
    shard_of,
    shards,
)
from coldsnap_reference.weights import load_into, load_prefetched, load_weights, save_tensors


def _param(*shape: int) -> nn.Parameter:
    """A placeholder on the meta device: build_model() assigns the real (loaded) tensor."""
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = _param(d_out, d_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.weight = _param(n, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def all_reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    """Sum over the tensor-parallel ranks; functional collectives, so torch.compile traces it into the graph."""
    if tp == 1:
        return x
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", dist.group.WORLD)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int = 1) -> None:
        super().__init__()
        self.tp = tp
        self.heads, self.head_dim = cfg.heads // tp, cfg.head_dim  # this rank's heads
        local = self.heads * self.head_dim
        self.wq = Linear(cfg.hidden, local)
        self.wk = Linear(cfg.hidden, local)
        self.wv = Linear(cfg.hidden, local)
        self.wo = Linear(local, cfg.hidden)
        # This layer's KV cache, [1, heads, max_seq, head_dim] each; the Runner allocates them. Separate
        # tensors (not views of one buffer) written in place with index_put_, so the compiled step
        # updates them in place instead of copying a whole cache per layer.
        self.register_buffer("k_cache", torch.zeros(0), persistent=False)
        self.register_buffer("v_cache", torch.zeros(0), persistent=False)

    def forward(self, x, cos, sin, positions, mask):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        self.k_cache[:, :, positions] = k
        self.v_cache[:, :, positions] = v
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return all_reduce(self.wo(out.transpose(1, 2).reshape(b, t, -1)), self.tp)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int = 1) -> None:
        super().__init__()
        self.tp = tp
        self.w1 = Linear(cfg.hidden, cfg.intermediate // tp)
        self.w3 = Linear(cfg.hidden, cfg.intermediate // tp)
        self.w2 = Linear(cfg.intermediate // tp, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.w2(F.silu(self.w1(x)) * self.w3(x)), self.tp)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int = 1) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, tp)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, cos, sin, positions, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, positions, mask)
        return x + self.mlp(self.mlp_norm(x))


def _buffers(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    ang = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float64), inv)
    allowed = torch.full((cfg.vocab_size,), float("-inf"))
    allowed[PRINTABLE.start : PRINTABLE.stop] = 0.0
    return {"rope_cos": ang.cos().float(), "rope_sin": ang.sin().float(), "logit_mask": allowed}


class Transformer(nn.Module):
    """forward(tokens [1, T] int64, start_pos [1] int64) -> greedy next token of each position [1, T].

    Writes the keys and values of positions start_pos .. start_pos+T-1 into each layer's KV cache
    buffers (attn.k_cache / attn.v_cache, [1, heads, max_seq, head_dim]), which the Runner attaches.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", tp: int = 1) -> None:
        super().__init__()
        check_tensor_parallel(cfg, tp)
        self.cfg = cfg
        self.tp = tp
        self.embed = Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg, tp) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = Linear(cfg.hidden, cfg.vocab_size)
        with torch.device(device):
            for name, value in _buffers(cfg).items():
                self.register_buffer(name, value, persistent=False)

    def kv_shape(self) -> tuple[int, ...]:
        c = self.cfg
        return (1, c.heads // self.tp, c.max_seq, c.head_dim)

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        positions = start_pos + torch.arange(t, device=tokens.device)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        keys = torch.arange(self.cfg.max_seq, device=tokens.device)
        mask = keys[None, :] <= positions[:, None]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, positions, mask)
        logits = self.lm_head(self.norm(x)) + self.logit_mask
        return logits.argmax(dim=-1)


# --- runner ------------------------------------------------------------------------------------


def trim_host_memory() -> None:
    """Collect garbage, then hand freed heap pages back to the kernel, so a dump does not carry them."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Runner:
    """Owns the model, its KV cache and the (optionally compiled) step; not thread-safe.

    The KV cache is kv_bytes of zero-filled memory (its pages really there, as a serving engine's
    preallocated KV cache is): the per-layer caches of the one sequence the model decodes at a time,
    plus a reserve holding the rest of kv_bytes (the room other sequences' KV blocks would take).
    release() frees all of it (and on CUDA the weights' memory and the CUDA graphs too), resume()
    brings it back. The tensors stay the same Python objects with the same shapes (their storage is
    resized to 0 and back), so compiled code keeps its guards and is not recompiled.

    CUDA graphs: capture_graphs() captures one graph per static shape (prefill chunk, decode step)
    around the (compiled) step, with static token/position inputs; resume() captures them again,
    since the weights and the KV cache come back at new addresses. This is done by hand rather than
    by torch.compile(mode="reduce-overhead") because torch's CUDA graph trees bind graphs to the
    addresses they recorded and could not be reset without recompiling.
    """

    def __init__(self, model: Transformer, device: torch.device | str, kv_bytes: int = 0, reload=None,
                 reload_into=None, reload_prefetched=None, prefetch_plan=None, peers=None) -> None:
        self.model = model
        self.cfg = model.cfg
        self.device = torch.device(device)
        # Rank 0 of a tensor-parallel group: the other ranks (coldsnap_reference.tp.Peers), told every step
        # and every release/resume, so all ranks run the same collectives in the same order.
        self.peers = peers
        need = self.cfg.kv_bytes() // model.tp
        self.kv_bytes = max(int(kv_bytes) // 4 * 4, need)
        self._reload = reload  # () -> dict[name, tensor]: the weights again, for resume() on CUDA
        self._reload_into = reload_into  # (params) -> stats: hydrate the parameters in place
        # (params, socket) -> stats: the same from the copy coldsnap.gpu.prefetch put on the GPU during the restore
        self._reload_prefetched = reload_prefetched
        # (names) -> pieces of the weights file this rank holds (coldsnap.gpu.prefetch), or None: the whole file
        self._prefetch_plan = prefetch_plan
        self.step = model
        self.compile_mode: str | None = None
        self.use_graphs = False
        self._graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.released = False
        self.weights_released = False
        self._stack_bytes: int | None = None  # the CUDA stack limit release() set to 0, for resume() to set back
        self._kv: list[torch.Tensor] = []
        with torch.no_grad():
            for block in model.layers:
                for name in ("k_cache", "v_cache"):
                    t = torch.zeros(model.kv_shape(), dtype=torch.float32, device=self.device)
                    setattr(block.attn, name, t)
                    self._kv.append(t)
            self._kv.append(torch.zeros((self.kv_bytes - need) // 4, dtype=torch.float32, device=self.device))

    @property
    def cudagraphs(self) -> bool:
        """torch.compile's own CUDA graphs (cudagraph trees), as opposed to capture_graphs()."""
        return self.device.type == "cuda" and self.compile_mode in ("reduce-overhead", "max-autotune")

    def compile(self, mode: str = "default") -> None:
        self.step = torch.compile(self.model, mode=mode, dynamic=False, fullgraph=True)
        self.compile_mode = mode

    def _run(self, ids: list[int], start: int) -> torch.Tensor:
        if self.peers is not None:
            self.peers.send({"op": "step", "ids": ids, "start": start})
        return self.run_step(ids, start)

    def run_step(self, ids: list[int], start: int) -> torch.Tensor:
        """One step on this rank only (tensor-parallel peers call this when rank 0 says so)."""
        graph = self._graphs.get(len(ids))
        if graph is not None:
            g, tokens, pos, out = graph
            tokens.copy_(torch.tensor([ids], dtype=torch.long))
            pos.fill_(start)
            g.replay()
            return out
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([start], dtype=torch.long, device=self.device)
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self.step(tokens, pos)

    def precompile(self) -> None:
        """Run each static shape once (prefill chunk, decode step), so compilation happens now."""
        with torch.no_grad():
            self._run([PAD] * self.cfg.prefill_chunk, 0)
            self._run([PAD], 0)
        self.synchronize()

    def capture_graphs(self) -> int:
        """Capture a CUDA graph of each static shape (after precompile()); returns how many."""
        if self.device.type != "cuda" or self.cudagraphs:  # not around torch's own CUDA graphs
            return 0
        self._graphs = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            for t in (self.cfg.prefill_chunk, 1):
                tokens = torch.full((1, t), PAD, dtype=torch.long, device=self.device)
                pos = torch.zeros(1, dtype=torch.long, device=self.device)
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self.step(tokens, pos)
                torch.cuda.current_stream(self.device).wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self.step(tokens, pos)
                self._graphs[t] = (g, tokens, pos, out)
        self.use_graphs = True
        self.synchronize()
        return len(self._graphs)

    def warmup(self, tokens: int = 8, lengths: list[int] | None = None) -> int:
        """Generate `tokens` tokens after prompts of several lengths (one to many prefill chunks)."""
        c = self.cfg
        n = max(1, min(tokens, c.max_seq - 1))
        if lengths is None:
            lengths = [1, c.prefill_chunk - 1, c.prefill_chunk + 1, 3 * c.prefill_chunk, c.max_seq - n]
        lengths = sorted({max(1, min(k, c.max_seq - n)) for k in lengths})
        for k in lengths:
            for _ in self.generate([BOS] + [ord("a")] * (k - 1), n):
                pass
        self.synchronize()
        return len(lengths)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len + max_tokens > self.cfg.max_seq:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context of {self.cfg.max_seq}"
            )

    def generate(self, prompt: list[int], max_tokens: int) -> Iterator[int]:
        """Greedy decode; yields max_tokens token ids. The caller holds the model lock meanwhile."""
        if self.released:
            raise RuntimeError("engine is released; resume it first")
        self.check_fits(len(prompt), max_tokens)
        if max_tokens < 1 or not prompt:
            return
        chunk = self.cfg.prefill_chunk
        with torch.no_grad():
            for start in range(0, len(prompt), chunk):
                part = prompt[start : start + chunk]
                out = self._run(part + [PAD] * (chunk - len(part)), start)
            tok = int(out[0, len(part) - 1])
            yield tok
            pos = len(prompt)
            for _ in range(max_tokens - 1):
                tok = int(self._run([tok], pos)[0, 0])
                pos += 1
                yield tok

    def release(self, weights: bool = True, save_to: str | None = None,
                stash_code: str | None = None) -> dict[str, Any]:
        """Drop the KV cache (and, on CUDA, the weights unless weights=False). Idempotent.
        save_to: first write the weights as they are in memory to that safetensors file, then drop them on any
        device; resume() reloads them from it (native weights that travel as their own file, not in the dump).
        stash_code: then move the CUDA device code this process holds in anonymous memory into files there
        (coldsnap.gpu.codestash), so a dump carries file mappings instead of those pages.
        Tensor-parallel peers release at the same time; the answer counts every rank's bytes."""
        if save_to and self.peers is not None:
            raise ValueError("saving the weights of a tensor-parallel engine is not supported: use recovery mode")
        if self.peers is not None:
            self.peers.send({"op": "release", "weights": weights, "stash_code": stash_code})
        out = self._release_local(weights, save_to, stash_code)
        if self.peers is None:
            return out  # alone, or a peer answering rank 0, which gathers every rank's prefetch plan
        plans = [out.pop("prefetch_plan", None)]
        for reply in self.peers.replies():
            out["freed_bytes"] += int(reply.get("freed_bytes", 0))
            theirs = reply.get("code_stash") or {}
            for key in ("files", "bytes") if "code_stash" in out else ():
                out["code_stash"][key] += int(theirs.get(key, 0))
            plans.append(reply.get("prefetch_plan"))
        if all(plans):  # every rank's part of the weights file, by GPU: what a restore prefetches onto each
            out["prefetch_plans"] = {p["gpu"]: p["pieces"] for p in plans}
        return out

    def _release_local(self, weights: bool, save_to: str | None = None,
                       stash_code: str | None = None) -> dict[str, Any]:
        freed = 0
        out: dict[str, Any] = {}
        with torch.no_grad():
            self.synchronize()
            self._graphs = {}  # the graphs point at the memory freed below; resume() captures them again
            if not self.released:
                for t in self._kv:
                    freed += t.untyped_storage().nbytes()
                    t.untyped_storage().resize_(0)
                self.released = True
            if save_to and not self.weights_released:
                params = dict(self.model.named_parameters())
                out["saved_weights"] = save_to
                out["saved_bytes"] = save_tensors(save_to, params, {"format": "pt", "saved_by": "coldsnap.reference"})
                device = str(self.device)
                self._reload = lambda: load_weights(save_to, device, "copy")
                self._reload_into = lambda p: load_into(save_to, p)
                self._reload_prefetched = lambda p, sock: load_prefetched(save_to, p, sock)
                self._prefetch_plan = None  # the saved file is this engine's whole state
            releasable = self.device.type == "cuda" or save_to  # on CPU, weights are file-backed or saved first
            if weights and releasable and self._reload is not None and not self.weights_released:
                for p in self.model.parameters():
                    freed += p.untyped_storage().nbytes()
                    p.untyped_storage().resize_(0)
                self.weights_released = True
            if self.weights_released and self.device.type == "cuda" and self._prefetch_plan is not None:
                pieces = self._prefetch_plan(list(dict(self.model.named_parameters())))
                if pieces is not None:
                    gpu = "GPU-" + str(torch.cuda.get_device_properties(self.device).uuid)
                    out["prefetch_plan"] = {"gpu": gpu, "pieces": [list(p) for p in pieces]}
            if self.device.type == "cuda":
                # cuBLAS keeps a workspace per stream it ran on; the graphs' streams are gone. Fewer bytes for the
                # driver's checkpoint to save and restore; cuBLAS allocates again when it next runs.
                clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
                if clear_workspaces is not None:
                    clear_workspaces()
                torch.cuda.empty_cache()
                # the stack reserve for every thread the GPU holds (264 MiB on an H200): back in resume()
                if self._stack_bytes is None:
                    from coldsnap.gpu.libcuda import set_stack_limit

                    self._stack_bytes = set_stack_limit(0)
                out["cuda_stack_limit_shed"] = self._stack_bytes
                # what the driver's checkpoint still has to save, the context included
                free, total = torch.cuda.mem_get_info(self.device)
                out["gpu_used_bytes"] = total - free
                out["torch_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
        trim_host_memory()  # every rank, not only the one that serves HTTP
        if stash_code:
            from coldsnap.gpu.codestash import stash_code as stash

            out["code_stash"] = stash(stash_code)
        return {"freed_bytes": freed, **out}

    def resume(self, prefetched: str | dict[str, str] | None = None) -> dict[str, Any]:
        """Re-allocate (and zero) the KV cache; on CUDA reload the weights from their file, or from the copy a
        prefetcher already put on the GPU: prefetched is its socket, or {GPU UUID: socket} when each GPU has one
        (each rank takes the one on its own GPU). Idempotent.
        Tensor-parallel peers resume at the same time (each reloads its own shard)."""
        if self.peers is not None:
            self.peers.send({"op": "resume", **({"prefetched": prefetched} if isinstance(prefetched, dict) else {})})
        out = self._resume_local(self._prefetch_socket(prefetched))
        if self.peers is not None:
            out["peers"] = self.peers.replies()
        return out

    def _prefetch_socket(self, prefetched: str | dict[str, str] | None) -> str | None:
        """This rank's prefetcher socket: the one given, or the one for this rank's GPU in {GPU UUID: socket}."""
        if not isinstance(prefetched, dict):
            return prefetched
        if self.device.type != "cuda":
            return None
        from coldsnap.gpu.prefetch import gpu_key

        mine = gpu_key(torch.cuda.get_device_properties(self.device).uuid)
        return next((sock for gpu, sock in prefetched.items() if gpu_key(gpu) == mine), None)

    def _resume_local(self, prefetched: str | None = None) -> dict[str, Any]:
        took: dict[str, float] = {}  # where resume's time goes, in seconds
        t = time.perf_counter()
        with torch.no_grad():
            if self._stack_bytes is not None:  # before any kernel: the stack reserve release() gave back
                from coldsnap.gpu.libcuda import set_stack_limit

                set_stack_limit(self._stack_bytes)
                self._stack_bytes = None
            hydrate = None
            if self.weights_released:
                params = dict(self.model.named_parameters())
                for p in params.values():
                    p.untyped_storage().resize_(p.numel() * p.element_size())
                took["weights_alloc"] = time.perf_counter() - t
                prefetch_error = None
                if prefetched and self._reload_prefetched is not None:
                    try:
                        hydrate = self._reload_prefetched(params, prefetched)
                    except Exception as e:  # noqa: BLE001 - any failure: reload from the file, say why
                        prefetch_error = f"{type(e).__name__}: {e}"
                if hydrate is None and self._reload_into is not None:
                    hydrate = self._reload_into(params)  # in place, pinned + overlapped: full speed
                elif hydrate is None:
                    weights = self._reload()
                    for name, p in params.items():
                        p.copy_(weights[name])
                    del weights
                if prefetch_error:
                    hydrate = {**(hydrate or {}), "prefetch_error": prefetch_error}
                self.weights_released = False
            t = time.perf_counter()
            if self.released:
                for kv in self._kv:
                    kv.untyped_storage().resize_(kv.numel() * kv.element_size())
                    kv.zero_()
                self.released = False
                self.synchronize()
                took["kv"] = time.perf_counter() - t
            t = time.perf_counter()
            if self.use_graphs and not self._graphs:
                self.capture_graphs()
                took["cuda_graphs"] = time.perf_counter() - t
            self.synchronize()
        return {"kv_bytes": self.kv_bytes, "cuda_graphs": len(self._graphs), "weights_reload": hydrate,
                "took_s": {k: round(v, 4) for k, v in took.items()}}


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device | str,
                tp: int = 1, rank: int = 0) -> Transformer:
    """Build the model (this rank's part of it) around the given tensors without copying them (mmap views stay
    mmap views)."""
    model = Transformer(cfg, device, tp)
    specs = param_specs(cfg)
    missing = {n for n, _, _ in specs} - set(weights)
    if missing:
        raise ValueError(f"weights lack {sorted(missing)[:5]}")
    for name, full, _ in specs:
        shape = local_shape(full, shard_of(name, full, tp, rank))
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(weights[name].shape)}, config wants {shape}")
    model.load_state_dict({n: weights[n] for n, _, _ in specs}, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
