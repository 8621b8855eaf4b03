"""Shared fixtures: tiny model pairs and the telemetry database of the end-to-end tests."""

from __future__ import annotations

import pytest
from tiny_models import TinyModels, make_tiny_models


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return make_tiny_models(tmp_path_factory.mktemp("tiny-models"))
