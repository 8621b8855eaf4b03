"""Empty prompts are refused with HTTP 400 before they reach the scheduler.

SGLang 0.5.23 runs a prompt of zero tokens into the target's prefill, where the rotary
embedding cannot reshape the empty tensor (``RuntimeError: cannot reshape tensor of 0 elements
into shape [0, -1, head_dim]``); the scheduler dies and SGLang kills the whole process tree,
losing every request in flight. (Prefilled together with a prompt that has tokens, it is
answered instead, with tokens made from nothing.) Plain SGLang does the same with any attention
backend, but a server that runs adatree must not go down on one bad request, so the plug-in
refuses such prompts in the tokenizer manager, where SGLang answers a ``ValueError`` with 400
on ``/generate``, ``/v1/completions`` and ``/v1/chat/completions`` alike (a streamed
``/generate`` gets SGLang's error event in the stream instead).

Empty means no input tokens, not no text: a tokenizer that adds a BOS token makes one of ``""``,
a chat template makes tokens of a message with empty content, and whitespace is a token; none
of those is refused. Two hooks on ``TokenizerManager``, each a length check per prompt (and
one tokenization of ``""`` for a batch that holds one):

* ``_validate_one_request`` (before): every request passes it with its final input ids (text
  tokenized, multimodal placeholders expanded) before it is sent to the scheduler;
* ``_handle_batch_request`` (before): SGLang tokenizes and sends a batch's prompts one by one,
  so the batch is checked first, to refuse it whole, naming the empty prompt, before any of
  its prompts runs.

A request that continues a session (``session_params`` with an ``id``) may send no tokens of
its own: the session supplies them, and SGLang aborts the request itself if it has none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from typing import Any

NEEDS_A_TOKEN = "generation needs at least one input token and this prompt has none"


class EmptyPromptError(ValueError):
    """A prompt without input tokens; a ``ValueError``, which SGLang answers with 400."""


def single_message() -> str:
    return f"the prompt is empty: {NEEDS_A_TOKEN}"


def batch_message(index: int, batch_size: int) -> str:
    return (
        f"prompt {index} (counting from 0) of the batch of {batch_size} is empty: "
        f"{NEEDS_A_TOKEN}; no prompt of the batch was run"
    )


def session_supplies_prompt(session_params: object) -> bool:
    """True when the request continues a session, whose tokens the scheduler prepends."""
    return isinstance(session_params, dict) and bool(session_params.get("id"))


def check_input_ids(input_ids: Sized | None, session_params: object = None) -> None:
    """Raise ``EmptyPromptError`` for a request whose final input ids are none at all.

    ``None`` means the ids are not SGLang's to count (input embeddings): left alone.
    """
    if (
        input_ids is not None
        and len(input_ids) == 0
        and not session_supplies_prompt(session_params)
    ):
        raise EmptyPromptError(single_message())


def first_empty_prompt(
    prompts: Sequence[str | Sized], empty_text_has_tokens: Callable[[], bool]
) -> int | None:
    """The index of the first prompt (a text or a list of token ids) without tokens, or None.

    Only ``""`` among texts can be empty here: any other text tokenizes to at least one token
    with the byte-level and sentencepiece tokenizers SGLang serves, and the per-request check
    still sees the final ids of one that does not. Whether ``""`` makes a token (a BOS) is the
    tokenizer's to say, so ``empty_text_has_tokens`` is asked, once, only when a ``""`` is there.
    """
    empty_text_is_empty: bool | None = None
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if prompt:
                continue
            if empty_text_is_empty is None:
                empty_text_is_empty = not empty_text_has_tokens()
            if empty_text_is_empty:
                return index
        elif len(prompt) == 0:
            return index
    return None


# -- the hooks ------------------------------------------------------------------------------


def _check_request(
    manager: Any, obj: Any, input_ids: Sized | None, *args: Any, **kwargs: Any
) -> None:
    check_input_ids(input_ids, getattr(obj, "session_params", None))


def _check_batch(manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    if (
        obj.input_embeds is not None
        or obj.contains_mm_input()  # the multimodal processor makes the ids later
        or session_supplies_prompt(getattr(obj, "session_params", None))
    ):
        return
    prompts = obj.text if obj.text is not None else obj.input_ids
    if prompts is None:
        return
    # Parallel sampling (n > 1) repeats the prompts after the first batch_size.
    batch_size = obj.batch_size
    index = first_empty_prompt(prompts[:batch_size], lambda: _empty_text_has_tokens(manager))
    if index is not None:
        raise EmptyPromptError(
            batch_message(index, batch_size) if batch_size > 1 else single_message()
        )


def _empty_text_has_tokens(manager: Any) -> bool:
    tokenizer = manager.tokenizer
    # Without a tokenizer (skip_tokenizer_init) SGLang refuses every text prompt itself.
    return tokenizer is None or len(tokenizer.encode("")) > 0


def install_hooks() -> None:
    """Register the empty-prompt checks on SGLang's tokenizer manager (at plug-in load)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    manager = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
    HookRegistry.register(f"{manager}._validate_one_request", _check_request, HookType.BEFORE)
    HookRegistry.register(f"{manager}._handle_batch_request", _check_batch, HookType.BEFORE)
