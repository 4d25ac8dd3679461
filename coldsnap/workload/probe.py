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

    def healthy(self) -> bool:
        try:
            conn = self._conn(2.0)
            conn.request("GET", self.validation.health_path, headers={"Connection": "close"})
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except (OSError, http.client.HTTPException):
            return False

    def wait_ready(self, alive: Callable[[], bool] | None = None, timeout: float | None = None,
                   interval: float = 0.01) -> float:
        """Poll the health endpoint; fail fast if the workload died. Returns the monotonic time it answered."""
        timeout = timeout or self.validation.ready_timeout_s
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy():
                return time.monotonic()
            if alive is not None and not alive():
                raise ColdSnapError(ErrorCode.WORKLOAD_FAILED, "the workload exited before it became ready")
            time.sleep(interval)
        raise ColdSnapError(ErrorCode.VALIDATION_TIMEOUT,
                            f"the workload did not become ready within {timeout:.0f} s ({self.validation.health_path})")

    def wait_template(self, alive: Callable[[], bool] | None = None, timeout: float | None = None) -> float:
        """Poll /coldsnap/info until the engine says it is a template ready to be captured (it listens, but serves
        nothing until it is resumed). Returns the monotonic time it said so."""
        timeout = timeout or self.validation.ready_timeout_s
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                conn = self._conn(2.0)
                conn.request("GET", "/coldsnap/info", headers={"Connection": "close"})
                resp = conn.getresponse()
                info = json.loads(resp.read()) if resp.status == 200 else {}
                conn.close()
                if info.get("template") is True:
                    return time.monotonic()
            except (OSError, http.client.HTTPException, ValueError):
                pass
            if alive is not None and not alive():
                raise ColdSnapError(ErrorCode.WORKLOAD_FAILED, "the workload exited before its template was ready")
            time.sleep(0.02)
        raise ColdSnapError(ErrorCode.VALIDATION_TIMEOUT, f"the template did not become ready within {timeout:.0f} s")

    def _served_model(self) -> str:
        """The first model id /v1/models lists (OpenAI servers insist on a known model name)."""
        try:
            conn = self._conn(10.0)
            conn.request("GET", "/v1/models", headers={"Connection": "close"})
            data = json.loads(conn.getresponse().read())
            conn.close()
            return data["data"][0]["id"]
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
