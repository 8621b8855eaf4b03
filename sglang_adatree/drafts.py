"""What kind of draft a checkpoint is, from its ``config.json``: one rule for every caller.

The SGLang adapter (to pick the worker) and the benchmark (to pick SGLang's own algorithm for the
static baselines, in a process without SGLang) must agree, so the rule lives here, pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DRAFT_KINDS = ("standalone", "eagle", "eagle3")


def draft_kind_of(config: Mapping[str, Any]) -> str:
    """``'eagle3'``, ``'eagle'`` or ``'standalone'``: an ``*Eagle*`` architecture is a head
    that reads the target's hidden states; anything else is a small model of its own."""
    architectures = [str(a).lower() for a in config.get("architectures") or []]
    if any("eagle3" in a for a in architectures):
        return "eagle3"
    if any("eagle" in a for a in architectures):
        return "eagle"
    return "standalone"
