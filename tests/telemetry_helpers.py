"""Helpers of the telemetry tests: step records, database counts, dropping root privileges."""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import func, select
from step_records import make_step

from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.models import Run, Step
from sglang_adatree.telemetry.records import RunRecord, StepRecord

RUN = RunRecord("test-target", "test-draft", "cpu", None, "0.1.0", {"min_gain": 0.03}, "n0", 0)


def steps_of(run_id: int, n: int, start: int = 0) -> list[StepRecord]:
    return [make_step(run_id, i) for i in range(start, start + n)]


def step_count(url: str, run_id: int) -> int:
    with store.session_scope(url) as s:
        return int(s.scalar(select(func.count()).where(Step.run_id == run_id)) or 0)


def step_indexes(url: str, run_id: int) -> list[int]:
    with store.session_scope(url) as s:
        return list(s.scalars(select(Step.step_index).where(Step.run_id == run_id)))


def run_row(url: str, run_id: int) -> Run:
    with store.session_scope(url) as s:
        return s.get_one(Run, run_id)


@contextmanager
def unprivileged(*paths: os.PathLike) -> Iterator[None]:
    """Run the block with file permissions enforced: as root (which ignores them), switch the
    effective user of the whole process to ``nobody`` after giving it ``paths``."""
    if os.geteuid() != 0:
        yield
        return
    nobody = pwd.getpwnam("nobody")
    for p in paths:
        os.chown(p, nobody.pw_uid, nobody.pw_gid)
    os.setegid(nobody.pw_gid)
    os.seteuid(nobody.pw_uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
