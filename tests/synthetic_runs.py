"""A synthetic run written straight into the telemetry store, for the dashboard's benchmark and
tests: a million plausible step rows in seconds, not the hours a real server would take.

The steps look like an adaptive run's: the load (batch size) swings slowly, the policy picks
bigger trees for smaller batches and explores now and then, step times come from
``synthetic.SyntheticSurface`` (so a retrain has something real to learn), acceptance falls off
with depth, and two policy versions take turns with the analytic fallback so the cost-model
page has something to compare. Rows go in with one ``executemany`` per chunk, bypassing the
telemetry writer (which is built for a steady trickle, not a bulk load).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from sqlalchemy import Engine, insert
from synthetic import GPU_PADDING, SyntheticSurface

from sglang_adatree import __version__
from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.features import build_feature_matrix, shape_columns
from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.telemetry.models import Run, Step
from sglang_adatree.telemetry.records import STEP_COLUMNS

CHUNK_ROWS = 50_000
TOP_RANK_ACCEPT = 0.6  # chance the top-ranked draft token is accepted
SIBLING_MISS = 0.7  # each extra sibling leaves this share of the remaining miss chance
RANK_SHARES = (0.8, 0.15, 0.05)  # share of accepted draft tokens by sibling rank
# Costly matmul tiles make the padding jumps large enough that a retrain has something a
# linear model cannot learn.
SURFACE = SyntheticSurface(per_tile_ms=1.5)


def insert_run(
    engine: Engine,
    *,
    started_at: float,
    candidate_shapes: Sequence[TreeShape] | None = None,
    target_model: str = "synthetic-target",
) -> int:
    """A ``runs`` row whose recorded config carries ``candidate_shapes``."""
    config = AdaTreeConfig() if candidate_shapes is None else AdaTreeConfig(tuple(candidate_shapes))
    with engine.begin() as conn:
        return int(
            conn.execute(
                insert(Run)
                .values(
                    started_at=started_at,
                    target_model=target_model,
                    draft_model="synthetic-draft",
                    device="cpu",
                    sglang_version="0.5.23",
                    package_version=__version__,
                    config=config.to_dict(),
                    node="synthetic",
                    rank=0,
                    dropped_steps=0,
                    rejected_steps=0,
                    unfinished_steps=0,
                )
                .returning(Run.id)
            ).scalar_one()
        )


def step_rows(
    run_id: int,
    num_steps: int,
    *,
    start_time: float,
    steps_per_s: float,
    shapes: Sequence[TreeShape],
    seed: int = 0,
    first_index: int = 0,
    run_steps: int | None = None,
) -> list[tuple]:
    """Steps ``first_index ..`` ``first_index + num_steps - 1`` of a run of ``run_steps``
    (default: these only), as rows in ``records.STEP_COLUMNS`` order."""
    run_steps = first_index + num_steps if run_steps is None else run_steps
    rng = np.random.default_rng(seed)
    i = np.arange(first_index, first_index + num_steps)  # [n]
    n = num_steps
    wall = start_time + i / steps_per_s + rng.uniform(0, 0.2 / steps_per_s, n)
    load = 0.5 + 0.5 * np.sin(i / (steps_per_s * 600.0) * 2 * np.pi)  # a 10-minute swing
    bs = np.clip(np.round(np.exp(load * np.log(200)) * rng.uniform(0.7, 1.3, n)), 1, 256)
    mean_ctx = rng.uniform(200, 3000, n)
    sum_ctx = np.round(bs * mean_ctx)
    max_ctx = np.minimum(sum_ctx, np.round(mean_ctx * rng.uniform(1.0, 3.0, n)))
    padded = GPU_PADDING.padded_array(bs)
    # The "policy": bigger trees for smaller batches, with 2% exploration.
    ordered = sorted(shapes, key=lambda s: -s.num_draft_tokens)
    pick = np.minimum((np.log2(bs) / 8.0 * len(ordered)).astype(int), len(ordered) - 1)
    explore = rng.random(n) < 0.02
    pick = np.where(explore, rng.integers(0, len(ordered), n), pick)
    cols = shape_columns(ordered)[pick]  # [n, 3]
    steps, topk, ndt = cols[:, 0], cols[:, 1], cols[:, 2]
    x = build_feature_matrix(bs, padded, sum_ctx, max_ctx, cols)  # [n, NUM_FEATURES]
    step_ms = SURFACE.step_ms(x, rng)
    # Acceptance: each depth is reached with probability q**d; q grows with siblings.
    q = 1.0 - (1.0 - TOP_RANK_ACCEPT) * SIBLING_MISS ** (topk - 1)
    depth = np.arange(1, 17)  # [16]
    reach = np.where(depth <= steps[:, None], q[:, None] ** depth, 0.0)  # [n, 16]
    reach = np.where(depth <= (ndt - 1)[:, None], reach, 0.0)
    accepted_depth = rng.binomial(bs.astype(np.int64)[:, None], np.clip(reach, 0, 1))
    accepted_depth = np.minimum.accumulate(accepted_depth, axis=1)  # paths are prefixes
    accepted = accepted_depth.sum(axis=1)
    emitted = accepted + bs
    accept_len = emitted / bs
    # The fallback for the first third of the run, then version 1, then version 2.
    version = np.where(i < run_steps // 3, -1, np.where(i < 2 * run_steps // 3, 1, 2))
    noise = np.where(version == 1, 0.15, 0.05)
    predicted_ms = step_ms * np.exp(rng.normal(0, noise))
    predicted_accept = accept_len * np.exp(rng.normal(0, 0.08, n))
    # The runner-up: the next bigger shape in the policy's order (the biggest's: the next
    # smaller), priced by the same surface and the expected acceptance of its tree.
    other = np.where(pick > 0, pick - 1, 1 % len(ordered))
    other_cols = shape_columns(ordered)[other]  # [n, 3]
    other_x = build_feature_matrix(bs, padded, sum_ctx, max_ctx, other_cols)
    other_ms = SURFACE.step_ms(other_x, rng) * np.exp(rng.normal(0, noise))
    other_q = 1.0 - (1.0 - TOP_RANK_ACCEPT) * SIBLING_MISS ** (other_cols[:, 1] - 1)
    other_reach = depth <= np.minimum(other_cols[:, 0], other_cols[:, 2] - 1)[:, None]
    other_accept = 1.0 + np.where(other_reach, other_q[:, None] ** depth, 0.0).sum(axis=1)
    other_label = [f"{a},{b},{c}" for a, b, c in _ints(other_cols)]
    # How the machine priced steps against the model: a drift that walks, speculation a
    # little dearer than the model says, and dearer the larger the shape.
    drift = np.cumsum(rng.normal(0, 0.01, n))
    tilt = 0.1 + 0.05 * np.sin(i / 500.0)
    offset = np.full(n, 0.05)
    source = np.where(explore, "explore", np.where(version < 0, "fallback", "model"))
    source[: max(0, 32 - first_index)] = "warmup"
    steps_l, topk_l = _ints(steps), _ints(topk)
    by_depth = [
        ",".join(map(str, d[:s])) for d, s in zip(accepted_depth.tolist(), steps_l, strict=True)
    ]
    ranks = np.round(accepted[:, None] * np.asarray(RANK_SHARES)[None, :])  # [n, ranks]
    by_rank = [
        ",".join(map(str, r[:k])) if s else ""
        for r, k, s in zip(_ints(ranks), topk_l, steps_l, strict=True)
    ]
    columns = (
        [run_id] * n,
        i.tolist(),
        wall.tolist(),
        _ints(bs),
        _ints(padded),
        _ints(sum_ctx),
        _ints(max_ctx),
        steps_l,
        topk_l,
        _ints(ndt),
        source.tolist(),
        [None if v < 0 else v for v in version.tolist()],
        predicted_ms.tolist(),
        step_ms.tolist(),
        predicted_accept.tolist(),
        accept_len.tolist(),
        _ints(emitted),
        _ints((ndt - 1) * bs),
        _ints(accepted),
        (emitted / step_ms * 1000.0).tolist(),
        other_label,
        other_ms.tolist(),
        other_accept.tolist(),
        drift.tolist(),
        tilt.tolist(),
        offset.tolist(),
        by_depth,
        by_rank,
    )
    assert len(columns) == len(STEP_COLUMNS)
    return list(zip(*columns, strict=True))


def _ints(values: np.ndarray) -> list[int]:
    return np.asarray(values).astype(np.int64).tolist()


def insert_steps(engine: Engine, rows: Sequence[tuple]) -> None:
    """Bulk-insert step rows (``STEP_COLUMNS`` order), one transaction per chunk.

    A driver-level ``executemany`` of tuples: three times faster than SQLAlchemy's insert of
    dicts, which matters at a million rows.
    """
    mark = "?" if engine.dialect.paramstyle == "qmark" else "%s"
    sql = (
        f"INSERT INTO {Step.__tablename__} ({', '.join(STEP_COLUMNS)}) "
        f"VALUES ({', '.join([mark] * len(STEP_COLUMNS))})"
    )
    for lo in range(0, len(rows), CHUNK_ROWS):
        with engine.begin() as conn:
            conn.exec_driver_sql(sql, list(rows[lo : lo + CHUNK_ROWS]))


def synthetic_run(
    engine: Engine,
    num_steps: int,
    *,
    steps_per_s: float = 50.0,
    end_time: float | None = None,
    shapes: Sequence[TreeShape] | None = None,
    seed: int = 0,
) -> int:
    """Insert a run of ``num_steps`` steps ending at ``end_time`` (default now); its id."""
    shapes = tuple(shapes or AdaTreeConfig().candidate_shapes)
    end_time = time.time() if end_time is None else end_time
    start_time = end_time - num_steps / steps_per_s
    run_id = insert_run(engine, started_at=start_time - 1.0, candidate_shapes=shapes)
    for lo in range(0, num_steps, CHUNK_ROWS):
        count = min(CHUNK_ROWS, num_steps - lo)
        rows = step_rows(
            run_id,
            count,
            start_time=start_time,
            steps_per_s=steps_per_s,
            shapes=shapes,
            seed=seed + lo,
            first_index=lo,
            run_steps=num_steps,
        )
        insert_steps(engine, rows)
    return run_id
