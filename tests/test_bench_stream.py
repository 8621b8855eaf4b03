"""How the benchmark client times a streamed request, against a local server that streams as
SGLang does (``data:`` lines of cumulative ``meta_info``)."""

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import requests

from sglang_adatree.tools.bench.client import Load, Streamed, run_point, stream_generate

STEP_S = 0.05


def _chunk(tokens: int) -> bytes:
    body = {"text": "x" * tokens, "meta_info": {"completion_tokens": tokens}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class _Handler(BaseHTTPRequestHandler):
    # Chunked, as SGLang's server streams: each chunk reaches the client when sent.
    protocol_version = "HTTP/1.1"
    # Per chunk: seconds to wait before it, and the tokens so far.
    schedule: ClassVar[list[tuple[float, int]]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for wait_s, tokens in self.schedule:
            time.sleep(wait_s)
            self._send(_chunk(tokens))
        self._send(b"data: [DONE]\n\n")
        self._send(b"")

    def _send(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _serving(schedule: list[tuple[float, int]]) -> Iterator[str]:
    """A local server that answers every request with ``schedule``; yields its URL."""
    handler = type("Handler", (_Handler,), {"schedule": schedule})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _stream(schedule: list[tuple[float, int]]) -> Streamed:
    with _serving(schedule) as url:
        return stream_generate(requests.Session(), url, "hi", 16, timeout_s=30)


def _synchronous(tokens: int) -> list[tuple[float, int]]:
    """The first token after the prefill, then one a step."""
    return [(STEP_S, 1)] + [(STEP_S, k) for k in range(2, tokens + 1)]


def _overlapped(tokens: int) -> list[tuple[float, int]]:
    """Every token a step late, the first included; the last two together."""
    return [(2 * STEP_S, 1)] + [(STEP_S, k) for k in range(2, tokens)] + [(0.0, tokens)]


def test_a_server_that_streams_a_step_late_counts_the_same_steps():
    tokens = 6
    for schedule in (_synchronous(tokens), _overlapped(tokens)):
        streamed = _stream(schedule)
        assert streamed.output_tokens == tokens and streamed.first_tokens == 1
        assert streamed.penultimate is not None and streamed.penultimate[1] == tokens - 1
        # Both ran tokens - 1 steps; from the first chunk to the last but one, both count
        # tokens - 2 of them.
        assert streamed.steady_tpot_ms == pytest.approx(1000 * STEP_S, rel=0.1)
    # From the first token to the last (which comes with the one before it), the overlapped
    # server counts one step fewer than it ran: 4 of 5.
    assert streamed.ttft_ms is not None and streamed.penultimate is not None
    naive = (streamed.penultimate[0] - streamed.ttft_ms) / (tokens - 1)
    assert naive < 0.9 * 1000 * STEP_S


def test_chunks_of_several_tokens_count_their_tokens():
    # A speculative server: 1 token after the prefill, then 3, 2 and 4 a step.
    streamed = _stream([(STEP_S, 1), (STEP_S, 4), (STEP_S, 6), (STEP_S, 10)])
    assert streamed.output_tokens == 10 and streamed.first_tokens == 1
    assert streamed.penultimate is not None and streamed.penultimate[1] == 6
    assert streamed.steady_tpot_ms == pytest.approx(2 * 1000 * STEP_S / 5, rel=0.1)


def test_steady_tpot_needs_three_chunks():
    assert _stream([(0.0, 1), (STEP_S, 2)]).steady_tpot_ms is None
    assert Streamed(100.0, 5, first_tokens=1, penultimate=(300.0, 3)).steady_tpot_ms == 100.0
    assert Streamed(None, 5, first_tokens=1, penultimate=(300.0, 3)).steady_tpot_ms is None


def test_the_benchmark_counts_the_same_steps_for_both_servers():
    # ``adatree bench`` compares policies served by both kinds of server against ``ar``.
    tokens = 6
    for schedule in (_synchronous(tokens), _overlapped(tokens)):
        with _serving(schedule) as url:
            point = run_point(url, ["hi"], [""], Load("concurrency", 1), 16, timeout_s=30)
        (result,) = point.requests
        assert result.error is None and result.output_tokens == tokens
        assert result.tpot_ms == pytest.approx(1000 * STEP_S, rel=0.1)


def test_the_benchmark_falls_back_to_the_first_token_and_the_last():
    with _serving([(STEP_S, 1), (2 * STEP_S, 3)]) as url:
        point = run_point(url, ["hi"], [""], Load("concurrency", 1), 16, timeout_s=30)
    (result,) = point.requests
    assert result.steady_tpot_ms is None and result.ttft_ms is not None
    assert result.tpot_ms == pytest.approx((result.latency_ms - result.ttft_ms) / 2)
    assert result.tpot_ms == pytest.approx(1000 * STEP_S, rel=0.2)
