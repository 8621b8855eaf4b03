"""Exact traces: hand-made trees, SGLang's tree code, independent rollouts, the cache.

* tiny exact cases: a hand-built tree and a hand-made bigram draft, where what a chain and a
  2-branch tree emit is known;
* verification agrees with the project's mirror of SGLang's tree build and greedy verify
  kernels (``sglang/tree.py``, ``sglang/cpu/verify.py``) on random trees;
* on the tiny seeded target, with its standalone draft and a tiny EAGLE head: for one topk and
  depth more draft tokens never emit less, and a chain emits 1 + the draft's greedy rollout's
  leading agreement with the answer, computed independently (transformers' ``generate`` for the
  standalone draft, ``EagleHead.forward`` for the head);
* the cache: a second build does no model work, an interrupted one redoes only what is missing.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_eagle import make_tiny_eagle

from sglang_adatree.core.shapes import NO_SPEC, TreeShape
from sglang_adatree.lab import tracegen
from sglang_adatree.lab.draft_forward import load_draft
from sglang_adatree.lab.target_pass import TargetPass
from sglang_adatree.lab.tracegen import TraceJob, build_traces, load_prompt_set
from sglang_adatree.lab.tree_replay import DraftLayers, expand, verify
from sglang_adatree.models import eagle

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primes:"]
MAX_NEW_TOKENS = 24
CHAINS = tuple(TreeShape(s, 1, s + 1) for s in (1, 2, 3, 5))
# Same topk and depth: each keeps the candidates of the one before and more.
NESTED = {2: tuple(TreeShape(3, 2, n) for n in (3, 4, 6, 11)),
          4: tuple(TreeShape(2, 4, n) for n in (2, 5, 9, 21))}  # fmt: skip
SHAPES = (NO_SPEC, *CHAINS, *NESTED[2], *NESTED[4])


# -- tiny exact cases ----------------------------------------------------------------------------


def test_verify_hand_built_tree_and_chain():
    # The worked example of tree_replay's docstring: topk 2, answer continues a=1, b=2.
    a, x, b, y, z, w = 1, 3, 2, 4, 5, 6
    tree = DraftLayers(
        topk=2,
        scores=(torch.tensor([[0.6, 0.25]]), torch.tensor([[0.30, 0.24, 0.20, 0.01]])),
        tokens=(torch.tensor([[a, x]]), torch.tensor([[b, y, z, w]])),
        parents=(torch.tensor([[-1, 0, 1]]), torch.tensor([[2, 3]])),
    )
    targets = torch.tensor([[a, b, 9]])
    out = verify(tree, TreeShape(2, 2, 4), targets, torch.tensor([10]))
    assert out.emitted.tolist() == [3]
    assert out.num_children.tolist() == [[2, 1]]
    assert out.accepted_rank.tolist() == [[0, 0]]
    assert out.draft_expected.item() == pytest.approx(1.15)
    # Fewer tokens: 2,2,3 keeps a and b (0.30 > 0.25), so x is not offered.
    out = verify(tree, TreeShape(2, 2, 3), targets, torch.tensor([10]))
    assert (out.emitted.item(), out.num_children.tolist()) == (3, [[1, 1]])
    to_x = torch.tensor([[x, z, 9]])  # the target continues x, z: z was never kept
    out = verify(tree, TreeShape(2, 2, 3), to_x, torch.tensor([10]))
    assert (out.emitted.item(), out.num_children.tolist()) == (1, [[1, 0]])
    out = verify(tree, TreeShape(2, 2, 4), to_x, torch.tensor([10]))
    assert (out.emitted.item(), out.num_children.tolist()) == (2, [[2, 0]])
    assert out.accepted_rank.tolist() == [[1, -1]]
    # The answer ends after a: nothing past it is offered or accepted, emitted is capped.
    out = verify(tree, TreeShape(2, 2, 4), torch.tensor([[a, -1, -1]]), torch.tensor([1]))
    assert (out.emitted.item(), out.num_children.tolist()) == (1, [[2, 0]])
    assert out.accepted_rank.tolist() == [[0, -1]]

    chain = DraftLayers(
        topk=1,
        scores=(torch.tensor([[0.9]]), torch.tensor([[0.45]]), torch.tensor([[0.09]])),
        tokens=(torch.tensor([[a]]), torch.tensor([[b]]), torch.tensor([[z]])),
        parents=(torch.tensor([[-1, 0]]), torch.tensor([[1]]), torch.tensor([[2]])),
    )
    out = verify(chain, TreeShape(3, 1, 4), torch.tensor([[a, b, w]]), torch.tensor([10]))
    assert out.emitted.tolist() == [3]
    assert out.num_children.tolist() == [[1, 1, 1]]
    assert out.accepted_rank.tolist() == [[0, 0, -1]]
    assert out.draft_expected.item() == pytest.approx(0.9 + 0.45 + 0.09)


class BigramDraft:
    """A stand-in for ``DraftRunner`` whose next-token distribution depends on the token only:
    a pass's output is the one-hot of its input token, and its logits a row of ``table``."""

    layers = (None,)
    vocab_ids = None

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # [vocab, vocab] logits of the next token after each token

    def tree_step(self, ctx, prefix_lens, step, tokens, hidden, cache):
        return torch.nn.functional.one_hot(tokens, self.table.shape[0]).float()

    def logits(self, out):
        return out @ self.table


