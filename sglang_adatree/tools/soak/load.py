"""The soak's load: a rate that moves (idle, bursts of concurrent clients, Poisson arrivals),
streamed requests of which some disconnect mid-stream, and the fixed greedy prompts whose
answers are compared token for token with the reference server's.

Streamed requests go to ``/generate`` with ``stream: true``, half greedy and half sampled
(temperature 0.8, top-p 0.95: the distribution-preserving verification); a fraction of them
(``abort_fraction``) close the connection after one to three chunks, as a client that gives up
does, which SGLang turns into an abort of the request in flight. Every ``greedy_every``-th
request is instead one of the fixed greedy prompts, non-streamed, its ``output_ids`` checked.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Sequence

import requests

from sglang_adatree.tools.soak.schedule import Phase, Schedule
from sglang_adatree.tools.soak.tally import (
    ABORTED,
    SERVED,
    GreedyAnswers,
    RequestTally,
    SoakClock,
)

STREAM_NEW_TOKENS = 48
GREEDY_NEW_TOKENS = 32
MAX_IN_FLIGHT = 16  # Poisson arrivals past this wait: a slow server must not grow threads
TIMEOUT_S = (10.0, 600.0)  # connect, read


def chat_texts(target_dir: str, prompts: Sequence[str]) -> tuple[str, ...]:
    """User messages in the target's chat template, ready for ``/generate``'s ``text``: the
    instruct model answers them instead of ending at once."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return tuple(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    )


def greedy_ids(url: str, texts: Sequence[str], max_new_tokens: int = GREEDY_NEW_TOKENS) -> list:
    """The server's greedy token ids for ``texts``, one batch request (the reference's)."""
    response = requests.post(
        f"{url}/generate",
        json={
            "text": list(texts),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
        },
        timeout=TIMEOUT_S,
    )
    response.raise_for_status()
    return [tuple(r["output_ids"]) for r in response.json()]


def _failure(exc: Exception) -> str:
    if isinstance(exc, requests.Timeout):
        return "timeout"
    if isinstance(exc, requests.ConnectionError):
        return "connection"
    return type(exc).__name__


def stream_once(
    session: requests.Session, url: str, text: str, sampled: bool, abort_after: int | None
) -> tuple[str, str]:
    """One streamed request: (outcome, detail). ``abort_after`` chunks, then disconnect."""
    sampling: dict = {"max_new_tokens": STREAM_NEW_TOKENS, "temperature": 0.0}
    if sampled:
        sampling.update(temperature=0.8, top_p=0.95)
    body = {"text": text, "sampling_params": sampling, "stream": True}
    chunks = 0
    try:
        with session.post(f"{url}/generate", json=body, stream=True, timeout=TIMEOUT_S) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}", r.text[:200]
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return (SERVED, "") if chunks else ("no_tokens", "")
                chunk = json.loads(data)
                if "error" in chunk:
                    return "stream_error", str(chunk["error"])[:200]
                chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    return ABORTED, ""  # leaving the block closes the connection
    except (requests.RequestException, json.JSONDecodeError) as exc:
        return _failure(exc), str(exc)[:200]
    return "truncated_stream", f"{chunks} chunks without [DONE]"


class LoadGenerator:
    """Sends the soak's load to ``url`` until ``stop`` is set; see the module docstring."""

    def __init__(
        self,
        url: str,
        schedule: Schedule,
        texts: Sequence[str],
        greedy: GreedyAnswers,
        clock: SoakClock,
        seed: int = 0,
    ) -> None:
        self.url = url
        self.schedule = schedule
        self.texts = tuple(texts)
        self.greedy = greedy
        self.clock = clock
        self.tally = RequestTally()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._count = 0
        self._in_flight = threading.BoundedSemaphore(MAX_IN_FLIGHT)
        self._local = threading.local()
        self._threads: list[threading.Thread] = []

    def run(self, stop: threading.Event) -> None:
        """The phases in turn until ``stop``; then waits for the requests in flight."""
        while not stop.is_set():
            phase, left = self.schedule.phase_at(self.clock.now())
            until = self.clock.now() + left
            if phase.phase is Phase.IDLE:
                stop.wait(left)
            elif phase.phase is Phase.BURST:
                self._burst(until, stop)
            else:
                self._poisson(until, stop)
        for t in self._threads:
            t.join(timeout=TIMEOUT_S[1])

    def send_one(self, phase: str) -> None:
        """The next request of the mix: a fixed greedy prompt or a streamed one."""
        with self._lock:
            n = self._count
            self._count += 1
            sampled = self._rng.random() < 0.5
            abort_after = (
                self._rng.randint(1, 3)
                if self._rng.random() < self.schedule.abort_fraction
                else None
            )
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        if n % self.schedule.greedy_every == self.schedule.greedy_every - 1:
            self._greedy_once(session, (n // self.schedule.greedy_every) % len(self.greedy.texts))
            return
        outcome, detail = stream_once(
            session, self.url, self.texts[n % len(self.texts)], sampled, abort_after
        )
        self.tally.add(outcome, phase, detail)

    def _greedy_once(self, session: requests.Session, index: int) -> None:
        body = {
            "text": self.greedy.texts[index],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": GREEDY_NEW_TOKENS},
        }
        try:
            r = session.post(f"{self.url}/generate", json=body, timeout=TIMEOUT_S)
        except requests.RequestException as exc:
            self.tally.add(_failure(exc), "greedy", str(exc))
            return
        if r.status_code != 200:
            self.tally.add(f"http_{r.status_code}", "greedy", r.text)
            return
        self.greedy.check(index, r.json()["output_ids"], self.clock.now())
        self.tally.add(SERVED, "greedy")

    def _burst(self, until: float, stop: threading.Event) -> None:
        def client() -> None:
            while self.clock.now() < until and not stop.is_set():
                self.send_one(str(Phase.BURST))

        # The clients start no request after the phase; those in flight finish while the next
        # phase begins, as a real burst tails off.
        clients = [
            threading.Thread(target=client, name=f"soak-burst-{i}", daemon=True)
            for i in range(self.schedule.burst_concurrency)
        ]
        for c in clients:
            c.start()
        self._threads = [t for t in self._threads if t.is_alive()] + clients
        stop.wait(max(0.0, until - self.clock.now()))

    def _poisson(self, until: float, stop: threading.Event) -> None:
        while not stop.is_set():
            gap = self._rng.expovariate(self.schedule.poisson_rate)
            if self.clock.now() + gap >= until:
                stop.wait(max(0.0, until - self.clock.now()))
                return
            if stop.wait(gap):
                return
            if not self._in_flight.acquire(timeout=max(0.0, until - self.clock.now())):
                return
            thread = threading.Thread(target=self._arrival, name="soak-poisson", daemon=True)
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _arrival(self) -> None:
        try:
            self.send_one(str(Phase.POISSON))
        finally:
            self._in_flight.release()
