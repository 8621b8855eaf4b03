"""Which telemetry database each adatree-served configuration writes to, and its pin.

Servers under ``adatree serve`` record their steps in a telemetry database and read pins from
it. A pin in a database reaches every server that polls it, so a pinned configuration
(``adatree@S,K,N``) gets a SQLite database of its own in the work directory, migrated and
holding its one pin before the server starts; the others share the run's database
(``--db``), as servers of one deployment would. ``adatree compare`` runs its servers side by
side and gives every adatree-served one its own database (no shared URL): what one learns
or is pinned to never reaches another.

The pin is written through the operator-control module, as the dashboard writes one (a ``pins``
row and its ``audit_log`` entry), with the actor ``adatree bench``.
"""

from __future__ import annotations

from pathlib import Path

from sglang_adatree.core.policy import Pin
from sglang_adatree.telemetry import control
from sglang_adatree.telemetry.store import session_scope, upgrade
from sglang_adatree.tools.bench.configurations import Configuration

PIN_ACTOR = "adatree bench"


def database_url(config: Configuration, work_dir: Path, shared_url: str | None) -> str:
    """The database ``config``'s server records to and reads pins from; ``shared_url`` None:
    one of its own whatever the configuration (``adatree compare``)."""
    if config.pin is None and shared_url is not None:
        return shared_url
    return f"sqlite:///{(work_dir / f'telemetry-{config.slug}.sqlite').resolve()}"


def prepare_database(url: str, config: Configuration) -> None:
    """Migrate ``url`` to head; for a pinned configuration, pin its shape there unless an
    active pin of that shape for every batch size is there already (a re-run in the same work
    directory)."""
    upgrade(url)
    if config.pin is None:
        return
    with session_scope(url) as session:
        conn = session.connection()
        everywhere = (
            r
            for r in control.active_pins(conn)
            if r.min_batch_size is None and r.max_batch_size is None
        )
        if any(r.shape == config.pin for r in everywhere):
            return
        control.create_pin(
            conn,
            control.CandidateSet(config.candidate_shapes, "config", None),
            Pin(config.pin),
            f"{config.name}: pinned for the comparison",
            PIN_ACTOR,
        )
