import pytest

from sglang_adatree.core.shapes import (
    DEFAULT_CANDIDATES,
    NO_SPEC,
    ShapeError,
    TreeShape,
    envelope,
    parse_candidates,
)


def test_chain_and_tree_properties():
    chain = TreeShape(3, 1, 4)
    assert chain.is_chain and chain.speculative
    assert chain.num_candidates == 3
    assert chain.max_emitted == 4
    tree = TreeShape(3, 2, 6)
    assert not tree.is_chain
    assert tree.num_candidates == 2 + 2 * 4
    assert tree.max_emitted == 4
    assert tree.kv_tokens_reserved == 6
    assert TreeShape(5, 4, 8).kv_tokens_reserved == 20


def test_dominates_needs_every_dimension_at_least_as_large():
    tree = TreeShape(2, 2, 4)
    assert tree.dominates(TreeShape(2, 1, 3))  # the chain inside it
    assert tree.dominates(TreeShape(1, 1, 2)) and tree.dominates(NO_SPEC)
    assert TreeShape(6, 4, 16).dominates(tree)
    assert not tree.dominates(tree)
    assert not TreeShape(3, 1, 4).dominates(tree)  # deeper but narrower
    assert not TreeShape(5, 4, 8).dominates(TreeShape(4, 4, 12))  # deeper, fewer nodes
    assert not NO_SPEC.dominates(TreeShape(1, 1, 2))


def test_no_spec():
    assert not NO_SPEC.speculative
    assert NO_SPEC.max_emitted == 1
    assert TreeShape.parse("0") == NO_SPEC
    assert TreeShape.parse(" off ") == NO_SPEC
    with pytest.raises(ShapeError, match="written 0,1,1"):
        TreeShape(0, 4, 8)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((3, 1, 5), "chain"),
        ((2, 2, 8), "exceeds the 6 candidates"),
        ((1, 1, 1), "chain"),
        ((17, 1, 18), "steps must be in"),
        ((2, 0, 3), "topk must be in"),
        ((2, 2, 1), "num_draft_tokens >= 2"),
    ],
)
def test_invalid_shapes_name_the_problem(shape, message):
    with pytest.raises(ShapeError, match=message):
        TreeShape(*shape)


def test_bounds_formula_is_tight():
    # topk + (steps - 1) * topk**2 = 4 + 3 * 16 = 52 candidates: 53 verified tokens fit, 54 not.
    TreeShape(4, 4, 53)
    with pytest.raises(ShapeError):
        TreeShape(4, 4, 54)


def test_non_int_rejected():
    with pytest.raises(ShapeError, match="must be an int"):
        TreeShape(3, 1, 4.0)  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match="must be an int"):
        TreeShape(True, 1, 2)  # type: ignore[arg-type]


def test_parse_round_trip_and_errors():
    for shape in DEFAULT_CANDIDATES:
        assert TreeShape.parse(str(shape)) == shape
    with pytest.raises(ShapeError, match="expected"):
        TreeShape.parse("3,1")
    with pytest.raises(ShapeError, match="must be ints"):
        TreeShape.parse("a,b,c")


def test_candidates_and_envelope():
    shapes = parse_candidates("0; 3,1,4 5,4,8;3,1,4")
    assert shapes == (NO_SPEC, TreeShape(3, 1, 4), TreeShape(5, 4, 8))
    env = envelope(shapes)
    assert (env.steps, env.topk, env.num_draft_tokens) == (5, 4, 8)
    assert env.kv_tokens_reserved == 20
    with pytest.raises(ShapeError, match="no speculative shape"):
        parse_candidates("0")
    with pytest.raises(ShapeError, match="empty"):
        parse_candidates("  ")


def test_default_candidates_valid():
    assert NO_SPEC in DEFAULT_CANDIDATES
    assert any(s.is_chain for s in DEFAULT_CANDIDATES)
    assert any(s.topk > 1 for s in DEFAULT_CANDIDATES)
    assert list(DEFAULT_CANDIDATES) == sorted(set(DEFAULT_CANDIDATES))
