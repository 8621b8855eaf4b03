"""Requests a server must refuse with a clear 4xx and survive: an empty prompt on every
endpoint, an absurd ``max_new_tokens``, invalid sampling parameters, a prompt longer than the
context, malformed JSON.

A refusal is *clear* when its status is 4xx and its body carries a message. A streamed
``/generate`` has answered 200 before its prompt is checked, so there the refusal is the
stream's error event with a 4xx ``code`` (``docs/usage.md``, *Empty prompts*).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import requests

TIMEOUT_S = (10.0, 120.0)
# Longer than SmolLM2's (and most small models') 8,192-token context.
TOO_LONG_WORDS = 10_000


@dataclass(frozen=True)
class BadRequest:
    name: str
    route: str
    body: dict | None  # None: ``raw`` is sent as the JSON body
    raw: bytes = b""
    streamed: bool = False


def bad_requests() -> tuple[BadRequest, ...]:
    long_text = "hello " * TOO_LONG_WORDS
    chat = "/v1/chat/completions"
    return (
        BadRequest("empty text", "/generate", {"text": "", "sampling_params": {}}),
        BadRequest("empty input_ids", "/generate", {"input_ids": [], "sampling_params": {}}),
        BadRequest(
            "empty text, streamed", "/generate", {"text": "", "stream": True}, streamed=True
        ),
        BadRequest("empty completions prompt", "/v1/completions", {"model": "m", "prompt": ""}),
        BadRequest("empty chat messages", chat, {"model": "m", "messages": []}),
        BadRequest(
            "absurd max_new_tokens",
            "/generate",
            {"text": "Hi", "sampling_params": {"max_new_tokens": 10**9}},
        ),
        BadRequest(
            "absurd max_tokens",
            "/v1/completions",
            {"model": "m", "prompt": "Hi", "max_tokens": 10**9},
        ),
        BadRequest(
            "negative temperature",
            "/generate",
            {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": -1}},
        ),
        BadRequest(
            "top_p above 1",
            chat,
            {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "top_p": 2.0},
        ),
        BadRequest(
            "top_k 0",
            "/generate",
            {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "top_k": 0}},
        ),
        BadRequest(
            "prompt longer than the context",
            "/generate",
            {"text": long_text, "sampling_params": {"max_new_tokens": 4}},
        ),
        BadRequest(
            "completions prompt longer than the context",
            "/v1/completions",
            {"model": "m", "prompt": long_text, "max_tokens": 4},
        ),
        BadRequest("malformed JSON", "/generate", None, raw=b'{"text": "Hi", '),
        BadRequest("malformed JSON, completions", "/v1/completions", None, raw=b'{"prompt": '),
        BadRequest("malformed JSON, chat", chat, None, raw=b"[{"),
    )


@dataclass(frozen=True)
class Refusal:
    """How the server answered one bad request."""

    name: str
    status: int | None  # None: no HTTP answer
    message: str
    clear: bool


def _message(body: object) -> str:
    if isinstance(body, dict):
        err = body.get("error", body.get("message"))
        if isinstance(err, dict):
            err = err.get("message")
        return str(err or "")
    return ""


def send(url: str, bad: BadRequest) -> Refusal:
    try:
        if bad.body is None:
            r = requests.post(
                f"{url}{bad.route}",
                data=bad.raw,
                headers={"Content-Type": "application/json"},
                timeout=TIMEOUT_S,
            )
        else:
            r = requests.post(f"{url}{bad.route}", json=bad.body, timeout=TIMEOUT_S)
    except requests.RequestException as exc:
        return Refusal(bad.name, None, f"{type(exc).__name__}: {exc}"[:200], False)
    if bad.streamed and r.status_code == 200:
        for line in r.text.splitlines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                event = json.loads(line[5:])
                code = (event.get("error") or {}).get("code")
                message = _message(event)
                clear = isinstance(code, int) and 400 <= code < 500 and bool(message)
                return Refusal(bad.name, code, message[:200], clear)
        return Refusal(bad.name, 200, "stream without an error event", False)
    try:
        message = _message(r.json())
    except ValueError:
        message = r.text
    clear = 400 <= r.status_code < 500 and bool(message.strip())
    return Refusal(bad.name, r.status_code, message[:200], clear)


class BadRequestTally:
    """Every bad request sent, by kind: refused clearly or not."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.clear: Counter[str] = Counter()
        self.unclear: list[Refusal] = []
        self.examples: dict[str, Refusal] = {}

    def round(self, url: str) -> None:
        """One of each kind (called from one thread)."""
        for bad in bad_requests():
            refusal = send(url, bad)
            self.sent[bad.name] += 1
            self.examples.setdefault(bad.name, refusal)
            if refusal.clear:
                self.clear[bad.name] += 1
            else:
                self.unclear.append(refusal)

    def to_json(self) -> dict:
        return {
            "sent": sum(self.sent.values()),
            "refused_clearly": sum(self.clear.values()),
            "not_refused_clearly": [r.__dict__ for r in self.unclear[:20]],
            "by_kind": {
                name: {
                    "sent": n,
                    "status": self.examples[name].status,
                    "message": self.examples[name].message,
                }
                for name, n in self.sent.items()
            },
        }
