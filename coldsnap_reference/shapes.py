"""The reference model's shapes, tokens and tensor-parallel shards: what the model and its weights file both need,
without torch (weights.py reads and writes files by these shapes; model.py builds the model from them)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

BOS = 256
EOS = 257
PAD = 258
PRINTABLE = range(32, 127)  # tokens the decoder may emit: printable ASCII


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 260  # 256 bytes + BOS, EOS, PAD, one spare
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    intermediate: int = 688
    max_seq: int = 256
    prefill_chunk: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.vocab_size < PAD + 1:
            raise ValueError(f"vocab_size must be at least {PAD + 1}")
        for name in ("hidden", "layers", "heads", "intermediate", "max_seq", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError("hidden must be a multiple of heads with an even head size")
        if self.max_seq % self.prefill_chunk:
            raise ValueError("max_seq must be a multiple of prefill_chunk")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        return cls(**d)

    def kv_bytes(self, itemsize: int = 4) -> int:
        """Bytes of the KV cache of one sequence of max_seq positions."""
        return self.layers * 2 * self.max_seq * self.hidden * itemsize


# Tensor parallelism (Megatron style): these weights are split across ranks along the given dimension; the rest
# (embeddings, norms, lm_head) are replicated. Column-parallel q/k/v and w1/w3 (output features, so whole heads
# per rank), row-parallel wo and w2 (input features) followed by one all-reduce each.
SHARD_DIMS = {"attn.wq.weight": 0, "attn.wk.weight": 0, "attn.wv.weight": 0, "attn.wo.weight": 1,
              "mlp.w1.weight": 0, "mlp.w3.weight": 0, "mlp.w2.weight": 1}


@dataclass(frozen=True)
class Shard:
    """The part of a full weight one rank holds: [start, stop) along dim."""

    dim: int
    start: int
    stop: int


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    if tp < 1:
        raise ValueError("tensor parallel size must be at least 1")
    if cfg.heads % tp or cfg.intermediate % tp:
        raise ValueError(f"heads ({cfg.heads}) and intermediate ({cfg.intermediate}) must be multiples of the "
                         f"tensor parallel size {tp}")


def shard_of(name: str, shape: tuple[int, ...], tp: int, rank: int) -> Shard | None:
    """Which part of weight `name` (full shape) rank holds; None when the rank holds all of it."""
    dim = SHARD_DIMS.get(name.split(".", 2)[-1]) if name.startswith("layers.") else None
    if tp == 1 or dim is None:
        return None
    size = shape[dim] // tp
    return Shard(dim, rank * size, (rank + 1) * size)


def local_shape(shape: tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
    if shard is None:
        return shape
    out = list(shape)
    out[shard.dim] = shard.stop - shard.start
    return tuple(out)


def param_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, shape, init std) of every weight, in a fixed order; std 0 means all ones (norm gains)."""
    h, i, v = cfg.hidden, cfg.intermediate, cfg.vocab_size
    specs: list[tuple[str, tuple[int, ...], float]] = [("embed.weight", (v, h), 1.0)]
    for n in range(cfg.layers):
        p = f"layers.{n}."
        specs += [
            (p + "attn_norm.weight", (h,), 0.0),
            (p + "attn.wq.weight", (h, h), 1 / math.sqrt(h)),
            (p + "attn.wk.weight", (h, h), 1 / math.sqrt(h)),
            (p + "attn.wv.weight", (h, h), 1 / math.sqrt(h)),
            (p + "attn.wo.weight", (h, h), 1 / math.sqrt(h) / math.sqrt(2 * cfg.layers)),
            (p + "mlp_norm.weight", (h,), 0.0),
            (p + "mlp.w1.weight", (i, h), 1 / math.sqrt(h)),
            (p + "mlp.w3.weight", (i, h), 1 / math.sqrt(h)),
            (p + "mlp.w2.weight", (h, i), 1 / math.sqrt(i) / math.sqrt(2 * cfg.layers)),
        ]
    specs += [("norm.weight", (h,), 0.0), ("lm_head.weight", (v, h), 1 / math.sqrt(h))]
    return specs


# --- tokenizer ---------------------------------------------------------------------------------


def encode(text: str) -> list[int]:
    return [BOS, *text.encode("utf-8")]


def decode(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


def shards(cfg: ModelConfig, tp: int = 1, rank: int = 0) -> dict[str, Shard]:
    """The weights rank holds only part of, and which part."""
    out = {}
    for name, shape, _ in param_specs(cfg):
        s = shard_of(name, shape, tp, rank)
        if s is not None:
            out[name] = s
    return out
