"""The draft-kind rule shared by the SGLang adapter and the benchmark."""

from __future__ import annotations

import pytest

from sglang_adatree.drafts import DRAFT_KINDS, draft_kind_of


@pytest.mark.parametrize(
    ("architectures", "kind"),
    [
        (["LlamaForCausalLMEagle"], "eagle"),
        (["LlamaForCausalLMEagle3"], "eagle3"),
        (["LlamaForCausalLM"], "standalone"),
        ([], "standalone"),
        (None, "standalone"),
    ],
)
def test_kind_from_architectures(architectures, kind):
    assert draft_kind_of({"architectures": architectures}) == kind
    assert kind in DRAFT_KINDS


def test_missing_architectures_is_a_small_model():
    assert draft_kind_of({}) == "standalone"