def bigram(rows: dict[int, dict[int, float]], vocab: int = 8) -> torch.Tensor:
    """Logits whose softmax puts the given probabilities on each row (the rest ~0)."""
    table = torch.full((vocab, vocab), -30.0)
    for token, nexts in rows.items():
        for nxt, p in nexts.items():
            table[token, nxt] = float(np.log(p))
    return table


def test_bigram_draft_chain_and_two_branch_tree():
    root = {1: 0.6, 2: 0.4}  # after the root token
    draft = BigramDraft(bigram({1: {3: 0.55, 4: 0.45}, 2: {5: 0.9, 3: 0.1}, 5: {6: 1.0}}))
    first = torch.log(torch.tensor([[1e-9, 0.6, 0.4, 1e-9, 1e-9, 1e-9, 1e-9, 1e-9]]))
    assert torch.softmax(first, -1)[0, 1:3].tolist() == pytest.approx(list(root.values()))
    answer = torch.tensor([[2, 5, 6]])  # the target continues 2, 5, 6
    chain = expand(draft, None, torch.tensor([4]), first, None, topk=1, steps=2)
    out = verify(chain, TreeShape(2, 1, 3), answer, torch.tensor([10]))
    assert out.emitted.tolist() == [1]  # the chain drafts 1, 3: wrong at once
    tree = expand(draft, None, torch.tensor([4]), first, None, topk=2, steps=3)
    # Step 1 scores 1->3 .33, 1->4 .27, 2->5 .36, 2->3 .04: 2,2,4 keeps 1, 2 and 2->5.
    out = verify(tree, TreeShape(2, 2, 4), answer, torch.tensor([10]))
    assert out.emitted.tolist() == [3]
    assert out.num_children.tolist() == [[2, 1]]
    assert out.accepted_rank.tolist() == [[1, 0]]
    assert out.draft_expected.item() == pytest.approx(0.6 + 0.4 + 0.36, rel=1e-5)
    # One more layer: the frontier was 2->5 and 1->3; 2->5->6 (.36) joins the best 5.
    out = verify(tree, TreeShape(3, 2, 6), answer, torch.tensor([10]))
    assert out.emitted.tolist() == [4]
    assert out.accepted_rank.tolist() == [[1, 0, 0]]


# -- the project's mirror of SGLang's kernels ---------------------------------------------------


@pytest.mark.parametrize("shape", [TreeShape(2, 2, 4), TreeShape(3, 2, 6), TreeShape(4, 4, 12),
                                   TreeShape(3, 1, 4), TreeShape(5, 4, 8)])  # fmt: skip
