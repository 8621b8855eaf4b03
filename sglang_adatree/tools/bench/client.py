"""The load generator: requests over SGLang's streaming ``/generate`` API, timed per request.

Two kinds of load, as SGLang's and vLLM's serving benchmarks offer:

* ``concurrency``: a closed loop of C clients; each sends its next request when the previous
  one finished, so the server always holds about C requests. The server's speed sets the pace,
  so goodput compares policies directly.
* ``rate``: an open loop with Poisson arrivals at R requests per second (exponential gaps from
  a seeded generator). Below the server's capacity goodput is capped by the offered load, and
  the policies differ in TPOT and TTFT instead.

Per request: TTFT = time to the first streamed chunk carrying a token; TPOT = the time from
that chunk to the last token-carrying chunk but one, over the tokens between them
(``Streamed.steady_tpot_ms``), or (end - first token) / (output tokens - 1) where the stream
had fewer than three such chunks; the output token count and SGLang's ``spec_verify_ct``
(verify steps of that request) come from the final ``meta_info``. Decoding is greedy
(temperature 0), so every policy generates the same tokens and only the time differs.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests


@dataclass(frozen=True)
class Load:
    """One load level: ``concurrency`` clients, or Poisson arrivals at ``rate`` requests/s."""

    kind: str  # "concurrency" | "rate"
    value: float

    def __post_init__(self) -> None:
        if self.kind not in ("concurrency", "rate") or self.value <= 0:
            raise ValueError(f"bad load {self.kind}={self.value}")
        if self.kind == "concurrency" and not float(self.value).is_integer():
            raise ValueError(f"concurrency must be a whole number, got {self.value}")

    def __str__(self) -> str:
        if self.kind == "concurrency":
            return f"c{int(self.value)}"
        return f"r{self.value:g}"

    @classmethod
    def parse(cls, text: str) -> Load:
        """``c4`` / ``concurrency:4`` (4 clients) or ``r0.5`` / ``rate:0.5`` (requests/s)."""
        raw = text.strip().lower()
        for prefix, kind in (("concurrency:", "concurrency"), ("rate:", "rate")):
            if raw.startswith(prefix):
                return cls(kind, float(raw[len(prefix) :]))
        if raw[:1] in ("c", "r"):
            try:
                return cls("concurrency" if raw[0] == "c" else "rate", float(raw[1:]))
            except ValueError:
                pass
        raise ValueError(f"load {text!r}: expected c<clients> or r<requests per second>")

    @property
    def sort_key(self) -> tuple[int, float]:
        return (0 if self.kind == "concurrency" else 1, self.value)


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it; times in ms, ``sent_s`` from the point's start."""

    index: int
    phase: str
    sent_s: float
    ttft_ms: float | None
    latency_ms: float
    output_tokens: int
    spec_verify_ct: int
    error: str | None = None
    # ``Streamed.steady_tpot_ms`` of the request's stream; None where it had none.
    steady_tpot_ms: float | None = None

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first: the stream's steady TPOT where it had one
        (``Streamed.steady_tpot_ms``: policies compared against ``ar`` then count the same steps),
        else (latency - TTFT) / (output tokens - 1); None with fewer than two tokens."""
        return tpot_ms(self.ttft_ms, self.latency_ms, self.output_tokens, self.steady_tpot_ms)


def tpot_ms(
    ttft_ms: float | None, latency_ms: float, output_tokens: int, steady_tpot_ms: float | None
) -> float | None:
    """A request's TPOT: ``steady_tpot_ms`` where its stream had one, else (latency - TTFT) /
    (output tokens - 1); None without a first token or with fewer than two tokens."""
    if ttft_ms is None or output_tokens < 2:
        return None
    if steady_tpot_ms is not None:
        return steady_tpot_ms
    return (latency_ms - ttft_ms) / (output_tokens - 1)


@dataclass(frozen=True)
class PointResult:
    """Every request of one (workload, load) point and the wall-clock window it ran in."""

    requests: tuple[RequestResult, ...]
    started_at: float  # unix seconds
    finished_at: float


@dataclass(frozen=True)
class Streamed:
    """What one streamed request returned: first-token time, tokens, verify steps, the
    generated text (SGLang streams it cumulatively: the last chunk's), error."""

    ttft_ms: float | None
    output_tokens: int = 0
    spec_verify_ct: int = 0
    error: str | None = None
    text: str = ""
    first_tokens: int = 0  # tokens the first chunk carried
    # Of the chunks that carried tokens, the last but one: when it came (ms from the request)
    # and the tokens so far; None with a single such chunk.
    penultimate: tuple[float, int] | None = None

    @property
    def steady_tpot_ms(self) -> float | None:
        """Time per token from the first token-carrying chunk to the last but one, over the
        tokens between them; None with fewer than three such chunks.

        A server that streams each token a step late (SGLang's overlap scheduler) sends its
        first token after its first decode step and its last two together: TPOT from the first
        token to the last reads one step short of its steps. Leaving out the last chunk counts
        the same steps for either kind of server (docs/results.md)."""
        if self.ttft_ms is None or self.penultimate is None:
            return None
        at_ms, tokens = self.penultimate
        if tokens <= self.first_tokens:
            return None
        return (at_ms - self.ttft_ms) / (tokens - self.first_tokens)


def stream_generate(
    session: requests.Session,
    url: str,
    text: str,
    max_new_tokens: int,
    timeout_s: float,
    ignore_eos: bool = False,
) -> Streamed:
    """One greedy request over ``/generate`` with ``stream: true``, read chunk by chunk;
    ``ignore_eos`` makes it produce exactly ``max_new_tokens`` (unless the context fills)."""
    sampling: dict = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    if ignore_eos:
        sampling["ignore_eos"] = True
    payload = {"text": text, "sampling_params": sampling, "stream": True}
    start = time.perf_counter()
    ttft_ms = None
    meta: dict = {}
    output = ""
    # (ms from the request, tokens so far) of the last two chunks that carried tokens, and
    # the first's tokens
    before_last: tuple[float, int] | None = None
    last: tuple[float, int] | None = None
    first_tokens = 0
    try:
        with session.post(f"{url}/generate", json=payload, stream=True, timeout=timeout_s) as r:
            if r.status_code != 200:
                return Streamed(None, error=f"HTTP {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Streamed(ttft_ms, error=str(chunk["error"])[:200])
                meta = chunk.get("meta_info") or meta
                output = chunk.get("text", output)
                tokens = int(meta.get("completion_tokens", 0))
                if tokens >= 1 and (last is None or tokens > last[1]):
                    now_ms = (time.perf_counter() - start) * 1000.0
                    if ttft_ms is None:
                        ttft_ms, first_tokens = now_ms, tokens
                    else:
                        before_last = last
                    last = (now_ms, tokens)
    except (requests.RequestException, json.JSONDecodeError) as exc:
        return Streamed(ttft_ms, error=f"{type(exc).__name__}: {exc}"[:200])
    tokens = int(meta.get("completion_tokens", 0))
    if tokens == 0:
        return Streamed(ttft_ms, error="no tokens generated")
    return Streamed(
        ttft_ms,
        tokens,
        int(meta.get("spec_verify_ct") or 0),
        text=output,
        first_tokens=first_tokens,
        penultimate=before_last,
    )


def poisson_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Arrival times in seconds from the start: cumulative exponential gaps, first at 0."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def run_point(
    url: str,
    texts: Sequence[str],
    phases: Sequence[str],
    load: Load,
    max_new_tokens: int,
    seed: int = 0,
    timeout_s: float = 1800.0,
    on_done: Callable[[RequestResult], None] | None = None,
) -> PointResult:
    """Send every text at ``load`` and wait for all of them; ``on_done`` per finished request."""
    assert len(texts) == len(phases), "one phase label per text"
    local = threading.local()
    origin = time.perf_counter()
    started_at = time.time()

    def send(i: int) -> RequestResult:
        session = getattr(local, "session", None)
        if session is None:
            session = local.session = requests.Session()
        sent = time.perf_counter()
        streamed = stream_generate(session, url, texts[i], max_new_tokens, timeout_s)
        result = RequestResult(
            index=i,
            phase=phases[i],
            sent_s=sent - origin,
            ttft_ms=streamed.ttft_ms,
            latency_ms=(time.perf_counter() - sent) * 1000.0,
            output_tokens=streamed.output_tokens,
            spec_verify_ct=streamed.spec_verify_ct,
            error=streamed.error,
            steady_tpot_ms=streamed.steady_tpot_ms,
        )
        if on_done is not None:
            on_done(result)
        return result

    if load.kind == "concurrency":
        # A pool of C workers taking requests in order is exactly a closed loop of C clients.
        workers, task = int(load.value), send
    else:
        offsets = poisson_offsets(len(texts), load.value, seed)

        def arrive(i: int) -> RequestResult:
            delay = offsets[i] - (time.perf_counter() - origin)
            if delay > 0:
                time.sleep(delay)
            return send(i)

        workers, task = len(texts), arrive
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        results = list(pool.map(task, range(len(texts))))
    finally:
        # On an interrupt, return at once: stopping the server ends the requests in flight.
        pool.shutdown(wait=False, cancel_futures=True)
    return PointResult(tuple(results), started_at, time.time())
