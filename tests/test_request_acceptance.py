import numpy as np
import pytest

from sglang_adatree.core.acceptance import SPREAD_MIN_REQUESTS, RequestAcceptance


def test_a_request_factor_is_its_ratio_shrunk_towards_one():
    requests = RequestAcceptance(prior_steps=2.0, keep=0.5)
    assert requests.factor("a") == 1.0
    requests.observe(["a", "b"], [2, 0], expected=1.0)  # ratios 2 and 0
    assert requests.factor("a") == pytest.approx((2 + 2) / (1 + 2))
    assert requests.factor("b") == pytest.approx(2 / 3)
    assert requests.batch_factor(["a", "b", "c"]) == pytest.approx((4 / 3 + 2 / 3 + 1) / 3)
    requests.age(["a"])  # a step without speculation halves "a"'s evidence
    assert requests.factor("a") == pytest.approx((1 + 2) / (0.5 + 2))


def test_under_the_first_layer_a_request_factor_is_a_ratio_of_sums():
    requests = RequestAcceptance(prior_steps=0.0, keep=0.999, ratio_of_sums=True)
    # A draft unsure of its first token: a tenth of a token expected, two accepted; then a step
    # that expected one and accepted none. Each step's own ratio would average (20 + 0) / 2.
    requests.observe(["a"], [2], expected=[0.1])
    requests.observe(["a"], [0], expected=[1.0])
    assert requests.factor("a") == pytest.approx(0.999 * 2 / (0.999 * 0.1 + 1.0))
    # The mean of each step's ratio, the default, where every step expects about as much.
    mean = RequestAcceptance(prior_steps=0.0, keep=0.999)
    mean.observe(["a"], [2], expected=[0.1])
    mean.observe(["a"], [0], expected=[1.0])
    assert mean.factor("a") == pytest.approx(0.999 * 20 / 1.999)


def test_a_request_never_verified_is_the_estimators_even_without_a_prior():
    requests = RequestAcceptance(prior_steps=0.0, keep=0.8)
    requests.age(["a"])
    assert requests.factor("a") == 1.0
    requests.observe(["a"], [3], expected=2.0)
    assert requests.factor("a") == pytest.approx(1.5)


def served(requests: RequestAcceptance, factors, steps: int, rng) -> None:
    """One request after another, each accepting ``factor`` times the expected on average with
    per-step noise, then leaving."""
    for i, f in enumerate(factors):
        rid = f"r{i}"
        for _ in range(steps):
            requests.observe([rid], [max(f + rng.normal(0.0, 0.5), 0.0)], expected=1.0)
        requests.age([rid])  # a step without speculation counts as a step of the request
        requests.close([rid])


def test_the_spread_between_requests_leaves_out_the_noise_within_them():
    rng = np.random.default_rng(0)
    alike, apart = RequestAcceptance(8.0, 0.8), RequestAcceptance(8.0, 0.8)
    served(alike, [1.0] * 200, 20, rng)
    served(apart, rng.choice([0.7, 1.3], 200), 20, rng)
    a, b = alike.spread(), apart.spread()
    assert a is not None and b is not None
    # The per-step noise (0.25) is in both; only the second differs between requests (0.09).
    assert a.within == pytest.approx(0.25, rel=0.25)
    assert b.within == pytest.approx(0.25, rel=0.25)
    assert a.between < 0.02
    assert b.between == pytest.approx(0.09, rel=0.4)
    assert a.steps == pytest.approx(21) and b.steps == pytest.approx(21)


def test_the_spread_needs_requests_that_left_each_counted_once():
    requests = RequestAcceptance(8.0, 0.8)
    n = int(SPREAD_MIN_REQUESTS) + 1
    for i in range(n):
        requests.observe([f"r{i}"], [1], expected=1.0)
        requests.observe([f"r{i}"], [1 + i % 2], expected=1.0)
        if i < n - 1:
            requests.close([f"r{i}"])
    assert requests.spread() is None  # one short
    requests.close(["never-seen"])
    assert requests.spread() is None
    requests.close([f"r{n - 1}"])
    spread = requests.spread()
    assert spread is not None
    requests.close([f"r{n - 1}", "r0"])  # already counted
    assert requests.spread() == spread
    # A request that verified once tells its length, not its spread.
    requests.observe(["short"], [3], expected=1.0)
    requests.age(["short"])
    requests.age(["short"])
    requests.close(["short"])
    after = requests.spread()
    assert after is not None
    assert (after.between, after.within) == (spread.between, spread.within)
    assert after.steps > spread.steps
