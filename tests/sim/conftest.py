"""Fixtures of the simulator's tests."""

from __future__ import annotations

import pytest

from hlb.sim.catalogue import Catalogue, load_catalogue


@pytest.fixture(scope="module")
def catalogue() -> Catalogue:
    """The device catalogue, loaded once per module."""
    return load_catalogue()
