"""The empty-prompt checks' decisions, on plain values and stand-in requests (no server).

The server end to end (each empty form gets 400, the server goes on) is
``test_e2e_empty_prompts.py``.
"""

from __future__ import annotations

import inspect
import pkgutil
from types import SimpleNamespace

import pytest

from sglang_adatree.sglang import empty_prompts
from sglang_adatree.sglang.empty_prompts import (
    EmptyPromptError,
    _check_batch,
    _check_request,
    check_input_ids,
    first_empty_prompt,
)


class Tokenizer:
    """Counts its calls; ``bos`` says whether it makes a token of ``""``."""

    def __init__(self, bos: bool = False) -> None:
        self.bos = bos
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return ([1] if self.bos else []) + [ord(c) for c in text]


def _batch(text=None, input_ids=None, batch_size=None, mm=False, session_params=None):
    prompts = text if text is not None else input_ids
    return SimpleNamespace(
        text=text,
        input_ids=input_ids,
        input_embeds=None,
        batch_size=len(prompts) if batch_size is None else batch_size,
        session_params=session_params,
        contains_mm_input=lambda: mm,
    )


def _never_asked() -> bool:
    raise AssertionError("the tokenizer was asked without a '' in the batch")


# -- one request's final input ids ------------------------------------------------------------


def test_no_input_ids_is_refused_with_a_value_error():
    with pytest.raises(EmptyPromptError, match=r"the prompt is empty: .*at least one input token"):
        check_input_ids([])
    # SGLang answers a ValueError with 400.
    assert issubclass(EmptyPromptError, ValueError)


@pytest.mark.parametrize("input_ids", [[5], [0], list(range(300))])
def test_any_input_id_passes(input_ids):
    check_input_ids(input_ids)


def test_ids_that_are_not_sglangs_to_count_pass():
    check_input_ids(None)  # input embeddings


def test_a_session_may_supply_the_whole_prompt():
    check_input_ids([], {"id": "session-1", "rid": None})
    # A session without an id continues nothing: the request's own ids are its prompt.
    with pytest.raises(EmptyPromptError):
        check_input_ids([], {"id": None})


def test_request_hook_reads_the_ids_and_the_session():
    with pytest.raises(EmptyPromptError):
        _check_request(object(), SimpleNamespace(session_params=None), [])
    _check_request(object(), SimpleNamespace(session_params={"id": "s"}), [])
    _check_request(object(), SimpleNamespace(), [7])  # an embedding request has no session


# -- a batch, before any of its prompts is sent -------------------------------------------------


@pytest.mark.parametrize(
    ("prompts", "index"),
    [
        (["a", ""], 1),
        (["", "a"], 0),
        (["a", "b"], None),
        ([" ", "\n"], None),  # whitespace is a token
        ([[5, 6], []], 1),
        ([[5, 6], [7]], None),
        ([], None),
    ],
)
def test_first_empty_prompt(prompts, index):
    assert first_empty_prompt(prompts, lambda: False) == index


def test_empty_text_is_empty_only_when_the_tokenizer_makes_no_token_of_it():
    with_bos = Tokenizer(bos=True)
    assert first_empty_prompt(["", "a", ""], lambda: bool(with_bos.encode(""))) is None
    assert with_bos.calls == 1  # asked once, not once per ""
    assert first_empty_prompt(["a", "b"], _never_asked) is None
    assert first_empty_prompt([[1], []], _never_asked) == 1


def test_batch_hook_names_the_empty_prompt():
    manager = SimpleNamespace(tokenizer=Tokenizer())
    with pytest.raises(EmptyPromptError) as refused:
        _check_batch(manager, _batch(text=["a", "", "b"]), None, {})
    assert str(refused.value).startswith("prompt 1 (counting from 0) of the batch of 3 is empty")
    assert "no prompt of the batch was run" in str(refused.value)
    with pytest.raises(EmptyPromptError, match=r"prompt 1 .* of the batch of 2"):
        _check_batch(manager, _batch(input_ids=[[5], []]))


def test_batch_hook_with_parallel_sampling_looks_at_the_prompts_not_their_copies():
    manager = SimpleNamespace(tokenizer=Tokenizer())
    # n = 2 repeats the prompts: ["a", ""] becomes ["a", "", "a", ""] with batch_size 2.
    with pytest.raises(EmptyPromptError, match=r"prompt 1 .* of the batch of 2"):
        _check_batch(manager, _batch(text=["a", "", "a", ""], batch_size=2))
    # One prompt sampled twice is one prompt, not a batch.
    with pytest.raises(EmptyPromptError, match=r"^the prompt is empty"):
        _check_batch(manager, _batch(text=["", ""], batch_size=1))


def test_batch_hook_leaves_alone_what_it_cannot_count():
    manager = SimpleNamespace(tokenizer=Tokenizer())
    _check_batch(manager, _batch(text=["a", ""], mm=True))  # the processor makes the ids
    _check_batch(manager, _batch(text=["a", ""], session_params={"id": "s"}))
    _check_batch(SimpleNamespace(tokenizer=Tokenizer(bos=True)), _batch(text=["a", ""]))
    _check_batch(SimpleNamespace(tokenizer=None), _batch(text=["a", ""]))  # SGLang refuses
    embeds = _batch(text=None, input_ids=[[1]])
    embeds.input_ids, embeds.input_embeds = None, [[[0.0]]]
    _check_batch(manager, embeds)


# -- the hooks' targets in the installed SGLang -------------------------------------------------


def test_hooks_target_sglang_methods_with_the_arguments_they_read(monkeypatch):
    registered = []
    monkeypatch.setattr(
        "sglang.srt.plugins.hook_registry.HookRegistry.register",
        lambda target, hook, hook_type: registered.append((target, hook, hook_type.name)),
    )
    empty_prompts.install_hooks()
    assert {(hook, kind) for _, hook, kind in registered} == {
        (_check_request, "BEFORE"),
        (_check_batch, "BEFORE"),
    }
    for target, hook, _ in registered:
        # The hook gets the original's arguments: the leading ones must mean the same.
        method = pkgutil.resolve_name(target)
        expected = ["self", "obj", "input_ids"] if hook is _check_request else ["self", "obj"]
        assert list(inspect.signature(method).parameters)[: len(expected)] == expected
