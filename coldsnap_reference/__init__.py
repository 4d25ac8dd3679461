"""The reference engine: an OpenAI-compatible HTTP server over a tiny decoder-only transformer.

It is ColdSnap's embedded default workload. Its start does the costly work a real server does (load
safetensors weights, torch.compile, warm-up, CUDA graph capture on a GPU), which ColdSnap captures once
with CRIU and restores instead of cold-starting.

Importing this package does not import torch. It pins TORCHINDUCTOR_COMPILE_THREADS=1 before torch can
be imported through it: inductor's compile worker subprocesses would break a CRIU dump.
"""

import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

ENGINE_NAME = "reference"
ENGINE_VERSION = "0.1.0"
DEFAULT_MODEL_ID = "coldsnap/reference-tiny"

__all__ = ["ENGINE_NAME", "ENGINE_VERSION", "DEFAULT_MODEL_ID"]
