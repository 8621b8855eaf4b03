"""Alembic migrations of the telemetry database, one readable file per change in ``versions/``.

Run them with ``adatree db upgrade [--db URL]`` (``sglang_adatree.telemetry.store.upgrade``
builds the alembic configuration in code, so no ``alembic.ini`` is needed). To start a new one
from a changed ``sglang_adatree/telemetry/models.py``, autogenerate it against a database at
head, then read and tidy the file (SQLite alters tables in batch mode, ``render_as_batch``):

    from alembic import command
    from sglang_adatree.telemetry import store

    cfg = store.alembic_config()
    cfg.set_main_option("sqlalchemy.url", "sqlite:////tmp/dev.sqlite")
    command.revision(cfg, "what changed", autogenerate=True, rev_id="0003")
"""
