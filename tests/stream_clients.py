"""Streaming completion clients in a process of their own (not the test's: ColdSnap's capture must not share a GIL
with 16 busy readers, and a client is nothing of ColdSnap's).

    python stream_clients.py HOST PORT MODEL MAX_TOKENS PACE PROMPT [PROMPT ...]

Starts one streamed temperature-0 completion per prompt, concurrently, each on its own TCP connection. Prints
`started N` once every stream has received its first token, then, when all are done, one JSON line: per stream its
text, the CLOCK_MONOTONIC time of every token (comparable with the test's time.monotonic()) and any error. The
socket timeout is long: a stream is expected to pause while its server is checkpointed and restored.

PACE (tokens per second, 0 = as fast as they come) makes each client read no faster than that, so a stream stays in
flight for at least MAX_TOKENS / PACE seconds however fast the server generates: the unread rest waits in the
server and in the socket buffers, which a capture then carries too."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time


def stream(host: str, port: int, model: str, prompt: str, max_tokens: int, pace: float, out: dict,
           first: threading.Semaphore) -> None:
    out.update(text="", times=[], error=None)
    pieces: list[str] = []
    try:
        conn = http.client.HTTPConnection(host, port, timeout=900)
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps({
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}))
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read(200)!r}")
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            text = json.loads(data)["choices"][0].get("text", "")
            out["times"].append(time.monotonic())
            pieces.append(text)
            if len(out["times"]) == 1:
                first.release()
            if pace:
                time.sleep(max(0.0, out["times"][0] + len(out["times"]) / pace - time.monotonic()))
        conn.close()
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        out["error"] = f"{type(e).__name__}: {e}"
        if not out["times"]:
            first.release()
    out["text"] = "".join(pieces)


def main(argv: list[str]) -> int:
    host, port, model, prompts = argv[0], int(argv[1]), argv[2], argv[5:]
    max_tokens, pace = int(argv[3]), float(argv[4])
    results = [dict() for _ in prompts]
    first = threading.Semaphore(0)
    threads = [threading.Thread(target=stream, args=(host, port, model, p, max_tokens, pace, r, first), daemon=True)
               for p, r in zip(prompts, results)]
    for t in threads:
        t.start()
    for _ in prompts:
        first.acquire()
    print(f"started {len(prompts)}", flush=True)
    for t in threads:
        t.join()
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
