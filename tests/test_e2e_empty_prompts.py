"""Empty prompts on a real adatree server: each form is refused with 400, the server goes on.

Upstream SGLang 0.5.23 sends a prompt of zero tokens to the scheduler, whose prefill dies on it
and takes the whole server down (``sglang_adatree.sglang.empty_prompts``). One server serves
every case here: the empty forms of ``/generate``, ``/v1/completions`` and
``/v1/chat/completions``; the inputs that look empty but make tokens, which are served; and a
greedy request in flight while the empty ones are refused, which completes unchanged.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from sglang_servers import adatree_command, free_port, sglang_server

from sglang_adatree.telemetry.store import upgrade

pytestmark = pytest.mark.slow

GREEDY = {"max_new_tokens": 8, "temperature": 0}
LONG_TOKENS = 256
OURS = "is empty: generation needs at least one input token"
# (name, route, body, text the error message contains). SGLang refuses three forms itself
# (its own messages); every other one reached the scheduler and crashed the server.
EMPTY_FORMS = [
    ("text", "/generate", {"text": "", "sampling_params": GREEDY}, f"the prompt {OURS}"),
    (
        "text sampled twice",
        "/generate",
        {"text": "", "sampling_params": {**GREEDY, "n": 2, "temperature": 0.7}},
        f"the prompt {OURS}",
    ),
    (
        "text batch",
        "/generate",
        {"text": ["The capital of France is", ""], "sampling_params": GREEDY},
        f"prompt 1 (counting from 0) of the batch of 2 {OURS}",
    ),
    (
        "input_ids batch",
        "/generate",
        {"input_ids": [[504, 3575], []], "sampling_params": GREEDY},
        f"prompt 1 (counting from 0) of the batch of 2 {OURS}",
    ),
    ("input_ids", "/generate", {"input_ids": [], "sampling_params": GREEDY}, "cannot be empty"),
    (
        "completions batch",
        "/v1/completions",
        {"model": "m", "prompt": ["", "Three primes:"], "max_tokens": 8},
        f"prompt 0 (counting from 0) of the batch of 2 {OURS}",
    ),
    (
        "completions token batch",
        "/v1/completions",
        {"model": "m", "prompt": [[504, 3575], []], "max_tokens": 8},
        f"prompt 1 (counting from 0) of the batch of 2 {OURS}",
    ),
    (
        "completions streamed",
        "/v1/completions",
        {"model": "m", "prompt": ["a", ""], "max_tokens": 8, "stream": True},
        f"prompt 1 (counting from 0) of the batch of 2 {OURS}",
    ),
    ("completions", "/v1/completions", {"model": "m", "prompt": "", "max_tokens": 8}, "empty"),
    ("chat", "/v1/chat/completions", {"model": "m", "messages": [], "max_tokens": 8}, "empty"),
]
# Inputs that look empty but are not: whitespace is a token, and the chat template makes a
# prompt of a message with empty content.
NOT_EMPTY_FORMS = [
    ("whitespace", "/generate", {"text": " ", "sampling_params": GREEDY}),
    ("newlines batch", "/generate", {"text": ["\n", "\t"], "sampling_params": GREEDY}),
    (
        "chat with empty content",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": ""}], "max_tokens": 8},
    ),
]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("empty-prompts")
    db_url = f"sqlite:///{root / 'adatree.sqlite'}"
    upgrade(db_url)
    env = {"ADATREE_DB_URL": db_url, "ADATREE_CONTROL_POLL_S": "0.2"}
    command = adatree_command(
        tiny_models.target,
        tiny_models.draft,
        free_port(),
        "--candidate-shapes",
        "0;3,1,4;2,2,4",
    )
    with sglang_server(command, root / "server.log", env=env) as server:
        yield server


def _post(server, route: str, body: dict) -> requests.Response:
    return requests.post(f"{server.url}{route}", json=body, timeout=300)


def _error_message(response: requests.Response) -> str:
    body = response.json()
    # /generate answers {"error": {"message": ...}}, the OpenAI routes {"message": ...}.
    return body["error"]["message"] if "error" in body else body["message"]


def _refuse_every_empty_form(server) -> list[tuple[str, int, str]]:
    answers = []
    for name, route, body, _ in EMPTY_FORMS:
        response = _post(server, route, body)
        answers.append((name, response.status_code, _error_message(response)))
    return answers


def test_every_empty_form_is_refused_with_400_and_the_server_goes_on(server):
    long = {
        "text": "Once upon a time, in a quiet village by the sea,",
        "sampling_params": {"max_new_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    # A greedy request in flight while the empty ones are refused: an empty prompt that
    # reached the scheduler took every request in flight down with the server.
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(_post, server, "/generate", long)
        time.sleep(0.2)
        answers = _refuse_every_empty_form(server)
        # The refusals take milliseconds, the long request a few seconds.
        assert not in_flight.done(), "the long request was no longer in flight"
        during = in_flight.result()
    for (name, status, message), (_, _, _, expected) in zip(answers, EMPTY_FORMS, strict=True):
        assert status == 400, f"{name}: {status} {message}"
        assert expected in message, f"{name}: {message}"
    assert during.status_code == 200
    assert len(during.json()["output_ids"]) == LONG_TOKENS
    # Unchanged by the refusals: the same greedy request alone gives the same tokens.
    assert _post(server, "/generate", long).json()["output_ids"] == during.json()["output_ids"]
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    assert "Traceback" not in server.log.read_text()


@pytest.mark.parametrize(
    ("name", "route", "body"), NOT_EMPTY_FORMS, ids=[f[0] for f in NOT_EMPTY_FORMS]
)
def test_inputs_that_make_tokens_are_served(server, name, route, body):
    response = _post(server, route, body)
    assert response.status_code == 200, response.text
    outputs = response.json()
    for output in outputs if isinstance(outputs, list) else [outputs]:
        if "meta_info" in output:
            assert output["meta_info"]["prompt_tokens"] >= 1
            assert len(output["output_ids"]) == GREEDY["max_new_tokens"]
        else:
            assert output["usage"]["prompt_tokens"] >= 1
            assert output["usage"]["completion_tokens"] >= 1


def test_a_streamed_empty_prompt_ends_its_stream_with_the_error(server):
    # SGLang's /generate stream has sent 200 before the prompt is tokenized: the refusal is
    # the stream's error event, with code 400, and the stream ends.
    body = {"text": "", "sampling_params": GREEDY, "stream": True}
    response = _post(server, "/generate", body)
    events = [line[len("data: ") :] for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[0])["error"]
    assert error["code"] == 400 and f"the prompt {OURS}" in error["message"]
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
