"""OpenAI-compatible HTTP server over the reference model: ColdSnap's embedded default workload.

    python -m coldsnap_reference.server --weights PATH [--host 0.0.0.0] [--port 8000]
        [--device cpu|cuda] [--compile/--no-compile] [--compile-mode MODE] [--compile-cache DIR]
        [--compile-cache-policy kernels|all|fresh] [--cuda-graphs/--no-cuda-graphs]
        [--weights-load mmap|copy] [--seed N] [--layers N --hidden H --heads N --intermediate N
        --max-seq N --prefill-chunk N] [--kv-mib N] [--threads N] [--warmup-tokens N] [--model-id NAME]

Start-up does the work a real engine does, each phase timed and printed to stderr as one JSON line
({"event": "phase", "name": ..., "seconds": ...}): import torch, ensure the weights (generated on first
use), load them (mmap by default), build the model and allocate the KV cache, torch.compile the prefill
and decode steps, capture CUDA graphs of both (on a GPU), warm up; then it listens and prints
{"event": "ready", ...}. It binds its port only once it is ready, so a GET /health that answers
means it can serve.

Built to be checkpointed by CRIU: the stdlib threading HTTP server (no asyncio/uvloop, whose io_uring
CRIU cannot dump), every response is `Connection: close` (no connection outlives its request, so an
idle server holds no client socket), inductor compiles in-process (TORCHINDUCTOR_COMPILE_THREADS=1,
no compile worker subprocesses), and nothing cached depends on the PID or on wall-clock time. The
process maps the compiled kernels (.so files) from the inductor cache directory (/coldsnap/info
names it): a restore needs those files at the same paths.

Endpoints: GET /health, GET /v1/models, POST /v1/completions (stream or not; greedy decoding only),
GET /coldsnap/info, POST /coldsnap/release (drop the KV cache, and on CUDA the weights and CUDA
graphs, before a capture), POST /coldsnap/resume (bring them back after a restore; {"prefetched": SOCKET}
takes the weights from the GPU memory a coldsnap.gpu.prefetch loaded meanwhile).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # before torch is imported, see the docstring

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from coldsnap.engines.lease import watch as lease_watch  # noqa: E402
from coldsnap_reference import DEFAULT_MODEL_ID, ENGINE_NAME, ENGINE_VERSION  # noqa: E402

MAX_BODY = 1 << 20
_T0 = time.monotonic()


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), file=sys.stderr, flush=True)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# The device work a template does when resumed, in order (each timed as a start-up phase).
DEVICE_PHASES = ("cuda_init", "load", "build", "compile", "cuda_graphs", "warmup")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class Engine:
    """The loaded model behind the HTTP handlers; one model call at a time (the lock)."""

    def __init__(self, runner, model_id: str, info: dict[str, Any], become_ready=None) -> None:
        self.runner = runner  # None while a template (--template): become_ready() builds it at resume
        self.become_ready = become_ready
        self.model_id = model_id
        self.info = info
        self.lock = threading.Lock()
        self.created = int(time.time())

    @property
    def serving(self) -> bool:
        return self.runner is not None and not self.runner.released

    def not_serving(self) -> BadRequest:
        if self.runner is None:
            return BadRequest("the engine is a template; POST /coldsnap/resume first", 503, code="template")
        return BadRequest("the engine is released; POST /coldsnap/resume first", 503, code="released")

    # --- requests ---

    def parse_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        from coldsnap_reference.model import encode

        model = body.get("model", self.model_id)
        if model is not None and model != self.model_id:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "model", "model_not_found")
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string (or a list of one string)", param="prompt")
        max_tokens = body.get("max_tokens", 16)
        if max_tokens is None:
            max_tokens = 16
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest("max_tokens must be a positive integer", param="max_tokens")
        temperature = body.get("temperature", 0)
        if temperature is not None and (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature)
            or temperature < 0
        ):
            raise BadRequest("temperature must be a number >= 0 (decoding is greedy regardless)", param="temperature")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean", param="stream")
        n = body.get("n", 1)
        if n not in (1, None) or isinstance(n, bool):
            raise BadRequest("only n=1 is supported", param="n")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object", param="stream_options")
        ids = encode(prompt)
        if self.runner is None:
            raise self.not_serving()
        try:
            self.runner.check_fits(len(ids), max_tokens)
        except ValueError as e:
            raise BadRequest(str(e), param="max_tokens", code="context_length_exceeded") from None
        return {"ids": ids, "max_tokens": max_tokens, "stream": stream, "usage": bool(opts.get("include_usage"))}

    def parse_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat completion request as a completion of the conversation rendered as text ("role: content" lines,
        then "assistant:"): the reference engine has no chat template, and greedy decoding makes it deterministic."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise BadRequest("messages must be a non-empty list of {role, content} objects with string content",
                             param="messages")
        prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.parse_completion({**{k: v for k, v in body.items() if k != "messages"}, "prompt": prompt})

    def tokens(self, ids: list[int], max_tokens: int):
        """Generated token texts, one per token; holds the lock until exhausted or closed."""
        from coldsnap_reference.model import decode

        with self.lock:
            if not self.serving:
                raise self.not_serving()
            for tok in self.runner.generate(ids, max_tokens):
                yield decode([tok])

    def release(self, weights: bool = True, save: bool = False, stash_code: str | None = None,
                lease: str | None = None) -> dict[str, Any]:
        """save: write the weights as they are in memory next to the weights file first (a new file each time,
        named in the answer's saved_weights), then drop them; resume() reloads from that file.
        stash_code: a directory for the CUDA device code held in anonymous memory (coldsnap.gpu.codestash).
        lease: the capturer's lease file (coldsnap.engines.lease): resume without being asked once it is let go."""
        if self.runner is None:
            raise BadRequest("the engine is a template: nothing to release", 400, code="template")
        save_to = None
        if save:
            src = Path(self.info["weights"]["path"])
            save_to = str(src.with_name(f"{src.stem}.native-{uuid.uuid4().hex[:12]}.safetensors"))
        with self.lock:
            t = time.monotonic()
            try:
                out = self.runner.release(weights=weights, save_to=save_to, stash_code=stash_code)
            except ValueError as e:
                raise BadRequest(str(e), 400, code="unsupported") from None
            if lease:
                lease_watch(lease, lambda: self.runner.released, self._resume_unasked)
            return {"released": True, "seconds": time.monotonic() - t, "rss_bytes": _rss_bytes(), **out}

    def _resume_unasked(self) -> None:
        try:
            out = self.resume()
            emit("resumed", why="the capturer let its lease go", seconds=round(out["seconds"], 3))
        except Exception as e:  # noqa: BLE001 - a watcher thread: say it, the engine answers 503 still
            emit("resume-failed", error=f"resume after the capturer left failed: {e}")

    def resume(self, prefetched: str | dict[str, str] | None = None) -> dict[str, Any]:
        """prefetched: the socket of a coldsnap.gpu.prefetch that holds the weights on the GPU already, or
        {GPU UUID: socket}, one per GPU of a tensor-parallel engine."""
        with self.lock:
            t = time.monotonic()
            if self.runner is None:  # a template: the device work a normal start did before listening
                self.runner = self.become_ready()
                phases = self.info.get("startup_phases") or {}
                return {"released": False, "from_template": True, "seconds": time.monotonic() - t,
                        "rss_bytes": _rss_bytes(),
                        "phases": {k: phases[k] for k in DEVICE_PHASES if k in phases}}
            out = self.runner.resume(prefetched)
            return {"released": False, "seconds": time.monotonic() - t, "rss_bytes": _rss_bytes(), **out}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    server_version = f"coldsnap-reference/{ENGINE_VERSION}"
    timeout = 60  # a client that stalls mid-request does not hold its thread forever

    @property
    def engine(self) -> Engine:
        return self.server.engine  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: stderr carries JSON events
        pass

    # --- plumbing ---

    def _headers(self, status: int, ctype: str, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self._headers(status, "application/json", len(data))
        self.wfile.write(data)

    def _error(self, e: BadRequest) -> None:
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        self._json(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}})

    def _body(self, required: bool = True) -> dict[str, Any]:
        if self.headers.get("Content-Length") is None and not required:
            return {}
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise BadRequest("a JSON body with Content-Length is required", 411) from None
        if length < 0 or length > MAX_BODY:
            raise BadRequest(f"body larger than {MAX_BODY} bytes", 413)
        raw = self.rfile.read(length) if length else b""
        if len(raw) != length:
            raise BadRequest("body shorter than its Content-Length")
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    def _dispatch(self, routes: dict[str, Any]) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        try:
            fn = routes.get(path)
            if fn is None:
                known = {"/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/coldsnap/info",
                         "/coldsnap/release", "/coldsnap/resume"}
                if path in known:
                    raise BadRequest(f"method {self.command} not allowed on {path}", 405)
                raise BadRequest(f"no route {path}", 404)
            fn()
        except BadRequest as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception as e:  # never let a request take the server down
            emit("error", path=path, error=f"{type(e).__name__}: {e}")
            try:
                self._error(BadRequest(f"internal error: {type(e).__name__}: {e}", 500))
            except OSError:
                pass

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch({"/health": self.health, "/v1/models": self.models, "/coldsnap/info": self.info})

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch({"/v1/completions": self.completions, "/v1/chat/completions": self.chat_completions,
                        "/coldsnap/release": self.release, "/coldsnap/resume": self.resume})

    # --- endpoints ---

    def health(self) -> None:
        if self.engine.runner is None:
            self._json(503, {"status": "template"})
        elif self.engine.runner.released:
            self._json(503, {"status": "released"})
        else:
            self._json(200, {"status": "ok"})

    def models(self) -> None:
        e = self.engine
        card = {
            "id": e.model_id,
            "object": "model",
            "created": e.created,
            "owned_by": "coldsnap",
            "root": e.model_id,
            "max_model_len": e.info["config"].get("max_seq"),
        }
        self._json(200, {"object": "list", "data": [card]})

    def info(self) -> None:
        e = self.engine
        self._json(
            200,
            {
                **e.info,
                "released": not e.serving,
                "rss_bytes": _rss_bytes(),
                "pid": os.getpid(),
            },
        )

    def release(self) -> None:
        body = self._body(required=False) or {}
        stash, lease = body.get("stash_code"), body.get("lease")
        if lease is not None and not isinstance(lease, str):
            raise BadRequest("lease must be a path", param="lease")
        self._json(200, self.engine.release(weights=bool(body.get("weights", True)), save=bool(body.get("save")),
                                            stash_code=str(stash) if stash else None, lease=lease))

    def resume(self) -> None:
        body = self._body(required=False) or {}
        prefetched = body.get("prefetched")
        if prefetched is not None and not (isinstance(prefetched, str) or (
                isinstance(prefetched, dict) and all(isinstance(v, str) for v in prefetched.values()))):
            raise BadRequest("prefetched must be a prefetcher's socket path, or {GPU UUID: socket path}",
                             param="prefetched")
        out = self.engine.resume(prefetched)
        emit("resumed", why="asked (after a restore)", seconds=round(out["seconds"], 3), pid=os.getpid())
        self._json(200, out)

    def completions(self) -> None:
        self._generate(self.engine.parse_completion(self._body()), chat=False)

    def chat_completions(self) -> None:
        self._generate(self.engine.parse_chat(self._body()), chat=True)

    def _generate(self, req: dict[str, Any], chat: bool) -> None:
        """A completion (text_completion) or chat completion (chat.completion), whole or streamed as SSE."""
        e = self.engine
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        n_prompt, n_new = len(req["ids"]), req["max_tokens"]
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}
        gen = e.tokens(req["ids"], n_new)
        head = {"id": cid, "created": created, "model": e.model_id}

        def choice(text: str | None, finish: str | None, streamed: bool) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            if streamed:
                delta = {"role": "assistant", "content": text} if text is not None else {}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish}

        if not req["stream"]:
            text = "".join(gen)
            self._json(200, {**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice(text, "length", False)], "usage": usage})
            return
        kind = "chat.completion.chunk" if chat else "text_completion"
        try:
            first = next(gen)  # errors (e.g. released) surface before any header is sent
        except StopIteration:
            first = None
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def event(obj: Any) -> None:
            self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
            self.wfile.flush()

        try:
            while first is not None:
                text, first = first, next(gen, None)
                finish = None if first is not None else "length"
                event({**head, "object": kind, "choices": [choice(text, finish, True)]})
            if req["usage"]:
                event({**head, "object": kind, "choices": [], "usage": usage})
            event(b"[DONE]")
        finally:
            gen.close()  # a client gone mid-stream frees the lock here


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr, engine: Engine) -> None:
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        self.engine = engine
        super().__init__(addr, Handler)


