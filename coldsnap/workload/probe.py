"""The validation probe: one implementation of "is this server really serving", used by capture, restore,
bench, the shim's hooks and cold fallback alike. A server is valid only after a real completion."""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from coldsnap.contracts import ColdSnapError, ErrorCode, Validation


def completion_stream(resp) -> Iterator[str]:
    """The text of each event of an OpenAI streamed completion (server-sent events), until [DONE]."""
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)["choices"][0].get("text", "")


@dataclass
class ProbeResult:
    text: str
    first_token_s: float  # monotonic time the first non-empty token arrived
    done_s: float
    tokens: int


class ValidationProbe:
    def __init__(self, host: str, port: int, validation: Validation, model: str = ""):
        self.host, self.port, self.validation, self.model = host, port, validation, model

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _get(self, path: str, timeout: float, body: bool = True) -> tuple[int, bytes]:
        """GET path: the status, and the body unless body is False."""
        conn = self._conn(timeout)
        try:
            conn.request("GET", path, headers={"Connection": "close"})
            resp = conn.getresponse()
            return resp.status, resp.read() if body else b""
        finally:
            conn.close()

    def healthy(self) -> bool:
        try:
            return self._get(self.validation.health_path, 2.0, body=False)[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def _template(self) -> bool:
        try:
            status, body = self._get("/coldsnap/info", 2.0)
            return status == 200 and json.loads(body).get("template") is True
        except (OSError, http.client.HTTPException, ValueError):
            return False

    def _poll(self, ready: Callable[[], bool], alive: Callable[[], bool] | None, timeout: float, interval: float,
              what: str, late: str) -> float:
        """Poll ready() until it holds (the monotonic time it did); fail fast if the workload died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return time.monotonic()
            if alive is not None and not alive():
                raise ColdSnapError(ErrorCode.WORKLOAD_FAILED, f"the workload exited before {what}")
            time.sleep(interval)
        raise ColdSnapError(ErrorCode.VALIDATION_TIMEOUT, late)

    def wait_ready(self, alive: Callable[[], bool] | None = None, timeout: float | None = None,
                   interval: float = 0.01) -> float:
        """Poll the health endpoint. Returns the monotonic time it answered."""
        timeout = timeout or self.validation.ready_timeout_s
        return self._poll(self.healthy, alive, timeout, interval, "it became ready",
                          f"the workload did not become ready within {timeout:.0f} s ({self.validation.health_path})")

    def wait_template(self, alive: Callable[[], bool] | None = None, timeout: float | None = None) -> float:
        """Poll /coldsnap/info until the engine says it is a template ready to be captured (it listens, but serves
        nothing until it is resumed). Returns the monotonic time it said so."""
        timeout = timeout or self.validation.ready_timeout_s
        return self._poll(self._template, alive, timeout, 0.02, "its template was ready",
                          f"the template did not become ready within {timeout:.0f} s")

    def _served_model(self) -> str:
        """The first model id /v1/models lists (OpenAI servers insist on a known model name)."""
        try:
            return json.loads(self._get("/v1/models", 10.0)[1])["data"][0]["id"]
        except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError):
            return ""

    def complete(self, expected: str | None = None) -> ProbeResult:
        """A streamed temperature-0 completion; the first non-empty token's arrival is the time to first token."""
        if not self.model:
            self.model = self._served_model()
        body = json.dumps({"model": self.model, "prompt": self.validation.prompt,
                           "max_tokens": self.validation.max_tokens, "temperature": 0, "stream": True})
        pieces: list[str] = []
        first = None
        try:
            conn = self._conn(self.validation.request_timeout_s)
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json", "Connection": "close"})
            resp = conn.getresponse()
            if resp.status != 200:
                body = resp.read(200).decode(errors="replace")
                raise ColdSnapError(ErrorCode.VALIDATION_FAILED, f"completion answered HTTP {resp.status}: {body}")
            for text in completion_stream(resp):
                if text and first is None:
                    first = time.monotonic()
                pieces.append(text)
            conn.close()
        except (OSError, http.client.HTTPException, socket.timeout, ValueError, KeyError) as e:
            raise ColdSnapError(ErrorCode.VALIDATION_FAILED, f"completion request failed: {e}") from None
        done = time.monotonic()
        text = "".join(pieces)
        if not text:
            raise ColdSnapError(ErrorCode.VALIDATION_FAILED, "the completion was empty")
        want = expected if expected is not None else self.validation.expected_text
        if want is not None and text != want:
            raise ColdSnapError(ErrorCode.VALIDATION_FAILED,
                                f"the completion differs from the expected text: got {text[:60]!r}, want {want[:60]!r}")
        return ProbeResult(text=text, first_token_s=first or done, done_s=done, tokens=len(pieces))
