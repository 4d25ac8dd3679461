"""ColdSnap's stand-in for the CPU build of `sgl_kernel` (PyPI has only CUDA builds of sglang-kernel).

SGLang 0.5.23 with SGLANG_USE_CPU_ENGINE=1 imports two CPU ops unconditionally for a dense model; they are written
here in plain PyTorch (vectorised, no per-token Python loop). No op is registered under torch.ops.sgl_kernel, so
SGLang's AMX detection stays False and every layer uses its native PyTorch path. Other `*_cpu` names that modules
import at load time (speculative decoding, mamba) resolve to functions that raise if they are ever called."""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+coldsnap.cpu"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For request i: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next end[i]-start[i] entries of
    out_cache_loc (requests consume out_cache_loc in order)."""
    lengths = (end_offset.to(torch.int64) - start_offset.to(torch.int64)).clamp_min(0)
    total = int(lengths.sum())
    if total == 0:
        return
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), lengths)
    seg_begin = torch.cumsum(lengths, 0) - lengths  # where each request's slice of out_cache_loc begins
    within = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(seg_begin, lengths)
    cols = torch.repeat_interleave(start_offset.to(torch.int64), lengths) + within
    req_to_token.view(-1, pool_len)[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """In every KV buffer (base address data_ptrs[b], row size strides[b] bytes) copy row src_loc[j] to row
    tgt_loc[j]. All sources are read before any target is written, so overlapping moves are safe."""
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(base)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src]  # advanced indexing on the right materialises a copy first


def _not_provided(name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel (ColdSnap CPU stand-in) does not provide {name}")

    missing.__name__ = name
    return missing


def __getattr__(name: str):
    if name.endswith("_cpu"):
        return _not_provided(name)
    raise AttributeError(f"module 'sgl_kernel' has no attribute {name!r}")