def test_verify_equals_sglang_tree_build_and_greedy_verify(shape):
    from sglang_adatree.sglang.cpu.verify import verify_tree_greedy
    from sglang_adatree.sglang.tree import (
        accepted_path_stats,
        build_verify_tree,
        organize_draft_results,
    )

    gen = torch.Generator().manual_seed(shape.num_draft_tokens)
    vocab, rows = 6, 64  # few tokens: the answer often matches a drafted one
    draft = BigramDraft(torch.randn(vocab, vocab, generator=gen) * 2)
    first = torch.randn(rows, vocab, generator=gen) * 2
    layers = expand(draft, None, torch.full((rows,), 4), first, None, shape.topk, shape.steps)
    answers = torch.randint(0, vocab, (rows, shape.steps + 1), generator=gen)
    ours = verify(layers, shape, answers, torch.full((rows,), 100))

    k, n = shape.topk, shape.num_draft_tokens
    sel = organize_draft_results(list(layers.scores), list(layers.tokens),
                                 list(layers.parents), n)  # fmt: skip
    seq_lens = torch.full((rows,), 10, dtype=torch.long)
    tree = build_verify_tree(torch.zeros(rows, dtype=torch.long), sel.parent_list,
                             sel.top_scores_index, sel.draft_tokens, seq_lens, 10 * rows,
                             k, shape.steps, n)  # fmt: skip
    depth = (tree.positions.view(rows, n) - 10).long()  # the node's depth below the root
    target_predict = answers.gather(1, depth)  # greedy target after each node: the answer
    result = verify_tree_greedy(
        torch.full((rows * n,), -1, dtype=torch.int32),
        torch.full((rows, shape.steps + 1), -1, dtype=torch.int32),
        torch.zeros(rows, dtype=torch.int32),
        tree.draft_tokens.view(rows, n),
        tree.retrieve_index, tree.retrieve_next_token, tree.retrieve_next_sibling,
        target_predict,
    )  # fmt: skip
    stats = accepted_path_stats(result.accept_index, result.accept_token_num,
                                tree.retrieve_next_token, tree.retrieve_next_sibling,
                                sel.top_scores_index, k)  # fmt: skip
    assert ours.emitted.tolist() == (result.accept_token_num.long() + 1).tolist()
    assert ours.num_children.tolist() == stats.num_children.tolist()
    assert ours.accepted_rank.tolist() == stats.accepted_rank.tolist()
    assert (ours.emitted > 1).any(), "the case should accept something"


# -- the tiny seeded models -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_pass(tiny_models) -> TargetPass:
    return TargetPass(tiny_models.target)


@pytest.fixture(scope="module")
def eagle_dir(tiny_models, tmp_path_factory) -> Path:
    return make_tiny_eagle(
        tiny_models.target, tmp_path_factory.mktemp("eagle") / "head", PROMPTS, MAX_NEW_TOKENS
    )


@pytest.fixture(scope="module")
def answered(target_pass) -> list[tuple[list[int], list[int]]]:
    prompt_ids = [target_pass.prompt_ids(p) for p in PROMPTS]
    return list(zip(prompt_ids, target_pass.answers(prompt_ids, MAX_NEW_TOKENS), strict=True))


@pytest.fixture(scope="module", params=["standalone", "eagle"])
def traced(request, tiny_models, eagle_dir, target_pass, answered):
    """(kind, draft folder, per request: prompt, answer and its trace)."""
    draft = tiny_models.draft if request.param == "standalone" else eagle_dir
    runner = load_draft(draft, target_pass.model)
    traces = [tracegen.trace_request(target_pass, runner, p, a, SHAPES).trace for p, a in answered]
    return request.param, draft, [(p, a, t) for (p, a), t in zip(answered, traces, strict=True)]