# --- start-up ------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m coldsnap_reference.server",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", required=True, help="safetensors file; generated (seeded) when missing")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile the model steps")
    p.add_argument("--compile-mode", default="default",
                   help='torch.compile mode (default: "default"; CUDA graphs come from --cuda-graphs)')
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="capture CUDA graphs of the prefill and decode steps (default: on with --device cuda)",
    )
    p.add_argument("--compile-cache", default=None,
                   help="inductor cache directory (TORCHINDUCTOR_CACHE_DIR); the process maps compiled kernels from it")
    p.add_argument(
        "--compile-cache-policy",
        choices=("kernels", "all", "fresh"),
        default="kernels",
        help="kernels (default): reuse compiled kernel binaries but trace, lower and generate code on every start "
        "(inductor's FX graph and AOTAutograd caches off), so each start does the real compile work; "
        "all: torch's caches as configured (a warm start skips most of it); "
        "fresh: a new empty cache directory under the cache directory, so even the C++/Triton kernels are rebuilt",
    )
    p.add_argument("--weights-load", choices=("mmap", "copy"), default="mmap")
    p.add_argument("--seed", type=int, default=0, help="seed of generated weights")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--intermediate", type=int, help="MLP width (default: about 8/3 of hidden)")
    p.add_argument("--max-seq", type=int)
    p.add_argument("--prefill-chunk", type=int)
    p.add_argument("--kv-mib", type=float, default=None,
                   help="KV cache buffer size in MiB (default 64 on CPU, 1024 on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default min(2, cpu count))")
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens generated per warm-up prompt")
    p.add_argument("--model-id", "--served-model-name", dest="model_id", default=DEFAULT_MODEL_ID)
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="ranks (one process each, one GPU each from --device on; gloo on CPU); rank 0 serves HTTP")
    p.add_argument("--tp-port", type=int, default=None, help="torch.distributed rendezvous port on 127.0.0.1 "
                   "(default --port + 1)")
    p.add_argument("--nccl-env", default=None, metavar="NCCL_X=V[,NCCL_Y=W]",
                   help="NCCL settings for the ranks (recorded in the capsule's profile), e.g. NCCL_BUFFSIZE=1048576,"
                   "NCCL_MAX_NCHANNELS=2: NCCL's buffers (~9 MiB of pinned host memory per connection by default) "
                   "are pages a capture carries")
    p.add_argument("--template", action="store_true",
                   help="start as a pre-device template: import, config, weights file ensured; no device touched. It "
                   "listens answering 503 {\"status\": \"template\"} until POST /coldsnap/resume loads the "
                   "weights onto the device, builds, compiles, captures graphs and warms up (ColdSnap's "
                   "criu-template snapshot driver captures it before that)")
    p.add_argument("--tp-rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("--tp-fds", default=None, help=argparse.SUPPRESS)  # the command pipes between rank 0 and peers
    return p


def resolve_config(args: argparse.Namespace):
    """Defaults, overlaid by the config beside an existing weights file, overlaid by explicit flags."""
    from coldsnap_reference.model import ModelConfig
    from coldsnap_reference.weights import read_config

    d = ModelConfig().to_dict()
    d.update(read_config(args.weights) or {})
    flags = {
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "intermediate": args.intermediate,
        "max_seq": args.max_seq,
        "prefill_chunk": args.prefill_chunk,
    }
    if args.hidden is not None and args.intermediate is None:
        flags["intermediate"] = int(math.ceil(args.hidden * 8 / 3 / 16) * 16)
    d.update({k: v for k, v in flags.items() if v is not None})
    return ModelConfig.from_dict(d)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    _compile_cache_env(args)  # before torch is imported: inductor reads these at import
    phases: dict[str, float] = {}
    world, rank = args.tensor_parallel, args.tp_rank or 0
    if world < 1 or not 0 <= rank < world:
        emit("fatal", error=f"--tensor-parallel {world} with rank {rank} makes no sense")
        return 2
    if world > 1:
        from coldsnap_reference import tp as tpmod

        if args.tp_rank is None:  # the command as started: become the launcher of the ranks
            try:
                os.environ.update(tpmod.parse_nccl_env(args.nccl_env))
            except ValueError as e:
                emit("fatal", error=str(e))
                return 2
            tpmod.make_capture_safe()  # before any rank or TCPStore exists; inherited by every rank
            return tpmod.launch(argv, world)
        tpmod.die_with_parent()
    capture_env = tpmod.settings_in_force() if world > 1 else {}

    def phase(name: str, t: float, **extra: Any) -> None:
        phases[name] = round(time.monotonic() - t, 4)
        emit("phase", name=name, seconds=phases[name], **extra)

    t = time.monotonic()
    import torch

    from coldsnap_reference import tp as tpmod
    from coldsnap_reference.model import Runner, build_model, check_tensor_parallel, shards, trim_host_memory
    from coldsnap_reference.weights import (
        check_shapes,
        ensure_weights,
        load_into,
        load_prefetched,
        load_weights,
        prefetch_plan,
    )

    threads = args.threads or max(1, min(2, (os.cpu_count() or 1) // world))
    torch.set_num_threads(threads)
    phase("import", t, torch=torch.__version__)

    try:
        cfg = resolve_config(args)
        check_tensor_parallel(cfg, world)
    except (ValueError, TypeError) as e:
        emit("fatal", error=f"bad model config: {e}")
        return 2
    device = torch.device(tpmod.rank_device(args.device, rank) if world > 1 else args.device)
    if args.template and world > 1:
        emit("fatal", error="--template with --tensor-parallel above 1 is not supported")
        return 2

    def device_problem() -> str | None:  # asking torch about CUDA initialises the driver: a template waits
        if device.type == "cuda" and not torch.cuda.is_available():
            return "--device cuda but torch sees no GPU"
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            return f"rank {rank} needs {device} but torch sees {torch.cuda.device_count()} GPU(s)"
        return None

    problem = None if args.template else device_problem()
    if problem:
        emit("fatal", error=problem)
        return 2
    graphs = args.cuda_graphs if args.cuda_graphs is not None else (device.type == "cuda" and world == 1)
    if graphs and world > 1:
        emit("fatal", error="CUDA graphs are not supported with --tensor-parallel above 1 (collectives in graphs)")
        return 2

    peers = None

    def join_group() -> None:
        t = time.monotonic()
        port = args.tp_port or args.port + 1
        tpmod.init_group(rank, world, str(device), port)
        phase("distributed", t, world=world, rank=rank, backend=tpmod.backend_for(str(device)), port=port)

    if rank > 0:  # rank 0 joins once the weights file exists: joining first means it is there to read
        join_group()
    t = time.monotonic()
    try:
        if rank == 0:
            wpath = ensure_weights(args.weights, cfg, seed=args.seed)
        else:  # rank 0 made the file
            wpath = os.path.abspath(args.weights)
            check_shapes(wpath, cfg)
    except (ValueError, OSError) as e:
        emit("fatal", error=str(e))
        return 2
    phase("weights", t, path=wpath, size=os.path.getsize(wpath))
    if world > 1 and rank == 0:
        peers = tpmod.Peers(args.tp_fds)
        join_group()

    mine = shards(cfg, world, rank)
    mode = args.compile_mode if args.compile else None

    def become_ready():
        """Everything that touches the device: load, build, compile, graphs, warm-up. A template runs it at
        resume; a normal start runs it now."""
        t = time.monotonic()
        weights = load_weights(wpath, str(device), args.weights_load, shards=mine)
        phase("load", t, mode=args.weights_load)

        t = time.monotonic()
        model = build_model(cfg, weights, device, world, rank)
        del weights
        kv_mib = args.kv_mib if args.kv_mib is not None else (1024 if device.type == "cuda" else 64)
        runner = Runner(model, device, int(kv_mib * (1 << 20)),
                        reload=lambda: load_weights(wpath, str(device), "mmap", shards=mine),
                        reload_into=lambda params: load_into(wpath, params, shards=mine),
                        reload_prefetched=lambda params, sock: load_prefetched(wpath, params, sock, shards=mine),
                        prefetch_plan=lambda names: prefetch_plan(wpath, names, mine) if mine else None,
                        peers=peers)
        phase("build", t, params=sum(p.numel() for p in model.parameters()), kv_bytes=runner.kv_bytes)
        if mode:
            runner.compile(mode)
        if rank > 0:
            return runner, []
        peer_reports = peers.ready() if peers else []
        if mode:
            t = time.monotonic()
            runner.precompile()  # compile each static shape now, not on a first request
            phase("compile", t, mode=mode)

        if graphs and device.type == "cuda":
            t = time.monotonic()
            if not args.compile:
                runner.precompile()  # eager: still run each shape once before capture
            phase("cuda_graphs", t, graphs=runner.capture_graphs())

        t = time.monotonic()
        n_prompts = runner.warmup(args.warmup_tokens)
        phase("warmup", t, prompts=n_prompts, tokens=args.warmup_tokens)
        return runner, peer_reports

    runner, peer_reports = (None, []) if args.template else become_ready()
    if rank > 0:  # from here on rank 0 drives: every step it runs, this rank runs too
        trim_host_memory()
        return tpmod.serve_rank(runner, args.tp_fds, {"rank": rank, "device": str(device), "pid": os.getpid(),
                                                           "phases": phases})

    info = {
        "engine": ENGINE_NAME,
        "version": ENGINE_VERSION,
        "model": args.model_id,
        "device": str(device),
        "weights": {"path": wpath, "size": os.path.getsize(wpath), "load": args.weights_load, "seed": args.seed},
        "config": cfg.to_dict(),
        "compile": {
            "enabled": bool(args.compile),
            "mode": mode,
            "cache_dir": _inductor_cache_dir() if args.compile else None,
            "cache_policy": args.compile_cache_policy,
        },
        "cuda_graphs": bool(runner and runner._graphs),
        "kv_bytes": runner.kv_bytes if runner else None,
        "template": runner is None,
        "threads": threads,
        "torch": torch.__version__,
        "startup_phases": dict(phases),
        "tensor_parallel": {
            "size": world,
            "backend": tpmod.backend_for(str(device)) if world > 1 else None,
            "devices": [tpmod.rank_device(args.device, r) for r in range(world)] if world > 1 else [str(device)],
            "settings": capture_env,
            "ranks": [{"rank": 0, "pid": os.getpid(), "device": str(device)}]
            + [{k: r[k] for k in ("rank", "pid", "device")} for r in peer_reports],
        },
    }

    def ready_from_template():
        t = time.monotonic()
        problem = device_problem()  # the first question to torch about the device initialises CUDA
        phase("cuda_init", t)
        if problem:
            raise BadRequest(problem, 500, code="device")
        built, _ = become_ready()
        info.update({"cuda_graphs": bool(built._graphs), "kv_bytes": built.kv_bytes, "template": False,
                     "startup_phases": dict(phases)})
        return built

    t = time.monotonic()
    engine = Engine(runner, args.model_id, info, become_ready=ready_from_template if runner is None else None)
    try:
        httpd = Server((args.host, args.port), engine)
    except OSError as e:
        emit("fatal", error=f"cannot listen on {args.host}:{args.port}: {e}")
        return 2
    phase("listen", t)
    info["startup_phases"] = dict(phases)
    info["startup_seconds"] = round(time.monotonic() - _T0, 4)
    trim_host_memory()
    host, port = httpd.server_address[:2]
    emit(
        "template-ready" if runner is None else "ready",
        host=host,
        port=port,
        model=args.model_id,
        device=str(device),
        seconds=info["startup_seconds"],
        phases=phases,
        rss_bytes=_rss_bytes(),
        pid=os.getpid(),
    )
    try:
        httpd.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0


def _compile_cache_env(args: argparse.Namespace) -> None:
    if args.compile_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(args.compile_cache)
    if args.compile_cache_policy in ("kernels", "fresh"):
        os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
        os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    if args.compile_cache_policy == "fresh" and args.compile:
        import tempfile

        root = (os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                or os.path.join(tempfile.gettempdir(), f"torchinductor_uid{os.getuid()}"))
        os.makedirs(root, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fresh-", dir=root)


def _inductor_cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:  # private API; informational only
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR")


if __name__ == "__main__":
    sys.exit(main())
