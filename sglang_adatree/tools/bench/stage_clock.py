"""SGLang's scheduler stage clock, read from a server's ``/metrics``: where its time went.

Under ``--enable-metrics`` a scheduler adds the wall seconds of each stage of its event loop to
``sglang:scheduler_stage_seconds_total{category=...}``: ``run_batch`` (the forward, a
speculative step's draft, verify and adatree's decision included), ``process_batch_result``
(streaming the tokens out; adatree's step finish runs there too), ``get_next_batch_to_run``,
``idle`` and a few smaller ones; and the tokens it generated to
``sglang:generation_tokens_total``. Two readings around a measurement give each stage's
milliseconds per generated token; two servers fed the same prompts then show which stage one
of them spends more in, which a request's latency cannot.

The scheduler adds its stage times to the counter about once a second, while it runs: a reading
can miss up to the last second of stages before it (the generated tokens are counted as requests
finish), so a figure over a few minutes of a server's work is good to about 1%, one over a few
seconds is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import requests
from prometheus_client.parser import text_string_to_metric_families

STAGE_SERIES = "sglang:scheduler_stage_seconds_total"
TOKENS_SERIES = "sglang:generation_tokens_total"
IDLE = "idle"  # waiting for requests: not a cost of the tokens


@dataclass(frozen=True)
class StageClock:
    """One reading: seconds per stage category (summed over the other labels, ranks among
    them) and tokens generated, since the server started."""

    seconds: Mapping[str, float]
    generated_tokens: float


def parse_stage_clock(text: str) -> StageClock:
    """The stage clock in a Prometheus text exposition; raises ``ValueError`` when the server
    exports no stage series (started without ``--enable-metrics``) or the text does not parse."""
    seconds: dict[str, float] = {}
    tokens = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == STAGE_SERIES and "category" in sample.labels:
                found = True
                stage = sample.labels["category"]
                seconds[stage] = seconds.get(stage, 0.0) + sample.value
            elif sample.name == TOKENS_SERIES:
                tokens += sample.value
    if not found:
        raise ValueError(f"no {STAGE_SERIES} series (is the server started with --enable-metrics?)")
    return StageClock(seconds, tokens)


def read_stage_clock(session: requests.Session, url: str, timeout_s: float = 30.0) -> StageClock:
    """A reading of the server at ``url``."""
    response = session.get(f"{url}/metrics", timeout=timeout_s)
    response.raise_for_status()
    return parse_stage_clock(response.text)


def ms_per_token(before: StageClock, after: StageClock) -> dict[str, float]:
    """Milliseconds per generated token of each stage but ``idle`` between two readings,
    largest first; raises ``ValueError`` when no token was generated between them."""
    tokens = after.generated_tokens - before.generated_tokens
    if tokens <= 0:
        raise ValueError("no tokens generated between the two readings")
    spent = {
        stage: 1000.0 * (s - before.seconds.get(stage, 0.0)) / tokens
        for stage, s in after.seconds.items()
        if stage != IDLE
    }
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))