def test_more_draft_tokens_never_emit_less(traced):
    _, _, per_request = traced
    column = {s: j for j, s in enumerate(SHAPES)}
    accepted_any = False
    for _, _, trace in per_request:
        emitted = trace.emitted
        for group in (CHAINS, *NESTED.values()):
            for small, large in itertools.pairwise(group):
                assert (emitted[:, column[large]] >= emitted[:, column[small]]).all()
            expected = trace.draft_expected[1:, [column[s] for s in group]]
            assert (np.diff(expected, axis=1) >= -1e-6).all()
        assert (emitted[:, column[NO_SPEC]] == 1).all()
        accepted_any |= bool((emitted > 1).any())
    assert accepted_any, "the tiny draft should agree with the target somewhere"


def _standalone_rollout(draft: Path, seq: list[int], start: int, steps: int) -> list[int]:
    """Greedy tokens of the standalone draft after ``seq[:start]``, as SGLang feeds it: one
    token left of the target's (it never reads the sequence's first token)."""
    from transformers import AutoModelForCausalLM

    model = _standalone_rollout.cache.get(draft)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(draft).eval()
        model.generation_config.eos_token_id = None  # the draft drafts on past an EOS guess
        _standalone_rollout.cache[draft] = model
    ids = torch.tensor([seq[1:start]])
    out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0,
                         attention_mask=torch.ones_like(ids))  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


_standalone_rollout.cache = {}


def _eagle_rollouts(draft: Path, target_pass, seq: list[int], steps: int):
    """Per position i: the head's greedy tokens for i + 2, i + 3, ... read its own guesses
    (``EagleHead.forward``), and its top-1 probability at step 1."""
    head, hot = eagle.load(draft)
    embed = target_pass.model.get_input_embeddings().weight.detach()
    lm_head = target_pass.model.get_output_embeddings().weight.detach()[hot]
    hidden = target_pass.teacher_forced(seq, 1)[0]
    n = len(seq) - 1
    step_tokens = [torch.tensor(seq[1:])]
    guesses = []
    with torch.no_grad():
        for s in range(steps):
            out = head(embed, torch.stack(step_tokens)[:, None], hidden[None, :n],
                       torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))  # fmt: skip
            logits = out[s, 0] @ lm_head.T  # [n, hot]
            if s == 0:
                ranked = torch.softmax(logits, -1).sort(-1, descending=True).values  # [n, hot]
            guesses.append(hot[logits.argmax(-1)])
            step_tokens.append(guesses[-1])
    return torch.stack(guesses, dim=1), ranked  # [n, steps], [n, hot]


def test_chain_emits_one_plus_the_greedy_rollouts_agreement(traced, target_pass):
    kind, draft, per_request = traced
    depth = max(s.steps for s in CHAINS)
    for prompt, answer, trace in per_request:
        seq, p_len, a_len = [*prompt, *answer], len(prompt), len(answer)
        if kind == "eagle":
            guesses, ranked = _eagle_rollouts(draft, target_pass, seq, depth)
        # A generate() call per position: every third one keeps the standalone's case short.
        for p in range(1, a_len, 1 if kind == "eagle" else 3):
            root = p_len + p - 2  # draft position reading the step's root token
            if kind == "eagle":
                rollout = guesses[root].tolist()
            else:
                rollout = _standalone_rollout(draft, seq, p_len + p, depth)
            agree = 0
            while agree < depth and p + agree < a_len and rollout[agree] == answer[p + agree]:
                agree += 1
            for j, shape in enumerate(SHAPES):
                if shape in CHAINS:
                    want = min(1 + min(agree, shape.steps), a_len - p)
                    assert trace.emitted[p, j] == want, (kind, p, shape, rollout)
            if kind == "eagle":
                j = SHAPES.index(TreeShape(1, 1, 2))
                assert trace.draft_expected[p, j] == pytest.approx(float(ranked[root, 0]), 1e-4)
                # The first layer: the draft's top-k there, as wide as the widest shape's.
                width = max(s.topk for s in SHAPES)
                np.testing.assert_allclose(trace.first_layer[p], ranked[root, :width], rtol=1e-4)


