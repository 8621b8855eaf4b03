"""The operator's and developer's tools behind the ``adatree`` command: ``bench`` and
``compare`` (servers side by side), ``profile``, ``demo`` and ``retrain``."""
