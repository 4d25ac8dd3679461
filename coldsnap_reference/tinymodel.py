"""A tiny Llama model made locally, with no download: random weights (seeded) and a byte-level BPE tokenizer trained
on generated text. Real engines (vLLM, SGLang) load it like any Hugging Face model directory; greedy output is
deterministic, so a restore can be checked token for token against the server it was captured from.

    python -m coldsnap_reference.tinymodel DIR [--seed N] [--shape tiny|1b|8b]

--shape 1b and 8b write Llama-shaped models of real size in bf16 (1.0 GB; 16.1 GB, the shape of Llama 3 8B) for
the GPU tests and benches: tensors generated (on the GPU when there is one) and written shard by shard as
safetensors, never a whole model in memory. Their vocabulary is the real shape's; the tokenizer's is small, and
lm_head rows past it are zero, so greedy decoding only ever picks tokens the tokenizer can spell.

Needs torch, transformers and tokenizers (the engine venvs have them; ColdSnap's own venv need not). The result is
byte-for-byte the same for the same seed and library versions; an existing complete directory is left as it is."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

MODEL_ID = "coldsnap/tiny-llama"
STAMP = ".coldsnap-tinymodel.json"

SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, vocab_size=1024, max_position_embeddings=2048)
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = ("the a one cold snap server model token restore capture process memory kernel page socket engine "
          "request answer fast slow small large warm start first last says checkpoint image layer file weight "
          "cache batch queue thread worker scheduler graph tensor value key query head stream text prompt reply "
          "hello world is was will be can may not and or but so then because when while if of to in on at by "
          "for with from up down over under again every each all some many few more most less").split()


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic training text: sentences of common words, digits and punctuation."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(".!?,;:") + ("\n" if i % 7 == 0 else ""))
    return out


def _build_tokenizer(seed: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>", model_max_length=SHAPE["max_position_embeddings"],
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Llama-shaped models of real size (bf16): the tests' ~1 GB one and the bench's 8B one (Llama 3 8B's shape).
SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
               intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192),
}
SHARD_BYTES = 4 << 30


def _llama_tensors(shape: dict):
    """(name, shape, kind) of every tensor of a Llama model: kind 'norm' (ones), 'head' (rows past the tokenizer's
    vocabulary zero) or 'matrix'."""
    h, kv = shape["hidden_size"], shape["num_key_value_heads"] * (shape["hidden_size"] // shape["num_attention_heads"])
    inter = shape["intermediate_size"]
    yield "model.embed_tokens.weight", (shape["vocab_size"], h), "matrix"
    for i in range(shape["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        yield pre + "input_layernorm.weight", (h,), "norm"
        for proj, dims in (("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h))):
            yield f"{pre}self_attn.{proj}_proj.weight", dims, "matrix"
        yield pre + "post_attention_layernorm.weight", (h,), "norm"
        for proj, dims in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
            yield f"{pre}mlp.{proj}_proj.weight", dims, "matrix"
    yield "model.norm.weight", (h,), "norm"
    yield "lm_head.weight", (shape["vocab_size"], h), "head"


def _write_shaped(tmp: Path, shape_name: str, seed: int, tokenizer_vocab: int) -> None:
    """A Llama-shaped model of real size, written shard by shard (model-0000N-of-0000M.safetensors + index)."""
    import torch
    from safetensors.torch import save_file

    shape = SHAPES[shape_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict] = [{}]
    size = 0
    for name, dims, kind in _llama_tensors(shape):
        nbytes = 2 * (dims[0] * (dims[1] if len(dims) > 1 else 1))
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = (dims, kind)
        size += nbytes
    weight_map, total = {}, 0
    for n, shard in enumerate(shards, 1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, (dims, kind) in shard.items():
            if kind == "norm":
                t = torch.ones(dims, dtype=torch.bfloat16)
            else:
                # gain 3 over 1/sqrt(fan_in): decisive logits (no greedy ties) that stay finite in bf16
                t = torch.randn(dims, generator=gen, device=device, dtype=torch.float32).mul_(3 / dims[1] ** 0.5)
                if kind == "head":
                    t[tokenizer_vocab:] = 0
                t = t.to(torch.bfloat16).cpu()
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * 2
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, "bos_token_id": 1,
              "eos_token_id": 2, "pad_token_id": 2, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "hidden_act": "silu", "torch_dtype": "bfloat16", "attention_bias": False,
              "mlp_bias": False, "head_dim": shape["hidden_size"] // shape["num_attention_heads"]}
    (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def make(directory: str | os.PathLike, seed: int = 0, force: bool = False, shape: str = "tiny") -> Path:
    """Write the model into directory (created). Returns the directory. Atomic: a half-written one never appears."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dest = Path(directory).resolve()
    if not force and is_complete(dest, seed, shape):
        return dest
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer = _build_tokenizer(seed, SHAPE["vocab_size"])
        if shape != "tiny":
            _write_shaped(tmp, shape, seed, len(tokenizer))
            tokenizer.save_pretrained(tmp)
            stamp = {"id": f"coldsnap/llama-{shape}", "seed": seed, "shape": SHAPES[shape]}
        else:
            torch.manual_seed(seed)
            config = LlamaConfig(**SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
                                 rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu")
            config.dtype = torch.float32
            with torch.no_grad():
                model = LlamaForCausalLM(config).to(torch.float32)
                # A random init with std 0.02 gives near-uniform logits; a wider spread makes greedy decoding
                # decisive (no ties that a different kernel could break differently).
                for p in model.parameters():
                    if p.dim() >= 2:
                        p.normal_(0.0, 0.3)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "generation_config.json").write_text(json.dumps(
                {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": False}, indent=2) + "\n")
            stamp = {"id": MODEL_ID, "seed": seed, "shape": SHAPE}
        (tmp / STAMP).write_text(json.dumps(stamp, sort_keys=True) + "\n")
        if shape == "tiny":
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def is_complete(directory: str | os.PathLike, seed: int | None = None, shape: str = "tiny") -> bool:
    d = Path(directory)
    try:
        info = json.loads((d / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return (info.get("shape") == SHAPES.get(shape, SHAPE) and (seed is None or info.get("seed") == seed)
            and any(d.glob("*.safetensors")) and (d / "tokenizer.json").exists())


def ensure(directory: str | os.PathLike, python: str, seed: int = 0, timeout: float = 600) -> Path:
    """Make the model in `directory` with another interpreter (an engine venv's, which has transformers) unless it
    is complete already. This repository's packages are put on that interpreter's path for this one command only."""
    import subprocess

    from coldsnap.contracts import ColdSnapError, ErrorCode

    dest = Path(directory)
    if is_complete(dest, seed):
        return dest
    root = str(Path(__file__).resolve().parents[1])
    python_path = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": python_path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([python, "-m", "coldsnap_reference.tinymodel", str(dest), "--seed", str(seed)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 or not is_complete(dest, seed):
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"could not make the tiny model in {dest} with {python}: "
                            f"{(r.stderr or r.stdout).strip()[-400:]}")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coldsnap_reference.tinymodel", description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even when the directory is complete")
    ap.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny",
                    help="tiny (fp32, 2 layers: CPU tests) or a Llama shape of real size in bf16: 1b (1.0 GB), "
                         "8b (16.1 GB)")
    args = ap.parse_args(argv)
    print(make(args.directory, seed=args.seed, force=args.force, shape=args.shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