def test_answers_end_at_the_first_end_of_sequence_token(tmp_path):
    from models_tiny import make_tiny_target

    target = make_tiny_target(tmp_path / "chatml")
    target_pass = TargetPass(target)
    prompts = ["Explain tides.", "Write a poem about cats.", "Tips for saving money?", "Hi"]
    answers = target_pass.answers([target_pass.prompt_ids(p) for p in prompts], 40)
    eos = {target_pass.eos_id}
    for answer in answers:
        assert len(answer) == 40 or answer[-1] in eos
        assert not any(t in eos for t in answer[:-1])
    assert any(a[-1] in eos for a in answers), "the tiny target's answers end early"


# -- the cache ------------------------------------------------------------------------------------


def _build(tiny_models, cache_dir: Path, **changes):
    args = {"name": "tiny", "target": tiny_models.target, "draft": tiny_models.draft,
            "shapes": (NO_SPEC, TreeShape(2, 1, 3), TreeShape(2, 2, 4)),
            "max_new_tokens": 8, "cache_dir": cache_dir, "progress": False, **changes}  # fmt: skip
    return build_traces(PROMPTS[:2], **args)


def _same(a, b) -> None:
    assert (a.name, a.pair, a.kind, a.shapes) == (b.name, b.pair, b.kind, b.shapes)
    assert a.kind == "exact" and a.pair == "draft / target"
    for x, y in zip(a.requests, b.requests, strict=True):
        assert (x.request_id, x.prompt_len) == (y.request_id, y.prompt_len)
        for field in ("emitted", "num_children", "accepted_rank", "draft_expected", "first_layer"):
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field))


def test_a_second_build_does_no_model_work(tiny_models, tmp_path, monkeypatch):
    first = _build(tiny_models, tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("model work on a cached trace set")

    monkeypatch.setattr(tracegen, "TargetPass", refuse)
    monkeypatch.setattr(tracegen, "load_draft", refuse)
    _same(_build(tiny_models, tmp_path), first)
    [folder] = tmp_path.iterdir()
    assert folder.name.startswith("tiny-draft-")
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["requests"] == 2 and summary["teacher_mismatches"] == 0


def test_an_interrupted_build_redoes_only_the_missing_requests(tiny_models, tmp_path, monkeypatch):
    first = _build(tiny_models, tmp_path)
    [folder] = tmp_path.iterdir()
    (folder / tracegen.TRACES_FILE).unlink()
    (folder / "requests" / "00001.npz").unlink()
    traced = []
    real = tracegen.trace_request

    def counting(target_pass, runner, prompt_ids, *args, **kwargs):
        traced.append(len(prompt_ids))
        return real(target_pass, runner, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(tracegen, "trace_request", counting)
    _same(_build(tiny_models, tmp_path), first)
    assert len(traced) == 1


def test_the_cache_key_follows_every_input(tiny_models, tmp_path):
    base = TraceJob("tiny", tuple(PROMPTS), tiny_models.target, tiny_models.draft,
                    (NO_SPEC, TreeShape(2, 1, 3)), 12)  # fmt: skip
    variants = [
        TraceJob("tiny", (*PROMPTS, "x"), base.target, base.draft, base.shapes, 12),
        TraceJob("tiny", base.prompts, base.target, base.draft, (TreeShape(2, 1, 3),), 12),
        TraceJob("tiny", base.prompts, base.target, base.draft, base.shapes, 13),
        TraceJob("tiny", base.prompts, base.target, base.draft, base.shapes, 12, False),
        TraceJob("tiny", base.prompts, base.target, tiny_models.target, base.shapes, 12),
    ]
    keys = {base.key(), *(v.key() for v in variants)}
    assert len(keys) == 1 + len(variants)
    assert base.folder(tmp_path) == tmp_path / f"tiny-draft-{base.key()}"


def test_prompt_sets_from_a_jsonl_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "other": 1}\n')
    assert load_prompt_set(str(path)) == ("mine", ["a", "b"])
    assert load_prompt_set(str(path), limit=1) == ("mine", ["a"])
    with pytest.raises(ValueError, match="neither"):
        load_prompt_set(str(tmp_path / "missing.jsonl"))
