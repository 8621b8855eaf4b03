"""``adatree soak``: a day in production, compressed. A real SGLang server with adatree and the
bundled model pair under a load whose rate moves, with the dashboard open in a browser, an
operator pinning shapes and retraining, the database made read-only, deleted and restored (or
PostgreSQL restarted), clients disconnecting mid-stream and bad requests; greedy answers compared
with a reference server's. The report says whether anything crashed, leaked, was lost or
misattributed, or changed.

Modules: ``schedule`` (when), ``load`` and ``bad_requests`` (what is sent), ``operator_client``
and ``browser`` (the dashboard's users), ``faults`` (the database's outages), ``memory`` (RSS),
``servers`` (the processes), ``tally`` (what is observed), ``report`` (what it adds up to),
``runner`` (one soak), ``commands`` (the CLI).
"""
